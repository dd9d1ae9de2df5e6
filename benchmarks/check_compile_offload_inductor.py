"""Activation offload under a whole-model torch.compile with inductor, against the same compiled
model without offload and against it with a graph break at each block's start and end:
``python benchmarks/check_compile_offload_inductor.py [fallback]`` (TinyGPT, 3 checkpointed
blocks, dropout 0.1, stage 1, two steps, CPU). Prints each pair's largest gradient difference
and whether every gradient is the same bits (Note [activation offload under inductor] in
zeroshard/offload/activations/compiled_split.py; figures in docs/results.md)."""
import sys

import torch
import torch._inductor.config as ic

import zeroshard
from zeroshard.testing.toy import GPTConfig, TinyGPT, synthetic_batch

ic.fallback_random = "fallback" in sys.argv[1:]
CFG = GPTConfig(vocab=64, d_model=32, n_layers=3, n_heads=4, seq_len=16, dropout=0.1, activation_checkpointing=True)


def _break(*_: object) -> None:
    torch._dynamo.graph_break()


def run(mode: str) -> list[dict]:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = TinyGPT(CFG)
    if mode == "breaks":  # (where the offloader's hooks break the graph, without offload)
        for block in model.blocks:
            block.register_forward_pre_hook(_break)
            block.register_forward_hook(_break)
    kw = {"offload_activations": zeroshard.ActivationOffload(where="cpu", min_bytes=0, inductor_split=True)
          } if mode == "offload" else {}
    opt = zeroshard.ZeroOptimizer(model, torch.optim.SGD, lr=0.1, stage=1, **kw)
    compiled = torch.compile(model)
    torch.manual_seed(1)
    grads = []
    for step in range(2):
        compiled(*synthetic_batch(step, 4, CFG)).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    opt.close()
    return grads


runs = {m: run(m) for m in ("plain", "breaks", "offload")}
for a, b in (("offload", "plain"), ("offload", "breaks"), ("breaks", "plain")):
    diff = max((x[n] - y[n]).abs().max().item() for x, y in zip(runs[a], runs[b]) for n in x)
    same = all(torch.equal(x[n], y[n]) for x, y in zip(runs[a], runs[b]) for n in x)
    print(f"fallback_random={ic.fallback_random} {a} vs {b}: max |grad diff| {diff:.3g}, same bits {same}")
