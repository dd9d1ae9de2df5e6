"""Hostile checkpoints through every consumer: fall back to the good step or refuse by name.

One saved two-step root per (world size, stage) — world 1 and 2, stages 2 and 3 — is
copied per case of ``tests/support/hostile_cases.py`` and damaged. Loads run here (world 1, which
reshards the world-2 roots) and in two gloo ranks (world 2, in a subprocess started first
so both run at once); ``verify``, ``inspect`` and ``export`` run here. Each run is a
verdict (``tests/support/hostile_consumers.py``): the right step with state equal to it, or
zeroshard's checkpoint error naming the problem with nothing changed; no file outside the
root opened (audit hook); no hang (a deadline ends the process); memory bounded.
"""
from __future__ import annotations

import collections
import json
import os
import shutil
import subprocess
import sys
import warnings

import pytest

import zeroshard
from tests.support.ckpt_worker import Trainer
from tests.support.dist_results import run_ranks
from tests.support.hostile_cases import CASES, S2, Ctx
from tests.support.hostile_consumers import (audit, max_rss_mib, references, run_loads, run_tools, save_fixture,
                                     save_refused_on_one_rank)
from zeroshard.checkpoint import CheckpointError, commit

RSS_BOUND_MIB = 320  # the largest legitimate read of a case is one 64 MiB block; 1 GiB cases must not cost 1 GiB
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _save_world1(roots: dict) -> None:
    for stage, root in roots.items():
        t = Trainer(1, stage)
        for step in (1, 2):
            t.train(step)
            t.save(root)


def _build_cases(base: str, tag: str, pristine: str, world: int, outside: str) -> dict[str, str]:
    cases = {}
    for case in CASES:
        root = os.path.join(base, tag, case.name.replace("^", ""))
        shutil.copytree(pristine, root, symlinks=True)
        away = os.path.join(outside, tag, case.name.replace("^", ""))
        os.makedirs(away)
        case.build(Ctx(root, away, world))
        cases[case.name] = root
    return cases


@pytest.fixture(scope="module")
def catalogue(tmp_path_factory):
    base = str(tmp_path_factory.mktemp("hostile"))
    outside = os.path.join(base, "outside")
    os.mkdir(outside)
    audit()  # installed before anything runs, so the hook sees every open of the consumers
    pristine = {(w, s): os.path.join(base, f"pristine-w{w}s{s}") for w in (1, 2) for s in (2, 3)}
    _save_world1({s: pristine[1, s] for s in (2, 3)})
    run_ranks(save_fixture, 2, base, {s: pristine[2, s] for s in (2, 3)})
    fixtures = {key: {"pristine": root, "cases": _build_cases(base, f"w{key[0]}s{key[1]}", root, key[0], outside)}
                for key, root in pristine.items()}
    # World 2 loads the world-2 roots in a subprocess while this process runs the rest.
    spec = os.path.join(base, "w2.json")
    with open(spec, "w") as f:
        json.dump({str(s): fixtures[2, s] for s in (2, 3)}, f)
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}
    w2 = subprocess.Popen([sys.executable, "-m", "tests.support.hostile_consumers", spec, os.path.join(base, "w2")],
                          cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    results, grew = [], 0.0
    try:
        for (world, stage), fixture in fixtures.items():
            tag = f"w{world}s{stage}"
            t = Trainer(1, stage, seed=123)  # world 1: a world-2 root is resharded to it
            fixture = {**fixture, "refs": references(t, fixture["pristine"])}
            start = max_rss_mib()
            results += run_loads(t, fixture, f"{tag}->w1")
            results += run_tools(fixture, tag, os.path.join(base, "exports"))
            grew = max(grew, max_rss_mib() - start)
        log, _ = w2.communicate(timeout=600)
    finally:
        if w2.poll() is None:
            w2.kill()
    assert w2.returncode == 0, f"world-2 catalogue failed:\n{log[-4000:]}"
    ranks = [json.load(open(os.path.join(base, f"w2.rank{r}"))) for r in range(2)]
    for r, res in enumerate(ranks):
        results += [{**x, "consumer": f"{x['consumer']}@rank{r}"} for x in res["results"]]
    return results, [grew] + [res["rss_growth_mib"] for res in ranks]


def test_hostile_catalogue(catalogue):
    results, growth = catalogue
    by_class = collections.defaultdict(lambda: [0, 0])
    for r in results:
        by_class[r["cls"]][1] += 1
        by_class[r["cls"]][0] += r["problem"] is None
    handled = sum(h for h, _ in by_class.values())
    lines = [f"hostile checkpoints handled/tried: {handled}/{len(results)} "
             f"({len(CASES)} cases x world 1, 2 x stages 2, 3 x consumers)"]
    lines += [f"  {cls:22s} {h}/{n}" for cls, (h, n) in sorted(by_class.items())]
    lines.append(f"  extra peak RSS per process (MiB): {[round(g) for g in growth]}")
    print("\n".join(lines))
    failures = [f"{r['case']} [{r['consumer']}]: {r['problem']}" for r in results if r["problem"]]
    assert not failures, f"{len(failures)} mishandled:\n" + "\n".join(failures[:40])
    assert max(growth) < RSS_BOUND_MIB, f"extra memory {growth} MiB exceeds {RSS_BOUND_MIB} MiB"
    assert {r["cls"] for r in results} >= {"fifo", "symlink", "bounded-read", "step-name", "decode-before-apply",
                                          "hyperparameter-type", "malformed-value", "safetensors-header"}


# -- save applies the load's checks; failures after the commit point say so ------------------
def _trained(stage: int = 2) -> Trainer:
    t = Trainer(1, stage)
    t.train(1)
    return t


@pytest.mark.parametrize("step", [True, 10**20, -1, 2.5, "3"])
def test_save_refuses_steps_the_load_refuses(tmp_path, step):
    t = _trained()
    with pytest.raises(ValueError, match="step="):
        zeroshard.save_checkpoint(str(tmp_path), step, model=t.model, optimizer=t.opt)
    assert not os.listdir(tmp_path)


@pytest.mark.parametrize("stage", [True, 2.0])
def test_save_refuses_a_stage_the_load_refuses(tmp_path, stage):
    t = _trained()
    object.__setattr__(t.opt.engine.config, "stage", stage)  # what a config that let it through would hold
    with pytest.raises(ValueError, match=f"stage={stage!r}"):
        zeroshard.save_checkpoint(str(tmp_path), 1, model=t.model, optimizer=t.opt)
    assert not os.listdir(tmp_path)


def test_save_refuses_hyperparameters_the_load_refuses(tmp_path):
    t = _trained()
    t.opt.param_groups[0]["betas"] = 5
    with pytest.raises(ValueError, match="'betas'.*pair"):
        zeroshard.save_checkpoint(str(tmp_path), 1, model=t.model, optimizer=t.opt)


def _fail_at(point: str):
    def hook(name: str) -> None:
        if name == point:
            raise OSError(5, "Input/output error (injected)", "disk")
    return hook


def test_failure_after_the_commit_point_is_not_nothing_committed(tmp_path, monkeypatch):
    t = _trained()
    root = str(tmp_path)
    t.save(root)
    t.train(2)
    monkeypatch.setattr(commit, "fault_hook", _fail_at("rotate"))
    with pytest.warns(RuntimeWarning, match="step 2 was committed"):
        path = zeroshard.save_checkpoint(root, 2, model=t.model, optimizer=t.opt, keep_last=1).wait()
    assert path.endswith(S2) and zeroshard.latest_checkpoint(root) == path


def test_failure_before_the_commit_point_puts_the_old_step_back(tmp_path, monkeypatch):
    t = _trained()
    root = str(tmp_path)
    t.save(root)
    before = sorted(os.listdir(root))
    t.train(2)
    monkeypatch.setattr(commit, "fault_hook", _fail_at("after_rename"))
    with pytest.raises(CheckpointError, match="Nothing was committed"):
        t.save(root)  # step 2 fails before `latest` moves: it must not stay visible
    assert sorted(os.listdir(root)) == before
    t.step = 1
    monkeypatch.setattr(commit, "fault_hook", _fail_at("after_rename"))
    with pytest.raises(CheckpointError, match="Nothing was committed"):
        t.save(root)  # re-saving step 1: the old step 1 must come back
    fresh = Trainer(1, 2, seed=5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert fresh.load(root)["step"] == 1
    assert sorted(os.listdir(root)) == before


def test_a_save_one_rank_cannot_encode_fails_on_every_rank(tmp_path):
    res = run_ranks(save_refused_on_one_rank, 2, tmp_path, str(tmp_path / "root"))
    assert "TypeError" in res[1]["outcome"] and "rank 1" in res[0]["outcome"], res
    assert not [n for n in res[0]["listing"] if n.startswith("step-")], res


def test_cli_on_a_file_or_into_a_file_is_one_line(tmp_path, capsys):
    from zeroshard.cli import main
    f = tmp_path / "file"
    f.write_text("x")
    for argv in (["verify", str(f)], ["inspect", str(f)], ["export", str(f), str(tmp_path / "out")]):
        assert main(argv) == 1
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    root = str(tmp_path / "ckpt")
    t = _trained()
    t.save(root)
    assert main(["export", root, str(f), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "exists and is not a directory" in err and len(err.strip().splitlines()) == 1, err
