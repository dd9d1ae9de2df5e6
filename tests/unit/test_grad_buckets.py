"""Where a backward's gradients go before the optimizer sees them (Note [in-place first pass]).

When the gradient store spans the whole unit (stages 0-1; stages 2-3 with one rank in the
shard group, as in single-GPU offload), the first backward after ``zero_grad`` copies each
gradient straight into the store: no bucket is allocated beside it and no second copy runs.
A store kept in a swap file gets its memory at the unit's first gradient and is written out
from there. The results must be torch.optim's, whatever the path.
"""
from __future__ import annotations

import copy

import pytest
import torch

import zeroshard
from zeroshard.testing.toy import GPTConfig, TinyGPT, synthetic_batch

CFG = GPTConfig(vocab=64, d_model=32, n_layers=3, n_heads=4, seq_len=8)


def _watch_buckets(opt) -> list[int]:
    """Bytes of buckets alive (beside the gradient stores) as each unit's reduction starts."""
    seen: list[int] = []
    opt.engine.reducer.on_launch.append(lambda _ui: seen.append(opt.engine.reducer.live_bucket_bytes()))
    return seen


@pytest.mark.parametrize("stage,offload", [(2, None), (3, None), (3, "nvme")])
def test_one_rank_backward_fills_the_gradient_store_itself(stage, offload, tmp_path):
    torch.manual_seed(0)
    ref = TinyGPT(CFG)
    model = copy.deepcopy(ref)
    place = {} if offload is None else dict(offload_optimizer="nvme", offload_params="nvme", nvme_path=str(tmp_path))
    opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-2, stage=stage, **place)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    seen = _watch_buckets(opt)
    for step in range(3):
        for m, o in ((model, opt), (ref, ref_opt)):
            m(*synthetic_batch(step, 4, CFG)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    assert seen and max(seen) == 0, f"a bucket was allocated beside the gradient store: {max(seen)} bytes"
    got = zeroshard.full_state_dict(model)
    for name, p in ref.named_parameters():
        assert torch.allclose(got[name], p.detach(), rtol=0, atol=1e-6), name
    opt.close()


@pytest.mark.parametrize("offload", [None, "nvme"])
def test_accumulated_micro_batches_still_take_a_bucket(offload, tmp_path):
    """The second micro-batch adds onto a reduced sum, so it needs its own bucket."""
    torch.manual_seed(0)
    model = TinyGPT(CFG)
    place = {} if offload is None else dict(offload_optimizer="nvme", nvme_path=str(tmp_path))
    opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-2, stage=2, **place)
    seen = _watch_buckets(opt)
    model(*synthetic_batch(0, 4, CFG)).backward()
    first = list(seen)
    model(*synthetic_batch(1, 4, CFG)).backward()
    assert max(first) == 0 and max(seen[len(first):]) > 0
    opt.close()
