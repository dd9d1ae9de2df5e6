"""Convergence with quantized collectives (ZeRO++ qwZ / qgZ) against full precision, same run.

    python benchmarks/bench_quantized_convergence.py --world-size 2 --steps 300
    python benchmarks/bench_quantized_convergence.py --world-size 4 --steps 300

A small GPT-2 (transformers, 2 blocks, n_embd 64, vocab 64) on fixed data (2,400 sequences of 16
tokens drawn once from a seeded order-1 Markov chain: 300 steps x 8 never repeat one, so the loss
falls towards the chain's entropy instead of towards 0 by memorising, and a 1% difference means
something), stage 3, AdamW lr 3e-3, one global batch of 8 sequences per step split over the
ranks. Every codec configuration starts from the same weights and sees the same batches; the
figure is the final loss (mean of the last 20 steps over every rank's batch) as a ratio to the
full-precision run's, target within 1%. At world 4 the ranks are 2 "nodes" x 2 and the hpZ
rows quantize only the inter-node link (``codec_links="inter_node"``). Prints one JSON line per
configuration and a table.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

VOCAB, SEQ, N_SEQ, BATCH = 64, 16, 2400, 8


def configs(world: int, specs: list[str]) -> list[tuple[str, dict]]:
    from zeroshard.comm.codecs.codec_options import codec_kwargs
    out = [("fp32", {}),
           ("qwZ int8 + qgZ int8", {"weight_codec": "int8", "grad_codec": "int8"}),
           ("qwZ int8 + qgZ int4, error feedback", {"weight_codec": "int8", "grad_codec": "int4",
                                                    "grad_error_feedback": True}),
           ("qwZ int8 + qgZ int4, no feedback", {"weight_codec": "int8", "grad_codec": "int4"}),
           ("qwZ fp8 + qgZ int8, CPU offload", {"weight_codec": "fp8", "grad_codec": "int8",
                                                "offload_optimizer": "cpu"})]
    out += [(f"--codec {c}", codec_kwargs(c)) for c in specs]
    if world == 4:
        out += [("hpZ fp32", {"hpz": True}),
                ("hpZ + qwZ int8 + qgZ int4 EF, inter-node", {"hpz": True, "weight_codec": "int8", "grad_codec": "int4",
                                                              "grad_error_feedback": True,
                                                              "codec_links": "inter_node"})]
    return out


def data() -> Any:
    import torch
    g = torch.Generator().manual_seed(0)
    trans = torch.softmax(torch.randn(VOCAB, VOCAB, generator=g) * 3, dim=1)
    seqs = torch.empty(N_SEQ, SEQ, dtype=torch.long)
    seqs[:, 0] = torch.randint(0, VOCAB, (N_SEQ,), generator=g)
    for t in range(1, SEQ):
        seqs[:, t] = torch.multinomial(trans[seqs[:, t - 1]], 1, generator=g).squeeze(1)
    return seqs


def worker(rank: int, world: int, out_path: str, steps: int, specs: list[str]) -> None:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    import zeroshard
    seqs = data()
    results = {}
    for name, kwargs in configs(world, specs):
        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=64, n_layer=2, n_head=4,
                                           resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
        if kwargs.get("hpz"):
            from torch.distributed.device_mesh import init_device_mesh
            kwargs = {**kwargs, "mesh": init_device_mesh("cpu", (2, 2), mesh_dim_names=("node", "local"))}
        opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=3e-3, stage=3, **kwargs)
        per = BATCH // world
        losses = []
        for step in range(steps):
            idx = torch.arange(step * BATCH, (step + 1) * BATCH) % N_SEQ
            batch = seqs[idx][rank * per:(rank + 1) * per]
            loss = model(input_ids=batch, labels=batch).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(float(loss.detach()))
        results[name] = {"losses": losses, "errors": dict(opt.engine.codecs.last_step_error)}
        opt.close()
    with open(f"{out_path}.rank{rank}", "w") as f:
        json.dump(results, f)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=int, default=2, choices=(2, 4))
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--codec", action="append", default=[],
                    help="add a configuration: a codec spec (zeroshard.comm.codecs.codec_options.codec_kwargs), "
                         "e.g. 'weights=fp8,grads=int8,feedback'")
    args = ap.parse_args()
    from zeroshard.testing.launch import spawn
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "res")
        spawn(worker, args.world_size, out, args.steps, args.codec)
        ranks = [json.load(open(f"{out}.rank{r}")) for r in range(args.world_size)]
    tail = 20

    def final(name: str) -> float:
        return sum(sum(r[name]["losses"][-tail:]) / tail for r in ranks) / len(ranks)
    print(f"world {args.world_size}, {args.steps} steps; final loss = mean of the last {tail} steps over ranks")
    print(f"{'configuration':45s} {'first':>7s} {'final':>7s} {'vs fp32':>8s}  largest error of the last step")
    for name, _ in configs(args.world_size, args.codec):
        base = "hpZ fp32" if name.startswith("hpZ") else "fp32"
        ratio = final(name) / final(base)
        print(f"{name:45s} {ranks[0][name]['losses'][0]:7.4f} {final(name):7.4f} {ratio:8.4f}  "
              f"{ranks[0][name]['errors']}")
        print(json.dumps({"world": args.world_size, "config": name, "final": final(name), "ratio": ratio}))


if __name__ == "__main__":
    main()
