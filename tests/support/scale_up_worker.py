"""Workers for tests/dist/test_memory_tier_scale_up.py (issue 45: "a node that joins later pulls
only its partition from peers"): ``train`` (world 2) commits steps 1-3 to the memory tier and
saves step 3 to disk; ``grow`` (world 3, a new launch on the same node) recovers from the memory
tiers: rank 2, the newcomer, holds no slot and receives its partition from the two old ranks.
The reference loads the disk's step 3 at world 3 in the same processes."""
from __future__ import annotations

import json

import torch

import zeroshard
from tests.support.peer_worker import owned_state


def _build(root=None):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
    red = zeroshard.PeerRedundancy(path=root, run_id="grow", every=1) if root else None
    opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-2, stage=2, bucket_size_mb=0.001,
                                  redundancy=red)
    return model, opt


def train(rank: int, world: int, out_path: str, root: str, disk: str) -> None:
    m, o = _build(root)
    for s in range(3):
        g = torch.Generator().manual_seed(100 * s + rank)
        o.backward(m(torch.randn(4, 16, generator=g)).square().mean())
        o.step()
        o.zero_grad()
        zeroshard.memory_checkpoint(s + 1, model=m, optimizer=o)
    zeroshard.save_checkpoint(disk, 3, model=m, optimizer=o)
    o.engine.memory_tier.wait()
    o.close()
    with open(f"{out_path}.rank{rank}", "w") as f:
        json.dump({}, f)


def grow(rank: int, world: int, out_path: str, root: str, disk: str) -> None:
    m, o = _build(root)
    info = zeroshard.load_checkpoint(root + "-no-disk", model=m, optimizer=o)
    got = owned_state(m, o)
    mine = sum(t.numel() * t.element_size() for k, t in got.items() if "|scalar." not in k)
    ref_m, ref_o = _build()
    zeroshard.load_checkpoint(disk, model=ref_m, optimizer=ref_o)
    ref = owned_state(ref_m, ref_o)
    out = {k: info.get(k) for k in ("step", "source", "world_size", "resharded", "bytes_received")}
    out.update(owned_bytes=mine, equal=got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in got),
               params_equal=all(torch.equal(a, b) for a, b in zip(m.parameters(), ref_m.parameters())))
    o.close()
    ref_o.close()
    with open(f"{out_path}.rank{rank}", "w") as f:
        json.dump(out, f)
