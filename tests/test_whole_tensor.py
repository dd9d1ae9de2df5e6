"""Optimizers that read whole tensors (issue 25): torch.optim.Muon beside AdamW (one
ZeroOptimizer, a param group naming its class) and torch.optim.Adafactor, at stages 0-3 on a
transformers Llama, against the same torch classes in one process on the same global batch,
8 steps with clipping that bites (tests/whole_tensor_worker.py)."""
from __future__ import annotations

import pytest
import torch

import zeroshard
from tests import whole_tensor_worker as w
from tests.dist_results import run_ranks
from zeroshard.layout.bucketing import NamedParam, assign_owners, owner_layouts, update_cost

pytest.importorskip("transformers")

MUON_CLIPPED = 5e-2  # measured 3.45e-2 at world 2


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    cache: dict[int, list[dict]] = {}

    def get(world: int) -> list[dict]:
        if world not in cache:
            cache[world] = ([w.run_one_process()] if world == 1 else
                            run_ranks(w.worker, world, tmp_path_factory.mktemp(f"whole{world}")))
        return cache[world]
    return get


@pytest.mark.parametrize("world", (1, 2))
@pytest.mark.parametrize("case", w.CASES, ids=lambda c: w.key(*c))
def test_matches_torch(results, world, case):
    recipe, stage, max_norm = case
    for r in results(world):
        got = r[w.key(*case)]
        if max_norm == w.MAX_NORM:
            assert all(n > max_norm for n in got["ref_norms"])  # (clipping bites every step)
        assert got["moved"] > 1e-3
        # Without clipping both match torch's bits at world 1 and 2 (the reference sums the ranks'
        # gradients then averages, as data parallelism does). Clipping's global norm is summed in
        # float64 over shards, torch's in float32: the coefficient differs in its last bit, which
        # Adafactor carries as such (< 1e-5) and Muon's bf16 Newton-Schulz turns into flipped
        # roundings that later steps carry on: bound as measured, 8 steps (issue 25's note)
        bound = 0.0 if max_norm == w.NO_CLIP else 1e-5 if recipe == "adafactor" or world == 1 else MUON_CLIPPED
        assert got["rel"] <= bound, (recipe, stage, got["rel"])
        assert got["norms"] == pytest.approx(got["ref_norms"], rel=1e-5 if bound <= 1e-5 else 1e-3)


def test_each_whole_tensor_parameter_has_one_owner_and_owners_share_the_work(results):
    r = results(2)[0]["muon-2"]
    owners = {n: o for n, o in r["owners"].items() if ".layers." in n and "norm" not in n}
    assert set(owners.values()) == {0, 1}
    model = w.llama()
    shapes = dict((n, p.shape) for n, p in model.named_parameters())
    loads = [sum(update_cost(shapes[n]) for n, o in owners.items() if o == rank) for rank in (0, 1)]
    assert max(loads) / min(loads) <= 1.25, loads


def test_owner_layouts_keep_parameters_whole_and_balance_cost():
    ps = [NamedParam(f"w{i}", torch.nn.Parameter(torch.zeros(s)), 0)
          for i, s in enumerate([(64, 32), (32, 32), (16, 32), (16, 32), (32, 32), (64, 32), (32, 64), (32, 64)])]
    for world in (2, 3, 4):
        seen = set()
        for layout, members in owner_layouts(ps, world, bucket_numel=4096):
            for rank in range(world):
                lo, hi = layout.slice_of(rank)
                for seg in layout.segments:
                    assert seg.end <= lo or seg.offset >= hi or (lo <= seg.offset and seg.end <= hi)  # never split
            seen |= {m.name for m in members}
        assert seen == {m.name for m in ps}
        costs = [sum(update_cost(m.true_shape) for m in rank) for rank in assign_owners(ps, world)]
        assert max(costs) <= 1.25 * min(costs) or world == 4


def test_what_cannot_be_sharded_is_still_refused():
    model = w.llama()
    with pytest.raises(ValueError, match="LBFGS.*elementwise"):
        zeroshard.ZeroOptimizer(model, torch.optim.LBFGS)
    with pytest.raises(ValueError, match="param group 0.*SparseAdam"):
        zeroshard.ZeroOptimizer([{"params": list(model.parameters()), "optimizer_class": torch.optim.SparseAdam}],
                                torch.optim.AdamW)
    with pytest.raises(TypeError, match="param group 0.*class"):
        zeroshard.ZeroOptimizer([{"params": list(model.parameters()), "optimizer_class": "Muon"}], torch.optim.AdamW)


@pytest.mark.parametrize("recipe,stage", [("muon", 2), ("muon", 3), ("adafactor", 2)])
def test_resumes_bit_for_bit_and_reshards_2_to_1(tmp_path, recipe, stage):
    root = str(tmp_path / "ckpt")
    out = str(tmp_path / "res")
    from zeroshard.launch import spawn
    spawn(w.resume_worker, 2, out, root, recipe, stage)
    import json
    for r in range(2):
        got = json.load(open(f"{out}.rank{r}"))
        assert got["load_equal"] and got["resume_equal"], got
    assert "momentum_buffer" in got["keys"] if recipe == "muon" else "row_var" in got["keys"]
    w.reshard_worker(0, 1, out + "1", root, recipe, stage, f"{out}.saved_state.pt")
    assert json.load(open(f"{out}1.rank0"))["equal"]
