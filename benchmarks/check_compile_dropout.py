"""torch.compile + stage 3 + dropout against compiled torch.optim, three steps of a GPT-2 with
dropout 0.1, one process: ``python benchmarks/check_compile_dropout.py inductor|fallback``.

Why they differ with inductor's own RNG (Note [compiled stage 3] in
zeroshard/stages/stage3/gatherer.py): stage 3's gather/release hooks run eagerly, so the
compiled forward is one graph per unit instead of one; inductor draws each graph's dropout
masks from its own seed (taken from torch's generator once per graph), so the masks differ
from a single-graph compile -- same distribution, other draws. With
``torch._inductor.config.fallback_random = True`` compiled dropout uses torch's eager RNG in op
order, and stage 3 equals compiled torch bit for bit. Measured (docs/results.md): inductor
RNG 7.4e-3 max loss difference over 3 steps, fallback_random 0.0."""
import sys, torch, zeroshard
import torch._inductor.config as ic
from transformers import GPT2Config, GPT2LMHeadModel
ic.fallback_random = sys.argv[1] == "fallback"
def gpt2():
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32,
                                      resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1))
def run(zero):
    model = gpt2()
    opt = (zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-3, stage=3) if zero
           else torch.optim.AdamW(model.parameters(), lr=1e-3))
    fwd = torch.compile(model)
    torch.manual_seed(1)
    losses = []
    for step in range(3):
        ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(step))
        loss = fwd(input_ids=ids, labels=ids).loss
        loss.backward(); opt.step(); opt.zero_grad()
        losses.append(float(loss))
    return losses
a, b = run(False), run(True)
print(sys.argv[1], "torch", a, "zeroshard", b, "max diff", max(abs(x - y) for x, y in zip(a, b)))
