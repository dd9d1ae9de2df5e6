"""Complex parameters (issue 39; Note [complex parameters] in zeroshard/layout/unit_layout.py):
trained as torch.optim trains them (the real view), at stages 0-3 and CPU offload, on 1 and 2
gloo ranks, the ZeRO slice boundary inside a complex parameter; torch-format state with complex
moments out and in; native checkpoints round trip and reshard (2 ranks -> 1) bit for bit; mixed
precision refused naming the parameter. One spawn per world size (tests/support/complex_params_worker.py)."""
from __future__ import annotations

import pytest
import torch

import zeroshard
from tests.support import complex_params_worker as worker
from tests.support.asserts import assert_same
from tests.support.dist_results import run_ranks


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    two = tmp_path_factory.mktemp("complex2")
    out = {2: run_ranks(worker.run, 2, two)}
    out[1] = run_ranks(worker.run, 1, tmp_path_factory.mktemp("complex1"), str(two))
    out["dir"] = str(two)
    return out


def _leaves(tree, path=""):
    for k, v in tree.items():
        if isinstance(v, dict):
            yield from _leaves(v, f"{path}{k}.")
        else:
            yield f"{path}{k}", v


def _check(tree: dict, bitwise: bool, what: str) -> None:
    assert tree, f"{what}: nothing compared"
    bad = [(k, v) for k, v in _leaves(tree) if isinstance(v, str) or v > (0.0 if bitwise else 1e-5)]
    assert not bad, f"{what}: differs from torch.optim ({'bitwise' if bitwise else 'within 1e-5'}): {bad[:6]}"


@pytest.mark.parametrize("world", (1, 2))
@pytest.mark.parametrize("case", worker.CASES, ids=lambda c: worker.case_key(*c))
def test_complex_parameters_match_torch_optim(results, world, case):
    for rank, per_rank in enumerate(results[world]):
        r = per_rank[worker.case_key(*case)]
        _check(r["weights"], r["bitwise"], f"rank {rank} weights")
        _check(r["state"], r["bitwise"], f"rank {rank} consolidated state")  # complex moments, torch's keys and shapes
        if case[0] == 0:
            _check(r["view"], r["bitwise"], f"rank {rank} opt.state")
        if world == 2 and case[0] > 0:
            assert r["boundary_in_complex"], "the layout put no slice boundary inside a complex parameter"


@pytest.mark.parametrize("world", (1, 2))
def test_torch_state_dict_with_complex_moments_loads(results, world):
    for per_rank in results[world]:
        for stage, r in per_rank["load_torch_state"].items():
            _check(r["weights"], True, f"{stage} weights")
            _check(r["state"], True, f"{stage} state")


@pytest.mark.parametrize("world", (1, 2))
def test_sharded_state_dict_round_trip_with_complex_parameters(results, world):
    for per_rank in results[world]:
        for stage, r in per_rank["sharded_state"].items():
            _check(r, True, f"{stage} sharded state")


@pytest.mark.parametrize("world", (1, 2))
def test_checkpoint_round_trip_with_complex_parameters(results, world):
    for per_rank in results[world]:
        for stage, r in per_rank["checkpoint"].items():
            _check(r, True, f"{stage} checkpoint")


def test_checkpoint_saved_at_two_ranks_loads_at_one(results):
    r = results[1][0]["resharded"]
    for stage in ("stage2", "stage3"):
        assert r[stage]["step"] == 2
        _check({k: r[stage][k] for k in ("weights", "state")}, True, f"{stage} resharded")


@pytest.mark.parametrize("precision", ("bf16", "fp16"))
def test_mixed_precision_with_complex_parameters_is_refused(precision):
    model = worker.Mixed()
    with pytest.raises(ValueError, match=r"'c1'.*complex64.*mixed_precision"):
        zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-3, mixed_precision=precision)
    assert model.c1.dtype == torch.complex64  # (the refused construction left the model as it was)


def test_export_writes_complex_parameters_as_complex(results, tmp_path):
    from safetensors.torch import load_file
    import glob
    import os
    zeroshard.export_hf(os.path.join(results["dir"], "ckpt-stage2"), str(tmp_path / "hf"))
    got = {}
    for f in glob.glob(str(tmp_path / "hf" / "*.safetensors")):
        got.update(load_file(f))
    want = torch.load(os.path.join(results["dir"], "saved-stage2.pt"))["weights"]
    assert got["c1"].dtype == torch.complex64 and got["c1"].shape == (5, 3)
    assert_same(got, want, "exported weights")
    # and back in: load_safetensors reads a complex tensor's owned complex elements (stage 3, one rank)
    model = worker.Mixed()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    opt = zeroshard.ZeroOptimizer(model, torch.optim.Adam, stage=3, lr=1e-2)
    zeroshard.load_safetensors(model, str(tmp_path / "hf"))
    assert_same(zeroshard.full_state_dict(model), want, "weights loaded from the export")
    opt.close()


class _HeldWhole(torch.nn.Module):
    """Complex tensors a checkpoint stores whole: a buffer and a frozen parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("phase", torch.randn(3, dtype=torch.complex64))
        self.frozen = torch.nn.Parameter(torch.randn(5, dtype=torch.complex64), requires_grad=False)
        self.c = torch.nn.Parameter(torch.randn(3, dtype=torch.complex64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).sum() + (self.c * self.phase).abs().sum() + self.frozen.abs().sum()


@pytest.mark.parametrize("stage", [0, 3])
def test_complex_buffers_and_frozen_parameters_round_trip(tmp_path, stage):
    """A complex buffer or frozen parameter (held whole, not trained) saves as its reals with
    its complex dtype in the manifest and loads back bit for bit (the save raised KeyError)."""
    torch.manual_seed(0)
    model = _HeldWhole()
    opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-2, stage=stage)
    model(torch.randn(2, 4)).backward()
    opt.step()
    zeroshard.save_checkpoint(str(tmp_path), step=1, model=model, optimizer=opt)
    saved = {k: v.detach().clone() for k, v in model.state_dict().items()}
    torch.manual_seed(1)
    other = _HeldWhole()
    opt2 = zeroshard.ZeroOptimizer(other, torch.optim.AdamW, lr=1e-2, stage=stage)
    zeroshard.load_checkpoint(str(tmp_path), model=other, optimizer=opt2)
    assert_same(saved, {k: v.detach() for k, v in other.state_dict().items()})
