"""Every zeroshard benchmark behind one command, each in its own process, results in one folder.

    python benchmarks/run_all.py --out bench-results            # quick profile (~20-30 min on 2 cores)
    python benchmarks/run_all.py --profile full --out bench-results
    python benchmarks/run_all.py --only memory,step              # a subset

Writes ``OUT/<name>.txt`` (each benchmark's output), the benchmarks' own Markdown/CSV/JSON/PNG
files, and ``OUT/index.md``: the command, exit status, wall time and last lines of each. A
benchmark that fails or cannot run here is listed with its reason; the others still run.
Benchmarks report ratios measured within the same run, so a busy machine shifts them less
than absolute figures — but run the final numbers on a quiet machine.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))


@dataclass(frozen=True)
class Job:
    name: str
    quick: tuple[str, ...]
    full: tuple[str, ...]
    what: str


def jobs(out: str, scratch: str) -> list[Job]:
    py, bench = sys.executable, [sys.executable, "-m", "zeroshard.bench"]
    b = lambda f: os.path.join(HERE, f)  # noqa: E731
    return [
        Job("memory", (*bench, "memory", "--model", "small", "--out", out),
            (*bench, "memory", "--model", "medium", "--out", out), "memory by category vs ZeRO formulas (issue 7)"),
        Job("step", (*bench, "step", "--model", "medium", "--rounds", "2", "--steps", "3", "--out", out),
            (*bench, "step", "--model", "large", "--out", out), "step time vs DDP / ZeRO-1 / FSDP2 / DeepSpeed"),
        Job("adam", (py, b("bench_adam.py"), "--sizes", "100", "--rounds", "3", "--no-inductor"),
            (py, b("bench_adam.py")), "fused CPU Adam vs torch fused and DeepSpeedCPUAdam"),
        Job("collectives", (py, b("bench_collectives.py"), "--mb", "25", "--rounds", "3"),
            (py, b("bench_collectives.py")), "gloo collectives per ZeRO operation"),
        Job("aio", (py, b("bench_aio.py"), "--path", scratch, "--size", "512M", "--rounds", "2"),
            (py, b("bench_aio.py"), "--path", scratch), "async NVMe I/O vs fio/dd"),
        Job("checkpoint", (py, b("bench_checkpoint.py"), "--size-gb", "0.5", "--repeats", "1", "--dir",
                           os.path.join(scratch, "ckpt")),
            (py, b("bench_checkpoint.py"), "--dir", os.path.join(scratch, "ckpt")),
            "checkpoint save/load vs torch.save, safetensors, DCP and the raw disk"),
        Job("bigger", (py, b("bench_bigger_than_memory.py"), "--dir", os.path.join(scratch, "big"), "--layers", "12",
                       "--limit-gib", "3", "--fio-gib", "1"),
            (py, b("bench_bigger_than_memory.py"), "--dir", os.path.join(scratch, "big"),
             "--out", os.path.join(out, "bigger_than_memory.json")),
            "NVMe offload: a model 4x a cgroup memory limit trains, saves, resumes (root)"),
    ]


def _tail(path: str, n: int = 15) -> str:
    with open(path, errors="replace") as f:
        return "".join(f.readlines()[-n:])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench-results")
    ap.add_argument("--profile", choices=("quick", "full"), default="quick")
    ap.add_argument("--only", default="", help="comma-separated job names (memory, step, adam, collectives, aio, checkpoint, bigger)")
    ap.add_argument("--scratch", default=None, help="directory on the disk for I/O benchmarks (default: a temp dir)")
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    scratch = a.scratch or tempfile.mkdtemp(prefix="zeroshard-bench-")
    selected = [j for j in jobs(os.path.abspath(a.out), scratch) if not a.only or j.name in a.only.split(",")]
    if a.only and len(selected) != len(a.only.split(",")):
        print(f"--only {a.only!r}: known jobs are {[j.name for j in jobs(a.out, scratch)]}", file=sys.stderr)
        return 2
    index = [f"# zeroshard benchmarks ({a.profile} profile)", "", "| benchmark | what | exit | minutes | command |",
             "|---|---|---|---|---|"]
    details, failed = [], 0
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.path.dirname(HERE), os.environ.get("PYTHONPATH")]))}
    for job in selected:
        cmd = list(job.quick if a.profile == "quick" else job.full)
        log = os.path.join(a.out, f"{job.name}.txt")
        print(f"== {job.name}: {' '.join(cmd)}", flush=True)
        t0 = time.monotonic()
        with open(log, "w") as f:
            rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
        minutes = (time.monotonic() - t0) / 60
        failed += rc != 0
        here = os.getcwd() + os.sep
        shown = " ".join(os.path.relpath(c) if c.startswith(here) else c for c in cmd)
        index.append(f"| {job.name} | {job.what} | {rc} | {minutes:.1f} | `{shown}` |")
        details += ["", f"## {job.name}", "", "```", _tail(log).rstrip(), "```"]
        print(f"   exit {rc} after {minutes:.1f} min; output in {log}", flush=True)
    with open(os.path.join(a.out, "index.md"), "w") as f:
        f.write("\n".join(index + details) + "\n")
    print(f"index: {os.path.join(a.out, 'index.md')}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
