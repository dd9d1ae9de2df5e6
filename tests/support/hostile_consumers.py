"""The four consumers of a checkpoint, run on each hostile case with a verdict per run.

Consumers: ``load_checkpoint(root)`` and ``load_checkpoint(step 2)`` (in this process at
world 1, in gloo ranks at world 2), ``latest_checkpoint``/``full_check`` (verify),
``zeroshard verify``, ``zeroshard inspect`` and ``zeroshard export``. Each run is watched:
an audit hook records every file opened, a timer stops a run that hangs, and the verdict
says whether the run did what the case expects (fell back to the right step with state
equal to it, or refused naming the problem with the model untouched).
"""
from __future__ import annotations

import contextlib
import faulthandler
import hashlib
import io
import json
import os
import random
import re
import resource
import shutil
import struct
import sys
import warnings
from typing import Iterator, Optional

import numpy as np
import torch

import zeroshard
from tests.support.ckpt_worker import Trainer
from tests.support.hostile_cases import CASES, S1, S2, Case
from zeroshard.checkpoint import CheckpointError, latest_checkpoint
from zeroshard.checkpoint.locate import full_check, quick_check

CASE_TIMEOUT = 20  # seconds: a run that takes longer is hanging (every run here takes well under 1 s)


class Audit:
    """Every path opened while ``watch`` is active whose real path is outside ``allowed``."""

    def __init__(self) -> None:
        self.allowed: list[str] = []
        self.bad: list[str] = []
        self.active = False
        self.library = [os.path.realpath(p) for p in sys.path if p and os.path.isdir(p) and p != "/"]
        sys.addaudithook(self._hook)

    def _hook(self, event: str, args: tuple) -> None:
        if not self.active or event != "open" or not isinstance(args[0], (str, bytes, os.PathLike)):
            return
        self.active = False  # realpath below must not recurse into the hook
        try:
            path = os.fsdecode(args[0])
            real = os.path.realpath(path)
            if not any(real == a or real.startswith(a + os.sep) for a in self.allowed + self.library):
                self.bad.append(path if real == path else f"{path} -> {real}")
        finally:
            self.active = True

    @contextlib.contextmanager
    def watch(self, *allowed: str) -> Iterator[list[str]]:
        self.allowed, self.bad = [os.path.realpath(a) for a in allowed], []
        self.active = True
        try:
            yield self.bad
        finally:
            self.active = False


_AUDIT: Optional[Audit] = None


def audit() -> Audit:
    global _AUDIT
    if _AUDIT is None:
        _AUDIT = Audit()
    return _AUDIT


@contextlib.contextmanager
def deadline(seconds: int) -> Iterator[None]:
    """A hanging run dumps its stack and ends the process (pytest and ranks alike): a hang
    fails loudly instead of stalling the suite."""
    faulthandler.dump_traceback_later(seconds, exit=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


def state_of(t: Trainer) -> tuple[str, dict[str, bytes]]:
    """(digest of everything a load sets, parameter bytes by name). A collective."""
    params = zeroshard.full_state_dict(t.model, rank0_only=False)
    h = hashlib.sha256()
    raw = {n: params[n].contiguous().view(torch.uint8).numpy().tobytes() for n in sorted(params)}
    for n, b in raw.items():
        h.update(n.encode() + b)
    osd = t.opt.consolidated_state_dict(to_rank=None)
    for pid in sorted(osd["state"]):
        for k, v in sorted(osd["state"][pid].items()):
            h.update(f"{pid}{k}".encode() + (v.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
                                              if isinstance(v, torch.Tensor) else repr(v).encode()))
    h.update(json.dumps(osd["param_groups"], sort_keys=True, default=repr).encode())
    h.update(json.dumps(t.sched.state_dict(), sort_keys=True, default=repr).encode())
    h.update(json.dumps(t.sampler.state_dict(), sort_keys=True).encode())
    h.update(repr(random.getstate()).encode() + repr(np.random.get_state()[1].tolist()).encode())
    h.update(torch.get_rng_state().numpy().tobytes())
    return h.hexdigest(), raw


def _load(t: Trainer, path: str) -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return zeroshard.load_checkpoint(path, model=t.model, optimizer=t.opt, scheduler=t.sched,
                                         dataloader=t.sampler)


def references(t: Trainer, root: str) -> dict[int, tuple[str, dict[str, bytes]]]:
    """The state after loading each pristine step exactly: what a fallback must reproduce."""
    refs = {}
    for step, name in ((1, S1), (2, S2)):
        _load(t, os.path.join(root, name))
        refs[step] = state_of(t)
    return refs


def load_verdict(t: Trainer, path: str, case: Case, refs: dict, exact: bool) -> Optional[str]:
    """None when the load did what the case expects, else what went wrong."""
    before = state_of(t)[0]
    want = 2 if exact and case.expect == 2 else None if exact else case.expect
    try:
        info = _load(t, path)
    except CheckpointError as exc:
        if want is not None:
            return f"raised {type(exc).__name__}: {exc}"
        if state_of(t)[0] != before:
            return "refused but changed the model/optimizer/trainer state"
        if case.match and not re.search(case.match, str(exc)):
            return f"refused without naming the problem ({case.match!r}): {exc}"
        return None
    except Exception as exc:  # noqa: BLE001 - any other exception is a failure of the case
        return f"raised {type(exc).__name__} (not a CheckpointError): {exc}"
    if want is None:
        return f"loaded step {info['step']} from a step that must be refused"
    if info["step"] != want or state_of(t)[0] != refs[want][0]:
        return f"loaded step {info['step']} (want {want}) or state differs from that step"
    reasons = " | ".join(r for _, r in info["skipped"])
    if not exact and case.match and not re.search(case.match, reasons):
        return f"skip reason does not name the problem ({case.match!r}): {reasons!r}"
    return None


def _cli(*argv: str) -> tuple[int, str]:
    from zeroshard.cli import main
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rc = main(list(argv))
    return rc, out.getvalue() + err.getvalue()


def verify_verdict(root: str, case: Case) -> Optional[str]:
    """latest_checkpoint(verify=True) and full_check agree with what a load does."""
    step2 = os.path.join(root, S2)
    reason = full_check(step2)
    if (reason is None) != (case.expect == 2):
        return f"full_check(step 2) says {reason!r}, but a load {'uses' if case.expect == 2 else 'refuses'} it"
    if reason is not None and case.match and not re.search(case.match, reason):
        return f"full_check does not name the problem ({case.match!r}): {reason}"
    found = latest_checkpoint(root, verify=True)
    if found != os.path.join(root, S1 if case.expect == 1 else S2):
        return f"latest_checkpoint(verify=True) = {found!r}"
    quick = latest_checkpoint(root)
    if quick not in (os.path.join(root, S1), step2) or case.expect == 2 and quick != step2:
        return f"latest_checkpoint() = {quick!r}"
    return None


def cli_verify_verdict(root: str, case: Case) -> Optional[str]:
    rc, text = _cli("verify", root)
    damaged = f"DAMAGED  {os.path.join(root, S2)}" in text
    if "Traceback" in text or rc not in (0, 1) or damaged != (case.expect == 1) or \
            f"OK       {os.path.join(root, S1)}" not in text:
        return f"zeroshard verify: rc {rc}: {text[-600:]}"
    return None


def cli_inspect_verdict(root: str, case: Case) -> Optional[str]:
    rc, text = _cli("inspect", root)
    invalid = f"{os.path.join(root, S2)}: INVALID" in text
    # (exit status 1 exactly when a step it shows is invalid: scripts rely on it)
    if "Traceback" in text or rc != int(": INVALID (" in text) or invalid != (quick_check(os.path.join(root, S2)) is not None) or \
            "latest valid:" not in text:
        return f"zeroshard inspect: rc {rc}: {text[-600:]}"
    return None


def _read_export(out: str) -> dict[str, bytes]:
    tensors = {}
    for name in sorted(os.listdir(out)):
        if name.endswith(".safetensors"):
            raw = open(os.path.join(out, name), "rb").read()
            (n,) = struct.unpack("<Q", raw[:8])
            for key, e in json.loads(raw[8:8 + n]).items():
                if key != "__metadata__":
                    a, b = e["data_offsets"]
                    tensors[key] = raw[8 + n + a:8 + n + b]
    return tensors


def cli_export_verdict(root: str, case: Case, refs: dict, out: str) -> Optional[str]:
    """Exports the step a load takes; a damage only the data checksums find is refused
    naming it (one line, no partial shard left)."""
    rc, text = _cli("export", root, out, "--no-progress")
    if "Traceback" in text:
        return f"zeroshard export printed a traceback: {text[-600:]}"
    if rc == 0:
        with open(os.path.join(out, "model.safetensors.index.json")) as f:
            step = json.load(f)["metadata"]["zeroshard_step"]
        if step != case.expect:
            return f"exported step {step}, a load uses step {case.expect}"
        got, want = _read_export(out), refs[step][1]
        if any(got.get(k) != v for k, v in want.items() if k in got) or not got:
            return f"exported weights differ from step {step}"
        return None
    if case.expect == 2 or len(text.strip().splitlines()) != 1 or case.match and not re.search(case.match, text):
        return f"zeroshard export: rc {rc}: {text[-600:]}"
    if os.path.isdir(out) and any(n.endswith(".safetensors") for n in os.listdir(out)):
        return "a refused export left a shard behind"
    return None


def run_loads(t: Trainer, fixture: dict, tag: str, exact_too: bool = True) -> list[dict]:
    """Both load consumers over every case of one fixture; one result per run."""
    results = []
    for case in CASES:
        root = fixture["cases"][case.name]
        runs = [("load", root, False)] + ([("load-exact", os.path.join(root, S2), True)] if exact_too else [])
        for consumer, path, exact in runs:
            with deadline(CASE_TIMEOUT), audit().watch(root) as opened:
                problem = load_verdict(t, path, case, fixture["refs"], exact)
            if opened:
                problem = f"opened outside the root: {opened[:3]}" + (f"; {problem}" if problem else "")
            results.append({"case": case.name, "cls": case.cls, "consumer": f"{consumer}@{tag}", "problem": problem})
    return results


def run_tools(fixture: dict, tag: str, scratch: str) -> list[dict]:
    """verify, zeroshard verify, inspect and export over every case of one fixture."""
    results = []
    for case in CASES:
        root = fixture["cases"][case.name]
        out = os.path.join(scratch, f"{tag}-{case.name}".replace("\n", "nl").replace("^", ""))
        runs = [("verify", lambda: verify_verdict(root, case)), ("cli-verify", lambda: cli_verify_verdict(root, case)),
                ("cli-inspect", lambda: cli_inspect_verdict(root, case)),
                ("cli-export", lambda: cli_export_verdict(root, case, fixture["refs"], out))]
        for consumer, run in runs:
            with deadline(CASE_TIMEOUT), audit().watch(root, out) as opened:
                try:
                    problem = run()
                except Exception as exc:  # noqa: BLE001 - reported as the case's failure
                    problem = f"raised {type(exc).__name__}: {exc}"
            if opened:
                problem = f"opened outside the root: {opened[:3]}" + (f"; {problem}" if problem else "")
            results.append({"case": case.name, "cls": case.cls, "consumer": f"{consumer}@{tag}", "problem": problem})
        shutil.rmtree(out, ignore_errors=True)
    return results


def max_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# -- ranks (zeroshard.testing.launch.spawn) -----------------------------------------------------------
def save_fixture(rank: int, world: int, out: str, roots: dict) -> None:
    """Steps 1 and 2 of a short run for each stage in ``roots`` ({stage: root})."""
    for stage, root in roots.items():
        t = Trainer(world, int(stage))
        for step in (1, 2):
            t.train(step)
            t.save(root)
    with open(f"{out}.rank{rank}", "w") as f:
        json.dump({}, f)


def load_catalogue(rank: int, world: int, out: str, fixtures: dict) -> None:
    """Both load consumers over every case of every fixture ({stage: {"pristine", "cases"}})."""
    results, grew = [], 0.0
    for stage, fixture in fixtures.items():
        t = Trainer(world, int(stage), seed=123)
        fixture = {**fixture, "refs": references(t, fixture["pristine"])}
        start = max_rss_mib()
        results += run_loads(t, fixture, f"w{world}s{stage}")
        grew = max(grew, max_rss_mib() - start)
    with open(f"{out}.rank{rank}", "w") as f:
        json.dump({"results": results, "rss_growth_mib": grew}, f)


class _UnsaveableOnRank1:
    """A data position whose state holds a lambda on rank 1 only."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def state_dict(self) -> dict:
        return {"epoch": 0, "hook": (lambda: 0) if self.rank == 1 else None}


def save_refused_on_one_rank(rank: int, world: int, out: str, root: str) -> None:
    """A save that one rank cannot encode fails on every rank (no rank left waiting)."""
    t = Trainer(world, 2)
    t.train(1)
    try:
        zeroshard.save_checkpoint(root, 1, model=t.model, optimizer=t.opt, dataloader=_UnsaveableOnRank1(rank))
        outcome = "saved"
    except (TypeError, CheckpointError) as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    with open(f"{out}.rank{rank}", "w") as f:
        json.dump({"outcome": outcome, "listing": sorted(os.listdir(root)) if os.path.isdir(root) else []}, f)


if __name__ == "__main__":  # python -m tests.support.hostile_consumers SPEC OUT: the world-2 load catalogue
    from zeroshard.testing.launch import spawn
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    spawn(load_catalogue, 2, sys.argv[2], spec)
