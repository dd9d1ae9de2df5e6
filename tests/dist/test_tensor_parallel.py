"""Tensor parallelism (Note [tensor-parallel parameters]): a Llama parallelised with torch's
parallelize_module on the "tp" dimension of a ("dp", "tp") mesh, sharded by ZeroOptimizer over
"dp"; parity with single-process torch.optim.AdamW and checkpoints that reshard between
TP layouts and plain or hybrid data parallelism."""
from __future__ import annotations

import itertools

import pytest
import torch

from tests.support import tp_worker as w
from tests.support.asserts import assert_same
from tests.support.dist_results import run_ranks
from zeroshard.checkpoint import tp_layout
from zeroshard.comm.tensor_parallel import Split


def _chunks(n: int, parts: int) -> tuple[int, ...]:
    c = -(-n // parts)  # torch.chunk's sizes (the last ones may be smaller or empty)
    return tuple(max(0, min(c, n - i * c)) for i in range(parts))


def _stored(t: torch.Tensor, split) -> torch.Tensor:
    if split is None:
        return t.reshape(-1)
    return torch.cat([c.reshape(-1) for c in t.split(list(split.sizes), dim=split.dim)])


@pytest.mark.parametrize("shape", [(6, 10), (4, 6, 5), (7,)])
def test_stored_order_reads_any_range_of_any_layout(shape):
    """Every range of every reader view (whole, or a chunk of a split along any dimension, into
    2 or 3 parts) is read exactly from a checkpoint stored at every other split."""
    t = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).view(shape)
    splits = [None] + [Split(d, _chunks(shape[d], n)) for d in range(len(shape)) for n in (2, 3)]
    for saved, split in itertools.product(splits, splits):
        stored = _stored(t, saved)
        views = [(None, t)] if split is None else [((split, k), c) for k, c in
                                                   enumerate(t.split(list(split.sizes), dim=split.dim))]
        for target, want in views:
            flat = want.reshape(-1)
            for a, b in [(0, flat.numel()), (1, max(1, flat.numel() - 2)), (flat.numel() // 2, flat.numel())]:
                ranges, build = tp_layout.plan(shape, saved, target, a, b)
                got = build([stored[lo:hi] for lo, hi in ranges]) if ranges else torch.empty(0)
                assert torch.equal(got, flat[a:b]), (saved, target, a, b)


@pytest.fixture(scope="module", params=[1, 2, 3], ids=["stage1", "stage2", "stage3"])
def trained(request, tmp_path_factory):
    """dp 2 x tp 2 on 4 gloo ranks, 8 steps, then a checkpoint (and the full state it holds)."""
    d = tmp_path_factory.mktemp(f"tp-stage{request.param}")
    ckpt = str(d / "ckpt")
    return request.param, ckpt, run_ranks(w.parity_worker, 4, d, request.param, ckpt)


def test_dp2_tp2_trains_like_one_process(trained):
    """Weights (gathered with full_tensor) and losses equal single-process torch.optim.AdamW
    on the same global batch, clipping by the global norm on every step; gradients cross dp
    only (the tp group carries nothing but the norm's partial sums), and a checkpoint
    resumed at dp 2 x tp 2 holds exactly the state it was saved from."""
    _, _, ranks = trained
    for r in ranks:
        assert r["dtensors"] == 14, r  # q, k, v, o, gate, up, down of 2 layers stay DTensors
        assert r["diff"] < 1e-5 and r["vs_reference"] < 1e-5, r
        assert r["loss_diff"] < 1e-5, r
        rep = r["report"]
        assert rep["norm@tp"]["calls"] == w.STEPS and rep["norm@tp"]["dimension"] == "tp", rep
        assert all(v["dimension"] == "dp" for k, v in rep.items() if not k.endswith("@tp")), rep
        assert set(k for k in rep if k.endswith("@tp")) == {"norm@tp"}, rep
        assert r["same_layout"] <= 1e-6, r


@pytest.mark.parametrize("layout", ["dp4", "hybrid", "dp1", "tp4", "dp2tp2"])
def test_dp2_tp2_checkpoint_loads_at_other_layouts(trained, layout, tmp_path):
    """The checkpoint written at dp 2 x tp 2 loads at dp 4 x tp 1, a hybrid (2 groups x 2)
    mesh, one process, dp 1 x tp 4 (other chunks) and dp 2 x tp 2 at the other stage; weights
    and Adam moments equal the source's full state."""
    stage, ckpt, _ = trained
    target_stage = {1: 2, 2: 3, 3: 1}[stage] if layout == "dp2tp2" else stage
    for r in run_ranks(w.load_worker, 1 if layout == "dp1" else 4, tmp_path, layout, target_stage, ckpt):
        assert r["diff"] <= 1e-6 and r["resharded"], r


def test_rowwise_moments_load_in_global_order_at_plain_dp(tmp_path):
    """A stage-3 dp 1 x tp 2 checkpoint loaded at plain dp 2: each rank's run of the rowwise
    weight (one run per parameter) lies inside one tp chunk saved in chunk order (Note [stored
    order]); its Adam moments are read in the global order, not adopted as the saved bytes
    (Note [adopting verified state]). Weights, moments and step counts equal the source's."""
    ckpt = str(tmp_path / "ckpt")
    run_ranks(w.small_tp_save_worker, 2, tmp_path, ckpt)
    (tmp_path / "load").mkdir()
    ranks = run_ranks(w.small_dp_load_worker, 2, tmp_path / "load", ckpt)
    assert all(r["resharded"] for r in ranks), ranks
    assert [r["runs"] for r in ranks] == [[[0, 64], [0, 64]], [[64, 128], [64, 128]]], ranks  # (one per parameter)
    want = torch.load(f"{ckpt}.source.pt", weights_only=True)
    got = torch.load(str(tmp_path / "load" / "res.loaded.pt"), weights_only=True)
    assert set(got) == set(want) and "exp_avg:2.weight" in want, sorted(got)
    assert_same(got, want, "state loaded at dp 2 vs saved at dp 1 x tp 2")


def test_dp2_tp2_checkpoint_exports_to_one_hugging_face_directory(trained, tmp_path):
    """export_hf writes the global tensors (the tp chunks put back in order) and the config:
    LlamaForCausalLM.from_pretrained of the directory has the source's weights."""
    import zeroshard
    from transformers import LlamaForCausalLM
    _, ckpt, _ = trained
    zeroshard.export_hf(ckpt, str(tmp_path / "hf"))
    model = LlamaForCausalLM.from_pretrained(str(tmp_path / "hf"))
    source = torch.load(f"{ckpt}.source.pt", weights_only=True)
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), source[f"w:{n}"]), n


@pytest.mark.parametrize("split", [{"dim": 2, "sizes": [32, 32]}, {"dim": 1, "sizes": [32, 31]},
                                   {"dim": 1, "sizes": "32,32"}, {"dim": 1, "sizes": [32, 32], "x": 0}])
def test_a_malformed_split_makes_the_checkpoint_corrupt(trained, tmp_path, split):
    """A split naming a dimension the tensor lacks, sizes that do not add up to it, or a
    malformed entry is refused when the manifest is read (a load falls back, verify fails)."""
    import glob
    import shutil
    from zeroshard.checkpoint import locate, manifest
    from zeroshard.checkpoint.checkpoint_errors import CheckpointCorruptError
    _, ckpt, _ = trained
    step = shutil.copytree(glob.glob(f"{ckpt}/step-*")[0], str(tmp_path / "step-00000008"))
    body = manifest.read(step)
    body["tensors"]["model.layers.0.self_attn.o_proj.weight"]["split"] = split
    manifest.write(f"{step}/manifest.json", body)  # (a valid checksum over the edited manifest)
    with pytest.raises(CheckpointCorruptError, match="split"):
        locate.check_step(step)


def test_dtensor_parameters_refuse_what_is_not_supported(tmp_path):
    """Mixed precision and a data-parallel group that includes the tp ranks are refused with one
    clear error each; the dp sub-mesh is accepted like the 2-D mesh."""
    for r in run_ranks(w.refusals_worker, 2, tmp_path):
        assert "mixed_precision='bf16' is not supported with tensor parallelism" in r["bf16"], r
        assert "share ranks" in r["no_dp_group"] and "mesh_dim_names=('dp', 'tp')" in r["no_dp_group"], r
        assert r["dp_submesh"] == "accepted" and r["dp_group"] == "accepted", r  # the other spellings


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_dtensor_gradients_are_dtensors_over_the_averaged_gradient(tmp_path, stage):
    """p.grad of a TP-sharded parameter is a DTensor: its norm is the one-process gradient's,
    opt.clip_grad_norm_ is the global norm, and halving every .grad in place halves it; after
    close() the model's DTensors hold the same weights on their own."""
    for r in run_ranks(w.grads_worker, 4, tmp_path, stage):
        assert r["kind"] == "DTensor", r
        assert r["norm"] == pytest.approx(r["want_param"], rel=1e-5), r
        assert r["before"] == pytest.approx(r["want"], rel=1e-5), r
        assert r["after"] == pytest.approx(r["before"] / 2, rel=1e-6), r
        assert r["closed_equal"], r
