"""A placement policy added in one file (tests/support/placement_example.py) drives a ZeroOptimizer
without a change to the facade or the assembly, and trains as torch.optim does."""
from __future__ import annotations

import pytest
import torch

import zeroshard
from tests.support.models import TinyNet, batch
from tests.support.placement_example import LargestOnHost
from tests.support.asserts import assert_same
from zeroshard.config import Placement


def _built(policy: type = LargestOnHost) -> tuple[torch.nn.Module, zeroshard.ZeroOptimizer]:
    torch.manual_seed(0)
    model = TinyNet()
    # (small units: the model spans several, so "the largest" is a choice)
    return model, zeroshard.ZeroOptimizer(model, torch.optim.AdamW, stage=2, lr=1e-2, bucket_size_mb=0.001,
                                          placement_policy=policy)


def test_the_policy_decides_each_unit_and_training_matches_torch():
    model, opt = _built()
    ref = TinyNet()
    ref.load_state_dict(model.state_dict())
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    assert isinstance(opt.engine.placement, LargestOnHost) and len(opt.units) > 1
    decided = [opt.engine.placement.of_unit(i) for i in range(len(opt.units))]
    largest = opt.engine.placement.on_host
    assert opt.units[largest].layout.padded_numel == max(u.layout.padded_numel for u in opt.units)
    assert decided[largest] == Placement(optimizer="cpu")
    assert all(d == Placement() for i, d in enumerate(decided) if i != largest)
    for step in range(4):
        for m, o in ((model, opt), (ref, ropt)):
            m(batch(step, 4)).backward()
            o.step()
            o.zero_grad()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="host and device memory differ only beside an accelerator")
def test_the_largest_units_state_lives_on_the_host():
    _, opt = _built()
    largest = opt.engine.placement.on_host
    assert [u.master.device.type for u in opt.units] == ["cpu" if i == largest else "cuda"
                                                         for i in range(len(opt.units))]


def test_a_policy_that_is_not_a_placement_is_refused_before_the_model_is_touched():
    model = TinyNet()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(TypeError, match="must subclass zeroshard.offload.placement.StatePlacement"):
        zeroshard.ZeroOptimizer(model, torch.optim.AdamW, placement_policy=dict)
    with pytest.raises(TypeError, match="must be a class"):
        zeroshard.ZeroOptimizer(model, torch.optim.AdamW, placement_policy=LargestOnHost.__new__(LargestOnHost))
    assert_same(model.parameters(), before, "parameters after the refusals")
    zeroshard.ZeroOptimizer(model, torch.optim.AdamW, placement_policy=LargestOnHost)  # (the model is free again)
