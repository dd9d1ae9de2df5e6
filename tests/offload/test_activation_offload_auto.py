"""offload="auto" plans activations with the state under one memory_budget
(Note [activations under the budget]): a budget that makes the plan offload some blocks' inputs
trains bit-identically to the run without it over 8 steps (the shape measured at the first
forward, or declared), placement_report() names those blocks and the bytes moved are the plan's;
a longer sequence later is planned again or refused; a budget below the fully offloaded plan is
refused naming the longest sequence and the smallest budget that fit."""
from __future__ import annotations

import functools
import re
import tempfile
from dataclasses import replace

import pytest
import torch
import zeroshard
from zeroshard.offload.activations.planned import least_device, shape_of
from zeroshard.offload.activations.workload import PlannedActivations
from zeroshard.testing.toy import TinyGPT, synthetic_batch

from tests.support import act_offload_worker as w
from tests.support.asserts import assert_same


KW = {"n_layers": 4, "prefetch": 1}
"""(4 blocks, prefetch 1: with every input moved, two records are back at the peak (Note [planning activations]),
so a budget with room for one more input gives a plan that keeps one and moves three)"""


@functools.lru_cache(maxsize=1)
def _budgets() -> tuple[int, int, int]:
    """(the state's bytes under offload="auto", the fully offloaded plan's device bytes at the worker's
    shape, one block's input): the budgets below are built from these. Once per module: the declared
    shape is planned at construction, so no step runs."""
    big = 1 << 30
    roomy = w.train_planned(big, tempfile.mkdtemp(prefix="act-budgets-"), True, steps=0, **KW)["report"]["plan"]
    assert roomy["counts"] == {"keep": KW["n_layers"]} and roomy["moved_per_step"] == 0
    assert roomy["shape"] == "declared"
    state = big - roomy["memory_left"]["device"]  # (what the state's plan holds: the same under any budget that fits it)
    cfg = replace(w.CFG, activation_checkpointing=True, n_layers=KW["n_layers"])
    shape = shape_of(TinyGPT(cfg), cfg.n_layers)
    wanted = PlannedActivations(micro_batch=w.BATCH, seq_len=cfg.seq_len, prefetch=KW["prefetch"])
    least = least_device(shape, wanted, 4, {"host": 0})
    return state, least, w.BATCH * cfg.seq_len * cfg.d_model * 4  # (one block's input, fp32)


@pytest.mark.filterwarnings("ignore:offload='auto'")  # (reserve 0: the step's peak is over it, by design)
def test_auto_plan_offloads_some_blocks_same_bits_and_refuses_too_small(tmp_path):
    state, least, inp = _budgets()
    budget = state + least + inp + inp // 2  # room for one checkpointed input beside the fully offloaded plan

    want = w.train_planned(budget, str(tmp_path), False, **KW)
    got = w.train_planned(budget, str(tmp_path), True, declared=False, **KW)  # the shape measured at the first forward
    plan = got["report"]["plan"]
    assert plan["blocks"] == {"blocks.0": "checkpoint", "blocks.1": "nvme", "blocks.2": "nvme", "blocks.3": "nvme"}, plan
    assert plan["shape"] == "measured" and (plan["micro_batch"], plan["seq_len"]) == (w.BATCH, w.CFG.seq_len)
    assert got["plans"][0] == plan, "planned at the first step's forward, applied from that step on"
    assert got["hooks_left"] == 0, "close() removes the planned offloader's hooks"
    assert plan["offloaded"] and got["report"]["blocks"] == plan["offloaded"]
    assert got["report"]["bytes_moved_last_step"] == plan["moved_per_step"] == 2 * len(plan["offloaded"]) * inp
    assert len(want["grads"]) == len(got["grads"]) == 8
    for step, (g, r) in enumerate(zip(got["grads"], want["grads"])):
        assert_same(g, r, f"gradients of step {step}")
    assert_same(got["weights"], want["weights"], "weights after 8 steps")
    declared = w.train_planned(budget, str(tmp_path), True, steps=2, **KW)  # the same plan, from construction
    same = ("blocks", "micro_batch", "seq_len", "device_bytes", "moved_per_step")  # (not the disk's free space)
    assert {k: declared["report"]["plan"][k] for k in same} == {k: plan[k] for k in same}
    for step, (g, r) in enumerate(zip(declared["grads"], want["grads"])):
        assert_same(g, r, f"gradients of step {step}, shape declared")

    too_small = state + least - inp
    with pytest.raises(ValueError, match=r"longest sequence that fits is (\d+) tokens, and the smallest "
                                         r"memory_budget that holds 16 tokens is") as err:
        w.train_planned(too_small, str(tmp_path), True, steps=1, **KW)
    assert int(re.search(r"longest sequence that fits is (\d+)", str(err.value)).group(1)) < w.CFG.seq_len
    w.train_planned(state + least, str(tmp_path), True, steps=0, **KW)  # the smallest budget named fits (at build)


@pytest.mark.filterwarnings("ignore:offload='auto'")
def test_measured_shape_plans_again_for_a_longer_sequence_or_refuses(tmp_path):
    """The shape measured at the first forward (8 tokens) is planned again at a forward with more
    tokens (16), before its first block, and applied there: same bits as without offload; a budget
    that holds 8 tokens but not 16 refuses that forward naming the longest sequence that fits."""
    state, least, inp = _budgets()
    budget, lens = state + least + inp + inp // 2, [8, 16, 8]
    want = w.train_planned(budget, str(tmp_path), False, steps=3, seq_lens=lens, **KW)
    got = w.train_planned(budget, str(tmp_path), True, steps=3, declared=False, seq_lens=lens, **KW)
    first, longer, shorter = got["plans"]
    assert first["seq_len"] == 8 and "nvme" not in first["blocks"].values(), first
    assert longer["seq_len"] == 16 and longer["blocks"] == {"blocks.0": "checkpoint", "blocks.1": "nvme",
                                                            "blocks.2": "nvme", "blocks.3": "nvme"}, longer
    assert shorter == longer, "a shorter sequence keeps the plan (it holds fewer tokens)"
    for step, (g, r) in enumerate(zip(got["grads"], want["grads"])):
        assert_same(g, r, f"gradients of step {step} (sequence {lens[step]})")
    assert_same(got["weights"], want["weights"], "weights after 3 steps")

    with pytest.raises(ValueError, match=r"cannot hold a micro-batch of 4 x 16 tokens.*longest sequence that "
                                         r"fits is (\d+) tokens") as err:
        w.train_planned(state + least - inp, str(tmp_path), True, steps=2, declared=False, seq_lens=[8, 16], **KW)
    assert 8 <= int(re.search(r"longest sequence that fits is (\d+)", str(err.value)).group(1)) < 16


@pytest.mark.filterwarnings("ignore:offload='auto'")
def test_blocks_not_checkpointed_move_all_first_then_as_measured(tmp_path):
    """checkpointed=False, recompute=False (keep or move only; the mixed plan is
    test_activation_offload_mix.py's): the first forward moves every block's saved tensors (the least device memory
    of any plan) and measures them; the next forward is planned with that measurement: a roomy budget
    keeps them all, one below keeping them all moves them all with the same bits, the bytes moved
    are the plan's; one below that is refused at the first forward."""
    big = 1 << 30
    layers = 4  # (3 blocks kept need no more than 3 moved: the running one, one back, one staging)
    old = dict(checkpointed=False, prefetch=1, recompute=False, n_layers=layers)  # (keep or move only)
    roomy = w.train_planned(big, str(tmp_path), True, steps=2, declared=False, **old)
    block = roomy["moved"][0] // (2 * layers)  # (step 1: every block off the device and back)
    assert block > 5 * w.predicted_bytes(True) // w.CFG.n_layers, "saved tensors, not only the inputs"
    assert roomy["moved"][1] == 0 and roomy["plans"][0]["counts"] == {"keep": layers}
    state = big - roomy["plans"][0]["memory_left"]["device"]
    tokens = w.BATCH * w.CFG.seq_len
    fixed = 2 * tokens * w.CFG.d_model * 4 + tokens * w.CFG.vocab * 12  # (embeddings and logits, as planned)
    work = tokens * (2 * w.CFG.d_model + 2 * 4 * w.CFG.d_model) * 4  # (the running block's backward transients)
    # (every block moved, prefetch 1: the running block, the one brought back and the staging copy of one
    # being written in forward)
    budget = state + fixed + 3 * block + work + block // 2

    want = w.train_planned(budget, str(tmp_path), False, steps=4, checkpointed=False, recompute=False,
                           n_layers=layers)
    got = w.train_planned(budget, str(tmp_path), True, steps=4, declared=False, peaks=True, **old)
    assert [p["counts"] for p in got["plans"]] == [{"nvme": layers}] * 4
    left = got["plans"][-1]["memory_left"]["device"]
    assert max(got["peaks"]) <= left, (got["peaks"], left)  # (forward's staging counted: 526,464 B was over 480,256)
    assert got["moved"] == [2 * layers * block] * 4 == [got["plans"][-1]["moved_per_step"]] * 4
    for step, (g, r) in enumerate(zip(got["grads"], want["grads"])):
        assert_same(g, r, f"gradients of step {step}, blocks not checkpointed")
    assert_same(got["weights"], want["weights"], "weights after 4 steps")
    with pytest.raises(ValueError, match="blocks not checkpointed, do not fit .* checkpoint the blocks"):
        w.train_planned(state + fixed + 2 * block, str(tmp_path), True, steps=1, declared=False, **old)


def test_planned_activations_need_offload_auto():
    with pytest.raises(ValueError, match="offload='auto' and memory_budget"):
        zeroshard.ZeroConfig(offload_activations=PlannedActivations(micro_batch=1, seq_len=8))
    with pytest.raises(TypeError, match=r"checkpointed='no'\) must be a bool"):
        PlannedActivations(checkpointed="no")
    with pytest.raises(ValueError, match="seq_len=0"):
        PlannedActivations(micro_batch=1, seq_len=0)
    with pytest.raises(ValueError, match="declare both, or neither"):
        PlannedActivations(micro_batch=1)


@pytest.mark.filterwarnings("ignore:Dynamo does not know how to trace")
def test_torch_compile_refuses_stale_graph_then_same_bits():
    """torch.compile (aot_eager here, for time) reuses a graph compiled before the offloader's
    hooks existed and would skip them silently: the backward refuses naming the fix; after
    torch._dynamo.reset() the hooks run between compiled pieces, the blocks move each step and
    the gradients are the same bits, dropout on (Note [activation offload under torch.compile])."""
    cfg = replace(w.CFG, activation_checkpointing=True)

    def run(offload: bool, reset: bool) -> tuple[list, list]:
        torch.manual_seed(0)
        model = TinyGPT(cfg)
        kw = {"offload_activations": zeroshard.ActivationOffload(where="cpu", min_bytes=0)} if offload else {}
        opt = zeroshard.ZeroOptimizer(model, torch.optim.SGD, lr=0.1, stage=1, **kw)
        if reset:
            torch._dynamo.reset()
        compiled = torch.compile(model, backend="aot_eager")
        torch.manual_seed(1)
        grads, moved = [], []
        try:
            for step in range(2):
                compiled(*synthetic_batch(step, w.BATCH, cfg)).backward()
                grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
                if offload:
                    moved.append(opt.placement_report()["activations"]["bytes_out_this_step"])
                opt.step()
                opt.zero_grad()
                if offload:  # (after the step: the whole step's bytes, off the device and back)
                    moved.append(opt.placement_report()["activations"]["bytes_moved_last_step"])
        finally:
            opt.close()
        return grads, moved

    torch._dynamo.reset()
    want, _ = run(False, False)
    with pytest.raises(RuntimeError, match=r"did not run the offloader's hooks.*torch._dynamo.reset\(\)"):
        run(True, False)
    got, moved = run(True, True)
    assert moved == [w.predicted_bytes(True), 2 * w.predicted_bytes(True)] * 2  # every step, every block's input
    for step, (g, r) in enumerate(zip(got, want)):
        assert_same(g, r, f"gradients of step {step} under torch.compile")


@pytest.mark.filterwarnings("ignore:offload='auto'")
def test_checkpointed_plan_with_every_input_moved_holds_the_steps_peak(tmp_path):
    """The plan of a model that checkpoints its blocks counts what backward holds once inputs move: the
    records brought back ahead (the running block's and ``prefetch`` more) and the running block's backward
    transients (Note [planning activations]). At the least budget any plan fits, every input on NVMe, the
    step's peak of live tensor bytes stays within what the budget leaves the activations; without those
    two terms the plan predicted less than the peak (at this shape a peak of 248,456 bytes against 204,800)."""
    state, least, inp = _budgets()
    got = w.train_planned(state + least, str(tmp_path), True, steps=2, peaks=True, **KW)
    plan = got["plans"][-1]
    assert set(plan["blocks"].values()) == {"nvme"}, plan
    assert got["moved"] == [plan["moved_per_step"]] * 2 == [2 * KW["n_layers"] * inp] * 2
    assert max(got["peaks"]) <= plan["memory_left"]["device"], (got["peaks"], plan["memory_left"])


def test_ranks_with_different_measured_shapes_plan_one_shape_and_refuse_together(tmp_path):
    """Note [one plan on every rank]: rank 0's micro-batch has 8 tokens a sequence, rank 1's 16. Where the
    budget holds 16 both train under the 16-token plan; where it holds 8 but not 16 both raise at the first
    forward, each naming what fits; where only rank 1's budget cannot hold it, rank 0 raises saying so
    (before: rank 0 planned its own 8 tokens, went on into the step's collectives and waited for rank 1)."""
    from tests.support.dist_results import run_ranks
    ranks = run_ranks(w.uneven_on_ranks, 2, str(tmp_path), str(tmp_path))
    fits = [r["fits"] for r in ranks]
    assert all("plan" in f for f in fits), fits
    assert fits[0]["plan"]["seq_len"] == fits[1]["plan"]["seq_len"] == 16, fits
    assert fits[0]["plan"]["blocks"] == fits[1]["plan"]["blocks"]
    refused = [r["refused"] for r in ranks]  # (each plans the 16-token shape and refuses it itself)
    assert all("longest sequence that fits is" in r.get("error", "") and "4 x 16 tokens" in r["error"]
               for r in refused), refused
    alone = [r["one_refuses"] for r in ranks]  # (rank 0's own budget holds it: it stops for rank 1)
    assert "longest sequence that fits is" in alone[1].get("error", ""), alone
    assert "another rank's memory_budget cannot hold" in alone[0].get("error", ""), alone
