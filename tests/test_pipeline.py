"""Pipeline parallelism (Note [pipeline parallelism]): a Llama split into 2 stages driven by torch's
pipelining schedules (GPipe, 1F1B; 4 micro-batches) on a ("pp", "dp") mesh of 4 gloo ranks,
each stage sharded by ZeroOptimizer over "dp"; parity with single-process torch.optim.AdamW
with clipping that bites, one gradient reduction per step, the ZeRO memory formula, a
SIGTERM-agreed save resumed bit for bit, and checkpoints that reshard to pp 1 x dp 4 and to
one process and export to a Hugging Face directory."""
from __future__ import annotations

import pytest
import torch

import zeroshard
from tests import pipeline_worker as w
from tests.dist_results import run_ranks

CASES = [f"stage{s}-{k}" for s in (1, 2) for k in ("gpipe", "1f1b")]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """One spawn of pp 2 x dp 2 runs every case (tests/pipeline_worker.py)."""
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
        assert got["calls"] == w.STEPS * got["units"], got
        assert got["bytes"] == w.STEPS * got["unit_bytes"], got
        if case == "stage2-1f1b":
            per = r["per_micro_batch"]
            assert per["calls"] == w.MICRO * got["units"] and per["bytes"] == w.MICRO * got["unit_bytes"], per


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


def test_checkpoint_loads_at_pp1_dp4(ranks):
    for r in ranks[1]:
        assert r["reshard"]["diff"] == 0.0 and r["reshard"]["resharded"], r["reshard"]


def test_stage3_and_zero_bubble_are_refused(ranks):
    for r in ranks[1]:
        assert "stage=3 with pipeline parallelism" in r["refused"]["stage3"], r["refused"]


def test_checkpoint_loads_in_one_process_and_exports_to_hf(ranks, tmp_path):
    """The pp 2 x dp 2 checkpoint loads into the whole transformers model in one process with
    equal weights and Adam moments, and exports to a directory from_pretrained loads."""
    from transformers import LlamaForCausalLM
    ckpt = ranks[0]
    model = w.llama()
    opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=w.LR, weight_decay=w.WD, stage=2)
    info = zeroshard.load_checkpoint(ckpt, model=model, optimizer=opt)
    assert info["resharded"] and info["step"] == 4, info
    want = torch.load(f"{ckpt}.source.pt", weights_only=True)
    sd = opt.consolidated_state_dict(to_rank=None)
    names = [opt.param_names[id(p)] for g in opt.param_groups for p in g["params"]]
    got = {f"w:{n}": p.detach() for n, p in model.named_parameters()}
    got.update({f"{k}:{n}": sd["state"][i][k] for i, n in enumerate(names) for k in ("exp_avg", "exp_avg_sq")})
    assert set(got) == set(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    opt.close()
    out = str(tmp_path / "hf")
    zeroshard.export_hf(info["path"], out)
    loaded = LlamaForCausalLM.from_pretrained(out)
    for n, p in loaded.named_parameters():
        assert torch.equal(p.detach(), want[f"w:{n}"]), n
