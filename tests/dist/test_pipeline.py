"""Pipeline parallelism (Note [pipeline parallelism]): a Llama split into 2 stages driven by torch's
pipelining schedules (GPipe, 1F1B; 4 micro-batches) on a ("pp", "dp") mesh of 4 gloo ranks,
each stage sharded by ZeroOptimizer over "dp"; parity with single-process torch.optim.AdamW
with clipping that bites, one gradient reduction per step, the ZeRO memory formula, a
SIGTERM-agreed save resumed bit for bit, activation offload per micro-batch, and checkpoints
that reshard to pp 1 x dp 4 and to one process and export to a Hugging Face directory."""
from __future__ import annotations

import pytest
import torch

import zeroshard
from tests.support import pipeline_worker as w
from tests.support.dist_results import run_ranks
from tests.support.models import TINY_GPT

CASES = [f"stage{s}-{k}" for s in (1, 2) for k in ("gpipe", "1f1b")] + ["stage1-1f1b-buckets", "stage2-1f1b-buckets"]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """One spawn of pp 2 x dp 2 runs every case (tests/support/pipeline_worker.py)."""
    d = tmp_path_factory.mktemp("pipeline")
    ckpt = str(d / "ckpt")
    return ckpt, run_ranks(w.worker, 4, d, ckpt)


@pytest.mark.parametrize("case", CASES)
def test_pp2_dp2_trains_like_one_process(ranks, case):
    """Every stage's weights equal one process's AdamW on the same global batch (relative 1e-5)
    after 8 steps clipped by the norm over both stages, which bites at every step."""
    for r in ranks[1]:
        got = r["parity"][case]
        assert got["rel"] < 1e-5, (case, got["rel"])
        assert min(got["ref_norms"]) > 4 * w.MAX_NORM, got["ref_norms"]  # (clipping bites)
        assert max(abs(a - b) / b for a, b in zip(got["norms"], got["ref_norms"])) < 1e-5, got
        pp = got["pp_report"]
        assert pp["norm@pp"]["calls"] == w.STEPS and pp["norm@pp"]["dimension"] == "pp", pp


@pytest.mark.parametrize("case", CASES)
def test_gradients_are_reduced_once_per_step(ranks, case):
    """dp reduction traffic per step is one reduction of each unit (fp32 padded unit bytes),
    not one per micro-batch; torch's own PipelineStage pays one per micro-batch."""
    for r in ranks[1]:
        got = r["parity"][case]
        assert got["units"] > 1 if case.endswith("-buckets") else got["units"] >= 1, got
        assert got["calls"] == w.STEPS * got["units"], got
        assert got["bytes"] == w.STEPS * got["unit_bytes"], got
        if case == "stage2-1f1b":
            per = r["per_micro_batch"]
            assert per["calls"] == w.MICRO * got["units"] and per["bytes"] == w.MICRO * got["unit_bytes"], per


@pytest.mark.parametrize("case", ["stage1-1f1b-buckets", "stage2-1f1b-buckets"])
def test_reductions_overlap_the_last_micro_batch_backward(ranks, case):
    """Each unit is reduced during the last micro-batch's backward, launched from the gradient
    hook that completed it (not by the flush at the end of backward), none in earlier ones."""
    for r in ranks[1]:
        got = r["parity"][case]
        passes = [p for p, _ in got["launches"]]
        assert passes == [w.MICRO * (s + 1) for s in range(w.STEPS) for _ in range(got["units"])], got["launches"]
        assert not any(flushed for _, flushed in got["launches"]), got["launches"]


@pytest.mark.parametrize("case", ["stage1-1f1b", "stage2-1f1b"])
def test_model_states_follow_the_zero_formula(ranks, case):
    """Per-rank model states of a stage = the ZeRO formula for that stage's parameters over dp 2."""
    for r in ranks[1]:
        got = r["parity"][case]
        assert abs(got["model_states"] - got["formula"]) <= 0.05 * got["formula"], got


def test_sigterm_agreed_save_resumes_bit_for_bit(ranks):
    """SIGTERM on one rank; every rank saves at the same step boundary; a fresh pp 2 x dp 2 run
    loads exactly the saved state and finishes the 8 steps bit for bit like an uninterrupted one."""
    for r in ranks[1]:
        p = r["preempt"]
        assert p["saved_at"] == 4 and p["step"] == 4, p
        assert p["loaded_equal"] and p["bitwise"], p


@pytest.fixture(scope="module")
def two_ranks(ranks, tmp_path_factory):
    """The pp 2 x dp 2 checkpoint loaded on 2 ranks at pp 1 x dp 2 (and saved again there) and
    at pp 2 x dp 1."""
    return run_ranks(w.load_worker, 2, tmp_path_factory.mktemp("pipeline-load"), ranks[0])


def test_checkpoint_loads_at_pp1_dp2_and_pp2_dp1(two_ranks):
    n = sum(3 for _ in w.reference(0)[0])  # (weights, exp_avg, exp_avg_sq of every parameter)
    for r in two_ranks:
        assert r["pp1dp2"]["equal"] and r["pp1dp2"]["keys"] == n and r["pp1dp2"]["resharded"], r
        assert r["pp2dp1"]["equal"] and 0 < r["pp2dp1"]["keys"] < n and r["pp2dp1"]["resharded"], r
    assert two_ranks[0]["pp2dp1"]["keys"] + two_ranks[1]["pp2dp1"]["keys"] == n


def test_checkpoint_loads_at_pp1_dp4(ranks):
    for r in ranks[1]:
        assert r["reshard"]["diff"] == 0.0 and r["reshard"]["resharded"], r["reshard"]


def test_pp2_dp1_tp2_trains_like_one_process(ranks):
    """pp 2 x dp 1 x tp 2 (stage 2, 1F1B): the stage's linear layers are DTensors over "tp"; the
    norm is summed over tp and pp. TP's own all-reduces sum in another order than one process,
    which Adam amplifies where gradients are near zero: weights are held to 1e-5 relative in
    norm and 1e-5 absolute per element (tests/dist/test_tensor_parallel.py's bound), not per element
    relative (measured: up to 1.6e-5 of a tensor's largest weight)."""
    for r in ranks[1]:
        got = r["tp"]
        assert got["dtensors"] == 14 and {"norm@tp", "norm@pp"} <= set(got["kinds"]), got
        assert got["rel_norm"] < 1e-5 and got["abs"] < 1e-5, got


def test_fp16_overflow_on_one_stage_skips_the_step_everywhere(ranks):
    """An inf in one gradient of the first stage on rank 0 alone: every rank of both stages
    skips that step (weights unchanged) and halves its loss scale."""
    for r in ranks[1]:
        assert r["fp16"]["scales"] == [256.0, 128.0, 128.0, 128.0] and r["fp16"]["unchanged"], r["fp16"]


@pytest.mark.parametrize("case", ["cpu-gpipe", "nvme-1f1b"])
def test_activation_offload_keeps_each_micro_batch_apart(ranks, case):
    """offload_activations on each stage's decoder layers (dropout on), several micro-batches in
    flight: every block call of every micro-batch moved its bytes out and back, and weights and
    Adam moments equal the same schedule's without offload bit for bit (a record handed to
    another micro-batch's backward would change them); the NVMe files are gone after the steps."""
    per_stage = w.LAYERS // 2
    for r in ranks[1]:
        got = r["activations"][case]
        assert got["bitwise"], (case, got)
        assert len(got["blocks"]) == per_stage and got["moved"] >= got["steps"] * w.MICRO * per_stage, got
        assert got["bytes_out"] == got["bytes_in"] > 0 and got["bytes_out"] % w.MICRO == 0, got
        assert got["files_left"] == [], got


def test_what_does_not_compose_is_refused(ranks):
    """Stage 3 and planned activation offload at construction; several stages per rank when the
    PipelineStage is built; zero-bubble (split) backward at the first backward, each naming why."""
    for r in ranks[1]:
        refused = r["refused"]
        assert "stage=3 with pipeline parallelism" in refused["stage3"], refused
        assert "PlannedActivations(...) with pipeline parallelism (2 stages)" in refused["planned_activations"], refused
        assert "num_stages=4) over a pp group of 2 ranks" in refused["interleaved"], refused
        assert "'input' backward" in refused["zero_bubble"], refused


def _one_process_state(ckpt: str) -> tuple[dict, dict]:
    """The whole transformers Llama and a stage-2 ZeroOptimizer in this process, loaded from
    ``ckpt``: (load info, weights and moments by name)."""
    model = w.llama()
    opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=w.LR, weight_decay=w.WD, stage=2)
    info = zeroshard.load_checkpoint(ckpt, model=model, optimizer=opt)
    sd = opt.consolidated_state_dict(to_rank=None)
    names = [opt.engine.param_names[id(p)] for g in opt.param_groups for p in g["params"]]
    got = {f"w:{n}": p.detach().clone() for n, p in model.named_parameters()}
    got.update({f"{k}:{n}": sd["state"][i][k] for i, n in enumerate(names) for k in ("exp_avg", "exp_avg_sq")})
    opt.close()
    return info, got


def test_checkpoint_loads_in_one_process_and_exports_to_hf(ranks, two_ranks, tmp_path):
    """The pp 2 x dp 2 checkpoint, and the one saved again from pp 1 x dp 2, load into the whole
    transformers model in one process with equal weights and Adam moments; the first exports to
    a directory from_pretrained loads."""
    from transformers import LlamaForCausalLM
    ckpt = ranks[0]
    want = torch.load(f"{ckpt}.source.pt", weights_only=True)
    for path in (f"{ckpt}-pp1dp2", ckpt):
        info, got = _one_process_state(path)
        assert info["resharded"] and info["step"] == 4, (path, info)
        assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want), path
    out = str(tmp_path / "hf")
    zeroshard.export_hf(info["path"], out)
    loaded = LlamaForCausalLM.from_pretrained(out)
    for n, p in loaded.named_parameters():
        assert torch.equal(p.detach(), want[f"w:{n}"]), n


def test_estimate_with_pp_shards_each_stage_over_its_dp_ranks(capsys):
    """``zeroshard estimate --pp P``: a rank holds ⌈layers / P⌉ blocks and the root, sharded over
    the stage's dp ranks (P across nodes where it divides them); stage 3 and NVMe are not offered."""
    import json

    from zeroshard.planner.planner_commands import COMMANDS
    from zeroshard.planner.estimate import Choice, Hardware, Workload, estimate
    from zeroshard.planner.model_shape import ModelShape
    shape = ModelShape.from_params(1_000_000_000, n_layers=16, d_model=2048)
    hw = Hardware(80 * 2**30, 4, 0, 0, 0.9, nodes=2)
    got = estimate(Choice(2), shape, hw, Workload(mixed_precision=None, pp=2))
    root = shape.n_params - shape.n_layers * shape.block_params
    want = zeroshard.zero_formula(2, root + 8 * shape.block_params, 4)  # (one node per stage: dp 4)
    assert got.gpu_states.model_states == want.model_states
    assert got.traffic.inter_node == 0  # (the dp groups stay inside a node)

    import argparse
    p = argparse.ArgumentParser()
    COMMANDS["estimate"].add_arguments(p)
    assert COMMANDS["estimate"].run(p.parse_args(["--params", "1B", "--gpu-memory", "80GB", "--gpus", "4",
                                                  "--nodes", "2", "--pp", "2", "--json"])) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["pp"] == 2 and data["rows"] and all(not r["config"].startswith("stage 3") and "optim→nvme" not in r["config"]
                                            for r in data["rows"])
    assert COMMANDS["estimate"].run(p.parse_args(["--params", "1B", "--gpu-memory", "80GB", "--gpus", "4",
                                                  "--nodes", "2", "--pp", "3"])) == 2
    assert "pp=3 must divide" in capsys.readouterr().err


@pytest.mark.parametrize("stage", (0, 1, 2))
def test_deferred_passes_add_up_like_accumulation(stage):
    """One process: micro-batches under ``opt.engine.reducer.deferred()`` but the last give the
    accumulated gradient and step of plain accumulation (Note [deferred reduction]); stage 3
    refuses to defer."""
    import copy

    from zeroshard.testing.toy import GPTConfig, TinyGPT, synthetic_batch
    cfg = TINY_GPT
    torch.manual_seed(0)
    ref = TinyGPT(cfg)
    model = copy.deepcopy(ref)
    opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-2, stage=stage, bucket_size_mb=0.01)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    launched: list[int] = []
    opt.engine.reducer.on_launch.append(launched.append)
    for step in range(2):
        for k in range(3):
            with opt.engine.reducer.deferred(k < 2):
                (model(*synthetic_batch(3 * step + k, 4, cfg)) / 3).backward()
            (ref(*synthetic_batch(3 * step + k, 4, cfg)) / 3).backward()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    assert len(opt.units) > 1 and launched == list(range(len(opt.units))) * 2  # (once per unit and step)
    got = zeroshard.full_state_dict(model)
    for name, p in ref.named_parameters():
        assert (got[name] - p.detach()).abs().max() < 1e-6, name
    opt.close()
    model3 = TinyGPT(cfg)
    opt3 = zeroshard.ZeroOptimizer(model3, torch.optim.AdamW, lr=1e-2, stage=3)
    with pytest.raises(RuntimeError, match="not supported at stage 3"):
        with opt3.engine.reducer.deferred():
            pass
    opt3.close()
