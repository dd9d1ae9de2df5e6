"""Counts aborts at exit of a finished 2-rank job, both endings x both launchers (issue 43).

    PYTHONPATH=. python benchmarks/check_exit_endings.py --runs 50

runs tests/support/exit_endings_worker.py ``--runs`` times for each of (mp.spawn, torchrun) x (the
user's own ``destroy_process_group()``, none) and prints, per combination, the runs that exited
0, the failed runs and the aborts ("terminate called" in the output, or a signal). Exit status
1 when any run failed. Note [clean exit] in zeroshard/comm/clean_exit.py.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from typing import Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(REPO, "tests", "support", "exit_endings_worker.py")
COMBOS = [(launcher, ending) for launcher in ("spawn", "torchrun") for ending in ("destroy", "plain")]


def run_once(launcher: str, ending: str, timeout_s: float = 300.0, root: Optional[str] = None) -> tuple[int, str]:
    """One job (in ``root``, or a temporary directory): (exit status, its output)."""
    if root is None:
        with tempfile.TemporaryDirectory() as tmp:
            return run_once(launcher, ending, timeout_s, tmp)
    from zeroshard.testing.launch import free_port
    env = {k: v for k, v in os.environ.items() if k != "ZEROSHARD_KEEP_PROCESS_GROUP"}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=REPO + os.pathsep + env.get("PYTHONPATH", ""))
    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
               str(free_port()), WORKER, launcher, ending, root]
    else:
        cmd = [sys.executable, WORKER, launcher, ending, root]
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:  # (a hang is a failed run, counted, not the end of the count)
        return 124, f"timed out after {timeout_s:g} s\n{exc.stdout or ''}{exc.stderr or ''}"
    return proc.returncode, proc.stdout + proc.stderr


def aborted(rc: int, output: str) -> bool:
    return "terminate called" in output or "SIGABRT" in output or "Signal 6" in output or rc < 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=50, help="runs per combination")
    parser.add_argument("--only", default=None, help="one combination, e.g. spawn/destroy (to run them in parallel)")
    args = parser.parse_args()
    failed_any = False
    for launcher, ending in [c for c in COMBOS if args.only in (None, "/".join(c))]:
        ok = failed = aborts = 0
        start = time.monotonic()
        for i in range(args.runs):
            rc, out = run_once(launcher, ending)
            ok += rc == 0
            failed += rc != 0
            aborts += aborted(rc, out)
            if rc != 0:
                print(f"  {launcher}/{ending} run {i}: exit {rc}\n" + out[-1500:], flush=True)
            print(f"  {launcher}/{ending} after {i + 1} runs: exit0={ok} failed={failed} aborts={aborts}", flush=True)
        failed_any |= failed > 0
        print(f"{launcher:8s} {ending:7s} runs={args.runs} exit0={ok} failed={failed} aborts={aborts} "
              f"({time.monotonic() - start:.0f} s)", flush=True)
    return 1 if failed_any else 0


if __name__ == "__main__":
    sys.exit(main())
