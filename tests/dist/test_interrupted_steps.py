"""Nothing lost on the way out (issue 28) and no silent trap in evaluation (issue 29): stage 3
saved from any point between steps, Ctrl-C during training with the overlapped NVMe step,
``del opt`` mid-step, a failed background step, and a forward one rank runs alone."""
from __future__ import annotations

import pytest

from tests.support.dist_results import run_ranks
from tests.support.interrupted_steps_worker import save_between_steps
from tests.support.asserts import assert_same


@pytest.mark.parametrize("world", [1, 2])
def test_stage3_saves_from_any_point_between_steps_and_resumes_bit_for_bit(tmp_path, world):
    """After a forward that raised, a forward with no backward and a backward that raised, the
    save records the committed state (as if the unfinished pass never ran), a resume from it
    equals the uninterrupted run, and so does the interrupted run going on (its kept graph too)."""
    if world == 1:
        save_between_steps(0, 1, str(tmp_path / "res"), str(tmp_path))
        import json
        results = [json.load(open(tmp_path / "res.rank0"))]
    else:
        results = run_ranks(save_between_steps, 2, tmp_path, str(tmp_path))
    for r in results:
        for case in ("forward_raised", "no_backward", "backward_raised"):
            assert r[case] == {"committed": True, "resumed": True, "continued": True, "state": True}, (case, r[case])
        assert r["backward_raised_train_on"] == {"equal": True, "released": True}
        assert r["compiled_full_state"], r  # (issue 29: full_state_dict(torch.compile(model)))


# -- del opt mid-step -------------------------------------------------------------------------
def _overlapped(tmp_path, sub: str, seed: int = 0, **options):
    from tests.support.nvme_params_worker import AUTO_CFG, make
    d = tmp_path / sub
    d.mkdir()
    return make(str(d), cfg=AUTO_CFG, overlap_step=True, seed=seed, **options)


def _steps(model, opt, start: int, stop: int) -> None:
    from tests.support.nvme_params_worker import AUTO_CFG
    from zeroshard.testing.toy import synthetic_batch
    for step in range(start, stop):
        model(*synthetic_batch(step, 2, AUTO_CFG)).backward()
        opt.clip_grad_norm_(0.5)
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("when", ["step_in_flight", "units_gathered"])
def test_collecting_the_optimizer_mid_step_leaves_the_full_trained_parameters(tmp_path, when):
    import gc
    import weakref

    import torch

    import zeroshard
    from tests.support.nvme_params_worker import AUTO_CFG, make
    from zeroshard.testing.toy import synthetic_batch
    ref, ref_opt = make(None, cfg=AUTO_CFG)
    _steps(ref, ref_opt, 0, 2)
    want = zeroshard.full_state_dict(ref)
    model, opt = _overlapped(tmp_path, "swap")
    _steps(model, opt, 0, 2)
    assert opt.engine.inflight.running  # (the second step is joined by nobody yet)
    if when == "units_gathered":
        opt.finish_step()
        model(*synthetic_batch(5, 2, AUTO_CFG))  # the root unit stays gathered (no backward)
    gone = weakref.ref(opt)
    del opt
    gc.collect()
    assert gone() is None
    got = model.state_dict()
    assert got.keys() == want.keys()
    for k in want:
        assert type(got[k]) is torch.Tensor and got[k].untyped_storage().nbytes() > 0, k
        assert torch.equal(got[k], want[k]), k
    with torch.no_grad():
        x, y = synthetic_batch(9, 2, AUTO_CFG)
        assert torch.equal(model(x, y), ref(x, y))
    ref_opt.close()


# -- an I/O error inside the background step -------------------------------------------------------
def _second_step_fails(tmp_path, damage):
    """Step 1, a checkpoint of it, then step 2 started after ``damage(opt)`` was done to the
    moments' file: the worker meets a real I/O error; the next forward raises it."""
    import zeroshard
    from tests.support.nvme_params_worker import AUTO_CFG
    from zeroshard.io import AIOError
    from zeroshard.testing.toy import synthetic_batch
    model, opt = _overlapped(tmp_path, "swap")
    _steps(model, opt, 0, 1)
    root = str(tmp_path / "ck")
    zeroshard.save_checkpoint(root, 1, model=model, optimizer=opt)
    model(*synthetic_batch(1, 2, AUTO_CFG)).backward()
    opt.clip_grad_norm_(0.5)
    undo = damage(opt)
    opt.step()
    opt.zero_grad()
    with pytest.raises(AIOError, match="zeroshard-optim"):
        model(*synthetic_batch(2, 2, AUTO_CFG)).backward()  # the first gather waits for the step
    if undo is not None:
        undo()
    return model, opt, root


def _refuses(model, opt, root: str) -> None:
    import zeroshard
    with pytest.raises(RuntimeError, match=r"optimizer\.step\(\) refused: an earlier optimizer step failed part "
                                           r"way \(SwapFileDamagedError.*Load a checkpoint"):
        opt.step()
    with pytest.raises(RuntimeError, match=r"save_checkpoint of step 2 refused: .*SwapFileDamagedError"):
        zeroshard.save_checkpoint(root, 2, model=model, optimizer=opt)


def _zero_fill_first_half(opt):
    """The runs stored in the file's first half read back zeros (overwritten from outside): the
    step updates the units it reaches first (stored last) and fails at the others."""
    import os
    fd = os.open(opt.engine.swapper.path, os.O_WRONLY)
    try:
        os.pwrite(fd, bytes(opt.engine.swapper.file_bytes // 2), 0)
    finally:
        os.close(fd)


def test_a_step_half_applied_in_the_background_refuses_step_and_save(tmp_path):
    import torch

    import zeroshard
    from tests.support.nvme_params_worker import AUTO_CFG, make
    ref, ref_opt = make(None, cfg=AUTO_CFG)
    _steps(ref, ref_opt, 0, 1)
    at1 = zeroshard.full_state_dict(ref)
    _steps(ref, ref_opt, 1, 2)
    at2 = zeroshard.full_state_dict(ref)
    model, opt, root = _second_step_fails(tmp_path, _zero_fill_first_half)
    got = zeroshard.full_state_dict(model)
    stepped = {k for k in got if not torch.equal(got[k], at1[k])}
    assert stepped and stepped != set(got) and all(torch.equal(got[k], at2[k]) for k in stepped)  # half applied
    _refuses(model, opt, root)
    assert not any(name.startswith("step-00000002") for name in __import__("os").listdir(root))
    # (a damaged swap file is scratch: a new optimizer resumes from the checkpoint)
    opt.close()
    _steps(ref, ref_opt, 2, 3)
    m2, o2 = _overlapped(tmp_path, "fresh", seed=7)
    zeroshard.load_checkpoint(root, model=m2, optimizer=o2)
    _steps(m2, o2, 1, 3)
    want, got = zeroshard.full_state_dict(ref), zeroshard.full_state_dict(m2)
    assert_same(got, want, "resumed weights")
    o2.close()
    ref_opt.close()


def _moved_away(opt):
    """The file is renamed away while the step runs and put back after (the engine refuses a
    path that no longer names its file: the read fails, the data on disk stays intact)."""
    import os
    path = opt.engine.swapper.path
    os.rename(path, path + ".away")
    return lambda: os.rename(path + ".away", path)


@pytest.mark.parametrize("restore", ["load_checkpoint", "load_state_dict"])
def test_loading_the_state_ends_the_refusal_after_a_failed_background_step(tmp_path, restore):
    import io

    import torch

    import zeroshard
    from tests.support.nvme_params_worker import AUTO_CFG, make
    ref, ref_opt = make(None, cfg=AUTO_CFG)
    _steps(ref, ref_opt, 0, 4)
    want = zeroshard.full_state_dict(ref)
    saved = io.BytesIO()

    def damage(opt):
        torch.save(opt.state_dict(), saved)  # (step 1's state dict, before the damage)
        return _moved_away(opt)
    model, opt, root = _second_step_fails(tmp_path, damage)
    _refuses(model, opt, root)
    if restore == "load_checkpoint":
        assert zeroshard.load_checkpoint(root, model=model, optimizer=opt)["step"] == 1 and opt.steps_done == 1
    else:
        saved.seek(0)
        opt.load_state_dict(torch.load(saved, weights_only=True))
    opt.zero_grad()
    _steps(model, opt, 1, 4)  # trains again, from the committed state, and saves
    zeroshard.save_checkpoint(root, 4, model=model, optimizer=opt)
    got = zeroshard.full_state_dict(model)
    assert_same(got, want, "weights after the collected step")
    opt.close()
    ref_opt.close()


# -- save on Ctrl-C ---------------------------------------------------------------------------------
def test_save_on_ctrl_c_with_the_overlapped_nvme_step_commits_and_resumes_bit_for_bit(tmp_path):
    """20 SIGINTs at random points of a stage-3 run with parameters and state on NVMe and the
    overlapped step (aimed in turn at forward, backward, the step and the step in flight, each
    a random delay after that part starts); the child catches each KeyboardInterrupt, saves,
    and goes on from the save (README: "Save on interrupt"). Every save committed the state
    after exactly the steps it names, each resume trained on to the uninterrupted run's bits
    (the chain of resumes ends at its final state), and so does a resume in memory."""
    import os
    import signal
    import subprocess
    import sys

    import torch

    import zeroshard
    from tests.support.nvme_params_worker import AUTO_CFG, make
    from zeroshard.testing.toy import synthetic_batch
    root, nvme = tmp_path / "ck", tmp_path / "nvme"
    nvme.mkdir()
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    child = subprocess.Popen([sys.executable, "-m", "tests.support.interrupted_steps_worker", "sigint", str(root), str(nvme)],
                             cwd=repo, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def line() -> str:
        out = child.stdout.readline().strip()
        if not out:
            child.wait(30)
            raise AssertionError(f"the child stopped (exit {child.returncode}): {child.stderr.read()[-3000:]}")
        return out
    saves, phases = [], set()
    try:
        assert line() == "ready"
        for i in range(20):  # (the child aims each SIGINT itself: interrupted_steps_worker.sigint_child)
            word, n, step, phase = line().split()
            assert (word, int(n)) == ("saved", i)
            saves.append((f"int{i:02d}", int(step)))
            phases.add(phase)
            assert line() == f"resumed {i}"
        child.send_signal(signal.SIGUSR1)
        word, last = line().split()
        assert word == "done" and child.wait(60) == 0
    finally:
        if child.poll() is None:
            child.kill()
    last = int(last)
    saves.append(("final", last))
    # The uninterrupted run, in memory (the same bits as NVMe and the overlapped step).
    ref, ref_opt = make(None, "bf16", cfg=AUTO_CFG)

    def state(model, opt) -> tuple:
        return zeroshard.full_state_dict(model), opt.consolidated_state_dict()["state"]
    states = [state(ref, ref_opt)]
    for step in range(last):
        ref(*synthetic_batch(step, 2, AUTO_CFG)).backward()
        ref_opt.clip_grad_norm_(0.5)
        ref_opt.step()
        ref_opt.zero_grad()
        states.append(state(ref, ref_opt))

    def equal(a: tuple, b: tuple) -> bool:
        return (a[0].keys() == b[0].keys() and all(torch.equal(a[0][k], b[0][k]) for k in a[0])
                and a[1].keys() == b[1].keys()
                and all(torch.equal(torch.as_tensor(a[1][i][k]), torch.as_tensor(b[1][i][k])) for i in a[1] for k in a[1][i]))
    def differing(a: tuple, b: tuple) -> list:
        return ([k for k in a[0] if not torch.equal(a[0][k], b[0][k])]
                + [f"state {i}.{k}" for i in a[1] for k in a[1][i]
                   if not torch.equal(torch.as_tensor(a[1][i][k]), torch.as_tensor(b[1][i].get(k)))])
    m2, o2 = make(None, "bf16", cfg=AUTO_CFG, seed=5)
    for name, step in saves:
        info = zeroshard.load_checkpoint(str(root / name), model=m2, optimizer=o2)  # committed and valid
        assert info["step"] == step and not info["skipped"], (name, info)
        got = state(m2, o2)
        assert equal(got, states[step]), (name, step, saves, phases, differing(got, states[step]))
    first = min(step for _, step in saves[:-1])  # resumed in memory from the earliest save
    zeroshard.load_checkpoint(str(root / f"int{[s for _, s in saves].index(first):02d}"), model=m2, optimizer=o2)
    for step in range(first, last):
        m2(*synthetic_batch(step, 2, AUTO_CFG)).backward()
        o2.clip_grad_norm_(0.5)
        o2.step()
        o2.zero_grad()
    assert equal(state(m2, o2), states[last])
    o2.close()
    ref_opt.close()
    assert len(phases) >= 3, phases  # (they met different parts of the iteration)


# -- a stage-3 forward one rank runs alone ------------------------------------------------------------
def test_evaluation_on_rank_0_only_at_stage_3_is_a_clear_error_within_the_timeout(tmp_path, monkeypatch):
    """nanoGPT's estimate_loss under master_process: rank 0 is told to evaluate on every rank
    (before it gathers anything), within the collective timeout; rank 1, training meanwhile,
    gets its own collective's error instead of hanging. Evaluation on every rank is agreed
    in well under a millisecond per forward, and training forwards are never checked."""
    from tests.support.interrupted_steps_worker import lone_forward
    monkeypatch.setenv("ZEROSHARD_PG_TIMEOUT", "4")
    r0, r1 = run_ranks(lone_forward, 2, tmp_path, str(tmp_path))
    for r in (r0, r1):
        assert r["eval_all"] and r["collected_pieces"] and r["collected_forward"], r
        assert r["checks"] == 1 and r["checks_after_training"] == 22, r  # once per evaluation
        print(f"agreeing on an evaluation: {r['check_seconds'] * 1e3:.2f} ms (a forward: "
              f"{r['forward_seconds'] * 1e3:.2f} ms)")
        assert r["check_seconds"] < 0.05, r
    assert r0["error"].startswith("RuntimeError: every rank must run the forward at stage 3; evaluate on all "
                                  "ranks: rank 0 started a forward of TinyGPT"), r0
    assert "rank(s) [1] did not start within 4 s" in r0["error"], r0
    assert r1["error"] is not None, r1
    assert r0["seconds"] < 4 + 10 and r1["seconds"] < 4 + 10, (r0, r1)


# -- a backward abandoned early ------------------------------------------------------------------
@pytest.mark.parametrize("where", ["pass start", "gradient hook", "gradient hook, zeros"])
@pytest.mark.parametrize("stage,overlap", [(3, False), (3, True), (2, False)])
def test_a_backward_abandoned_by_ctrl_c_trains_on_as_torch(tmp_path, stage, overlap, where):
    """Ctrl-C right as a backward starts (its end-of-backward callbacks never run), or as a
    gradient hook starts (autograd accumulated a gradient the hook never took): after
    zero_grad (set_to_none, or zeros as torch.optim's zero_grad(False)), training goes on to the uninterrupted run's bits. Before the fixes the root unit
    stayed gathered across the next step (Note [abandoned backward]): tok/pos/ln_f/head kept
    their old values in the next forward; and at stage 3 the gathered parameter kept the
    untaken gradient, which the next backward added to (weights and moments differed).
    Each was found by the Ctrl-C test, about once in ten runs."""
    import torch

    import zeroshard
    from tests.support.nvme_params_worker import AUTO_CFG, make
    from zeroshard.testing.toy import synthetic_batch

    def run(abandon: bool) -> tuple:
        d = tmp_path / f"{stage}{overlap}{abandon}"
        d.mkdir()
        model, opt = (make(str(d), "bf16", cfg=AUTO_CFG, overlap_step=True) if overlap
                      else make(None, "bf16", cfg=AUTO_CFG, stage=stage))
        for step in range(3):
            if abandon and step == 1:
                reducer, start = opt.engine.reducer, opt.engine.reducer._start_pass

                def interrupted(*_) -> None:
                    if where == "pass start":
                        start()
                    raise KeyboardInterrupt
                if where == "pass start":
                    reducer._start_pass = interrupted
                else:  # (ahead of the reducer's own hook on a parameter of the middle unit)
                    reducer.remove_hooks()
                    hook = opt.units[len(opt.units) // 2].members[0].param.register_post_accumulate_grad_hook(
                        interrupted)
                    reducer.register_hooks()
                with pytest.raises(KeyboardInterrupt):
                    model(*synthetic_batch(step, 2, AUTO_CFG)).backward()
                if where == "pass start":
                    del reducer._start_pass
                else:
                    hook.remove()
                opt.zero_grad(set_to_none=not where.endswith("zeros"))
            model(*synthetic_batch(step, 2, AUTO_CFG)).backward()
            opt.clip_grad_norm_(0.5)
            opt.step()
            opt.zero_grad()
        out = zeroshard.full_state_dict(model), opt.consolidated_state_dict()["state"]
        opt.close()
        return out
    want, got = run(False), run(True)
    assert [k for k in want[0] if not torch.equal(want[0][k], got[0][k])] == []
    assert_same(got[1], want[1], "optimizer state")
