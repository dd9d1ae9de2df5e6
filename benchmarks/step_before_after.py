"""Step time and per-rank memory of two source trees, measured in one session (issue 26: a
refactor must not slow the step): ``zeroshard bench step`` runs alternately from each tree,
``--rounds`` times (the order flips every round, so machine noise hits both alike), and the
medians are compared: each tree's zeroshard stage ÷ its own single-process AdamW, and new ÷ old.

    git worktree add /tmp/old <commit>
    python benchmarks/step_before_after.py --old /tmp/old --new . --model large --world-size 2
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

KINDS = ("single", "zeroshard_stage2", "zeroshard_stage3")


def one_run(tree: str, args: argparse.Namespace, out: str) -> dict[str, dict]:
    env = {**os.environ, "PYTHONPATH": os.path.abspath(tree)}
    cmd = [sys.executable, "-m", "zeroshard.bench", "step", "--model", args.model, "--world-size",
           str(args.world_size), "--configs", ",".join(KINDS), "--rounds", "1", "--steps", str(args.steps),
           "--out", out]
    subprocess.run(cmd, cwd=os.path.abspath(tree), env=env, check=False, capture_output=True, text=True)
    with open(os.path.join(out, "step.json")) as f:
        rows = json.load(f)["rows"]
    failed = [r for r in rows if r.get("error")]
    if failed:
        raise RuntimeError(f"{tree}: {failed}")
    return {r["config"]: r for r in rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--old", required=True)
    p.add_argument("--new", required=True)
    p.add_argument("--model", default="large")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=4)
    args = p.parse_args()
    seen: dict[str, dict[str, list[dict]]] = {"old": {k: [] for k in KINDS}, "new": {k: [] for k in KINDS}}
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(args.rounds):
            for which in (("old", "new") if rnd % 2 == 0 else ("new", "old")):
                out = os.path.join(tmp, f"{which}{rnd}")
                rows = one_run(getattr(args, which), args, out)
                for k in KINDS:
                    seen[which][k].append(rows[k])
                print(f"round {rnd} {which}: " + ", ".join(f"{k} {rows[k]['step_s']:.3f}s" for k in KINDS),
                      file=sys.stderr, flush=True)
    med = {w: {k: statistics.median(r["step_s"] for r in seen[w][k]) for k in KINDS} for w in seen}
    mem = {w: {k: max(r["memory_bytes"] for r in seen[w][k]) for k in KINDS} for w in seen}
    result = {"model": args.model, "world_size": args.world_size, "rounds": args.rounds, "steps": args.steps,
              "median_step_s": med, "memory_bytes": mem,
              "vs_single": {w: {k: med[w][k] / med[w]["single"] for k in KINDS[1:]} for w in med},
              "new_over_old_step": {k: med["new"][k] / med["old"][k] for k in KINDS},
              "new_over_old_memory": {k: mem["new"][k] / mem["old"][k] for k in KINDS}}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
