"""Drop-in for real: the usual PyTorch loop, unchanged, with ZeroOptimizer in place of
torch.optim.AdamW, on a Hugging Face GPT-2 at stages 0-3 and world 1 and 2 (gloo), each cell
against plain torch.optim.AdamW on one process with the same global batch
(tests/support/dropin_worker.py runs the cells).

Bounds. fp32 cells: loss within 1e-6 relative and weights within 1e-5 after 8 steps, with
clipping that bites on every step; ``state_dict`` reads a parameter, torch.save (warned for
rank pieces at stage 3 over 2 ranks, naming the fix, and the file refused at load) / torch.load / load_state_dict the model's own state dict and loads a full one (the initial
weights) mid-training; ``compile`` runs ``torch.compile(model)`` with default
options against the eager reference. Autocast cells (fp16 with GradScaler, bf16): the ranks
compute their half batches in 16-bit, the reference the whole batch, so matmul blocking
rounds differently; Adam turns a rounding flip of a near-zero gradient into a full-size
update of that element, so weights are compared by the loss trajectory (within 1e-3
relative: a 16-bit ulp is 2^-8..2^-11) and by having trained (moved), not elementwise.
"""
from __future__ import annotations

import pytest

from tests.support import dropin_worker as w
from tests.support.dist_results import run_ranks, run_worlds, selected_params
from tests.support.asserts import assert_same

FP32 = ("loop", "div_loss", "to_device", "accumulate", "zero_grad_keep", "compile", "state_dict")
AUTOCAST = ("grad_scaler", "autocast_bf16")
CELLS = [(s, c) for s in (0, 1, 2, 3) for c in FP32 + AUTOCAST]


@pytest.fixture(scope="module")
def launched(request, tmp_path_factory):  # (world 1 beside world 2: Note [launches side by side])
    worlds = selected_params(request, "results", (1, 2))
    return run_worlds(w.worker, worlds, lambda world: tmp_path_factory.mktemp(f"dropin{world}"), CELLS)


@pytest.fixture(scope="module", params=[1, 2], ids=["world1", "world2"])
def results(request, launched):
    return request.param, launched[request.param]


@pytest.mark.parametrize("stage,scenario", CELLS, ids=[f"stage{s}-{c}" for s, c in CELLS])
def test_loop_matches_torch_optim(results, stage, scenario):
    world, ranks = results
    cell = w.Cell(stage, scenario).key
    for r in ranks:
        res = r[cell]
        assert "error" not in res, res.get("error")
        assert res["finite"]
        assert res["moved"] > 1e-3, f"{cell}: the model did not train"
        if scenario in FP32:
            assert res["loss_rel"] < 1e-6, res
            assert res["norm_rel"] < 1e-5, res
            assert res["weight_diff"] < 1e-5, res
        else:
            assert res["loss_rel"] < 1e-3, res
            assert res["norm_rel"] < 1e-2, res
        if scenario == "state_dict":  # reads are global values; the saved file holds this rank's part
            got, ref = res["probes"], res["ref_probes"]
            for key in ("read_sum", "read_norm", "after_load_sum"):
                assert got[key] == pytest.approx(ref[key], rel=1e-5, abs=1e-6), (key, got, ref)
            if stage < 3 or world == 1:  # whole tensors: a plain file (loads without zeroshard)
                assert got["saved_bytes"] / ref["saved_bytes"] > 0.9, (got, ref)
            else:  # rank pieces: torch.save warns naming the fix, loading the file is refused (issue 43)
                assert "zeroshard.full_state_dict" in got["save_warned"], got
                assert got["save_warnings"] == 1, got  # once per save, not once per tensor
                assert "zeroshard.full_state_dict" in got["load_refused"], got


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("stage", [0, 2, 3])
def test_grad_expressions_equal_torch(tmp_path, stage, world):
    """Norms of every order, sums, extremes, finiteness, an op with no sharded rule
    (gathered), get_total_norm and replacing .grad give torch's values from p.grad."""
    for r in run_ranks(w.grad_ops_worker, world, tmp_path, stage):
        assert r["type"] == ("Tensor" if stage < 2 else "ShardedTensor")
        for key, rel in r["worst"].items():
            assert rel < 1e-5, (key, rel)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_safetensors_savers_keep_every_tensor(tmp_path, stage):
    """Parameters are views of one flat buffer; model.state_dict() still gives each its own
    storage, so safetensors (Accelerate's save_state) saves and reloads every tensor."""
    import safetensors.torch as st
    import torch
    import zeroshard
    model = w.gpt2()
    zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-3, stage=stage)
    sd = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied: HF drops it too
    st.save_file(sd, str(tmp_path / "m.safetensors"))
    back = st.load_file(str(tmp_path / "m.safetensors"))
    assert sorted(back) == sorted(sd)
    assert_same(back, sd, "safetensors round trip")


@pytest.mark.parametrize("how", ["load_checkpoint", "load_state_dict"])
@pytest.mark.parametrize("stage,precision", [(0, "bf16"), (1, "bf16"), (2, "bf16"), (3, "bf16"), (3, None)])
def test_weights_only_loads_update_whatever_holds_them(tmp_path, stage, precision, how):
    """Loading weights without the optimizer (zeroshard.load_checkpoint(path, model=m) or
    model.load_state_dict) must reach the fp32 masters and stage 3's shards: a following step
    with lr=0 keeps exactly the loaded weights (stale masters would write the old ones back)."""
    import torch
    import zeroshard
    model = w.gpt2()
    opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-2, stage=stage, mixed_precision=precision)

    def step(i: int) -> None:
        ids = w.tokens(i)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    step(0)
    saved = zeroshard.full_state_dict(model, rank0_only=False)
    if how == "load_checkpoint":
        zeroshard.save_checkpoint(str(tmp_path), 1, model=model, optimizer=opt)
    step(1)
    step(2)
    if how == "load_checkpoint":
        zeroshard.load_checkpoint(str(tmp_path), model=model)
    else:
        model.load_state_dict(saved)
    for g in opt.param_groups:
        g["lr"], g["weight_decay"] = 0.0, 0.0
    step(3)
    now = zeroshard.full_state_dict(model, rank0_only=False)
    for k, v in saved.items():
        assert torch.equal(now[k], v), k


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_grad_scaler_skips_an_overflow_on_one_rank_everywhere(tmp_path, stage):
    """Rank 1 alone overflows at step 1: the inf check is agreed, both ranks skip the step and
    halve the scale, and training goes on like one process that skipped it."""
    for r in run_ranks(w.scaler_skip_worker, 2, tmp_path, stage):
        assert r["scale"] == r["ref_scale"] == 2.0**9, r
        assert r["diff"] < 1e-5, r


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_comm_report_counts_what_each_stage_moves(tmp_path, stage):
    """One step at world 2: gradients are reduced once per unit in fp32 (all-reduce at stages
    0-1, reduce-scatter at 2-3); stages 1-2 gather every unit's parameters after the step;
    stage 3 gathers each block in forward and again in backward, the root unit once."""
    for r in run_ranks(w.comm_worker, 2, tmp_path, stage):
        rep, units = r["report"], r["units"]
        grads = sum(u["padded"] * 4 for u in units)
        params = sum(u["padded"] * u["elsize"] for u in units)
        kind = "all_reduce" if stage < 2 else "reduce_scatter"
        assert rep[kind]["bytes"] == grads and rep[kind]["calls"] == len(units), rep
        gathers = {0: 0, 1: params, 2: params,
                   3: sum(u["padded"] * u["elsize"] * (1 if u["root"] else 2) for u in units)}[stage]
        assert rep.get("all_gather", {"bytes": 0})["bytes"] == gathers, rep
        assert all(v["dimension"] == "dp" for v in rep.values())


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_hybrid_mesh_trains_like_one_process_and_crosses_replicas_with_the_shard_only(tmp_path, stage):
    """mesh = (replicate 2, shard 2) on 4 gloo ranks (Note [hybrid sharding]): weights and
    losses equal single-process torch.optim; per step the replicas exchange only each rank's
    gradient slice (all of it at stage 0) and parameter gathers stay in the shard group; a
    checkpoint saved under the mesh resumes under it exactly and loads at world 1."""
    import torch
    import zeroshard
    ckpt = str(tmp_path / "ckpt")
    ranks = run_ranks(w.hybrid_worker, 4, tmp_path, stage, ckpt)
    for r in ranks:
        assert r["diff"] < 1e-5 and r["loss_rel"] < 1e-6, r
        rep = r["report"]
        assert rep["all_reduce@replicate"]["bytes"] == r["shard_bytes"] * r["steps"], rep
        assert rep["all_reduce@replicate"]["dimension"] == "replicate"
        assert all(v["dimension"] == "shard" for k, v in rep.items() if not k.endswith("@replicate")), rep
        assert not any(k.startswith("all_gather@") for k in rep), rep
        assert r["resume_equal"], r
    model = w.gpt2()
    opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-2, stage=1)
    zeroshard.load_checkpoint(ckpt, model=model, optimizer=opt)
    total = float(sum(p.detach().double().sum() for p in model.parameters()))
    assert total == pytest.approx(ranks[0]["weights_sum"], rel=1e-12)


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_add_param_group_after_construction_trains_like_torch(tmp_path, stage, world):
    """add_param_group mid-training (a frozen layer unfrozen with its own lr) equals
    torch.optim.AdamW doing the same; the existing state is kept across the rebuild."""
    for r in run_ranks(w.add_group_worker, world, tmp_path, stage):
        assert r["diff"] < 1e-5, r


def test_a_one_rank_stage3_state_dict_saved_with_torch_save_loads_without_zeroshard(tmp_path):
    """nanoGPT's checkpoint (torch.save of model.state_dict()) at stage 3 on one rank is a plain
    file: its sample.py loads it with weights_only=True in a process that never imports
    zeroshard, and gets the trained weights (issue 29; Note [saving pieces])."""
    import subprocess
    import sys

    import torch

    import zeroshard
    from tests.support.models import TinyNet
    torch.manual_seed(0)
    model = TinyNet()
    opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-2, stage=3)
    model(torch.randint(0, 32, (2, 5))).sum().backward()
    opt.step()
    torch.save(model.state_dict(), tmp_path / "ckpt.pt")
    torch.save(zeroshard.full_state_dict(model), tmp_path / "full.pt")
    opt.close()
    check = ("import sys, torch\n"
             "sd = torch.load(sys.argv[1], weights_only=True); full = torch.load(sys.argv[2], weights_only=True)\n"
             "assert 'zeroshard' not in sys.modules, 'zeroshard was imported'\n"
             "assert all(type(v) is torch.Tensor for v in sd.values()), {type(v) for v in sd.values()}\n"
             "assert sd.keys() == full.keys() and all(torch.equal(sd[k], full[k]) for k in sd)\n"
             "print('ok', len(sd))\n")
    proc = subprocess.run([sys.executable, "-c", check, str(tmp_path / "ckpt.pt"), str(tmp_path / "full.pt")],
                          capture_output=True, text=True, timeout=120, cwd=str(tmp_path))
    assert proc.returncode == 0 and proc.stdout.startswith("ok"), proc.stderr[-3000:]


@pytest.mark.parametrize("stage,offload", [(2, None), (3, None), (2, "cpu")])
def test_bf16_resume_through_weights_and_consolidated_state_is_bit_identical(stage, offload):
    """What the integrations and scripts save (full weights + consolidated_state_dict()) carries
    the fp32 masters under bf16 (Note [masters in the consolidated state]): a resume from it
    trains on to the uninterrupted run's bits (before: one bf16 rounding off, 7.8e-3 in TRL)."""
    import torch

    import zeroshard
    from tests.support.nvme_params_worker import AUTO_CFG, make
    from zeroshard.testing.toy import synthetic_batch

    def train(model, opt, start: int, stop: int) -> None:
        for step in range(start, stop):
            model(*synthetic_batch(step, 2, AUTO_CFG)).backward()
            opt.clip_grad_norm_(0.5)
            opt.step()
            opt.zero_grad()
    opts = dict(optimizer=offload, params=None)
    ref, ref_opt = make(None, "bf16", cfg=AUTO_CFG, stage=stage, **opts)
    train(ref, ref_opt, 0, 2)
    weights, state = zeroshard.full_state_dict(ref), ref_opt.consolidated_state_dict()
    assert all("zeroshard_master" in entry and entry["zeroshard_master"].dtype == torch.float32
               for entry in state["state"].values())
    train(ref, ref_opt, 2, 4)
    model, opt = make(None, "bf16", cfg=AUTO_CFG, stage=stage, seed=5, **opts)
    model.load_state_dict(weights)
    opt.load_state_dict(state)
    train(model, opt, 2, 4)
    want, got = zeroshard.full_state_dict(ref), zeroshard.full_state_dict(model)
    assert [k for k in want if not torch.equal(want[k], got[k])] == []
    a, b = ref_opt.consolidated_state_dict()["state"], opt.consolidated_state_dict()["state"]
    assert_same(b, a, "optimizer state")
    ref_opt.close()
    opt.close()
