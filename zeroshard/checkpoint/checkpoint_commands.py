"""``zeroshard inspect | verify | export``: checkpoints from the command line."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import TYPE_CHECKING, Callable, Optional

from zeroshard.checkpoint import locate, manifest
from zeroshard.checkpoint.checkpoint_errors import CheckpointError
from zeroshard.checkpoint.export import export_hf
from zeroshard.checkpoint.safe_fs import is_real_dir
from zeroshard.checkpoint.shard_file import DTYPES
from zeroshard.cli import Command
from zeroshard.resilience import tier_report

if TYPE_CHECKING:
    from tqdm import tqdm as Tqdm


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def _steps(path: str) -> list[str]:
    return [path] if locate.is_step_dir(path) else list(reversed(locate.candidates(path)))


def _summary(step_dir: str) -> dict:
    body = locate.check_step(step_dir)
    tensors = {}
    for name, meta in body["tensors"].items():
        kinds = sorted({k for p in meta["pieces"] for k in p["keys"]})
        numel = 1
        for d in meta["shape"]:
            numel *= d
        tensors[name] = {"shape": meta["shape"], "dtype": meta["dtype"], "pieces": len(meta["pieces"]),
                         "bytes": numel * DTYPES[meta["dtype"]].itemsize, "stored": kinds}
    return {"path": step_dir, "step": body["step"], "world_size": body["world_size"], "stage": body["stage"],
            "mixed_precision": body.get("mixed_precision"), "optimizer": body.get("optimizer"),
            "files": {n: m["bytes"] for n, m in body["files"].items()},
            "total_bytes": sum(m["bytes"] for m in body["files"].values()), "tensors": tensors}


# -- inspect ---------------------------------------------------------------------------------
def _inspect_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("ckpt", help="a checkpoint root, one step directory, or a memory tier's directory")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.add_argument("--tensors", action="store_true", help="list every tensor")


def _pacing(slot: dict) -> str:
    """``every="auto"``'s K and measured cost as stamped (Note [commit pacing])."""
    if not isinstance(slot.get("every"), int):
        return ""
    cost = slot.get("commit_cost")
    return f", then every {slot['every']} steps" + (f" (a commit costs {cost:.1%} of a step)"
                                                     if isinstance(cost, (int, float)) else " (probing)")


def _inspect_tier(root: str, as_json: bool) -> int:
    """A memory tier's slots and the steps they cover (Note [peer memory tier]); 1 if a slot is torn."""
    report = tier_report.describe(root)
    invalid = 0 if all(s["valid"] for s in report["slots"]) else 1
    if as_json:
        print(json.dumps(report, indent=1))
        return invalid
    print(f"{root}: memory tier, {len(report['slots'])} slots, {_human(report['bytes'])}")
    for s in report["slots"]:
        print(f"  {s['holder']}/{s['copy']:7s} rank {s['owner']}'s state, step {s['step']}, world size "
              f"{s['world_size']}, run {s['run_id']!r}, {_human(s['bytes'])}, "
              + ("valid" if s["valid"] else f"INVALID ({s['problem']})") + _pacing(s)
              + (f", XOR parity of group {s['parity_group']}" if s.get("parity_group") else "")
              + (", rebuilt from parity" if s.get("rebuilt") else ""))
    for st in report["steps"]:
        print(f"  step {st['step']} (run {st['run_id']!r}, world size {st['world_size']}): ranks {st['owners']} "
              + ("covered: recoverable from memory" if st["complete"] else "only: not recoverable from memory"))
    return invalid


def _inspect(args: argparse.Namespace) -> int:
    if tier_report.is_tier_root(args.ckpt):
        return _inspect_tier(args.ckpt, args.json)
    steps = _steps(args.ckpt)
    if not steps:
        print(f"no checkpoint steps under {args.ckpt}", file=sys.stderr)
        return 1
    report: list[dict] = []  # (per step: _summary's, or the path and why it is invalid)
    for d in steps:
        reason = locate.quick_check(d)
        report.append(_summary(d) if reason is None else {"path": d, "invalid": reason})
    invalid = 1 if any("invalid" in r for r in report) else 0  # (scripts rely on the status, not the text)
    if args.json:
        print(json.dumps(report, indent=1))
        return invalid
    for r in report:
        if "invalid" in r:
            print(f"{r['path']}: INVALID ({r['invalid']})")
            continue
        print(f"{r['path']}: step {r['step']}, world size {r['world_size']}, stage {r['stage']}, "
              f"precision {r['mixed_precision'] or 'fp32'}, optimizer {r['optimizer']}, "
              f"{len(r['tensors'])} tensors, {len(r['files'])} files, {_human(r['total_bytes'])}")
        if args.tensors:
            for name, t in r["tensors"].items():
                print(f"  {name:50s} {str(t['shape']):>20s} {t['dtype']:5s} {_human(t['bytes']):>10s} "
                      f"{t['pieces']} pieces  {','.join(t['stored'])}")
    latest = locate.latest_checkpoint(args.ckpt) if not locate.is_step_dir(args.ckpt) else None
    if latest:
        print(f"latest valid: {latest}")
    return invalid


# -- verify ----------------------------------------------------------------------------------
def _verify_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("ckpt", help="a checkpoint root (every step) or one step directory")


def _verify(args: argparse.Namespace) -> int:
    steps = _steps(args.ckpt)
    if not steps:
        print(f"no checkpoint steps under {args.ckpt}", file=sys.stderr)
        return 1
    bad = 0
    skipped = None if locate.is_step_dir(args.ckpt) else _latest_left_out(args.ckpt)
    if skipped is not None:
        bad += 1
        print(f"SKIPPED  {skipped}")
    for d in steps:
        t0 = time.perf_counter()
        reason = locate.full_check(d)
        if reason is None:
            size = sum(m["bytes"] for m in locate.check_step(d)["files"].values())
            print(f"OK       {d} ({_human(size)} in {time.perf_counter() - t0:.2f} s)")
        else:
            bad += 1
            print(f"DAMAGED  {d}: {reason}")
    if bad:
        print(f"{bad} of {len(steps) + (skipped is not None)} step(s) damaged or skipped; load_checkpoint(root) "
              "skips them", file=sys.stderr)
    return 1 if bad else 0


def _latest_left_out(root: str) -> Optional[str]:
    """What is wrong with ``root/latest`` when the step it names is not among the steps a load
    tries (absent, or a symlink: step directories are never followed), else None."""
    latest = os.path.join(root, manifest.LATEST)
    if not os.path.lexists(latest):
        return None
    named = locate.read_latest(root)
    if named is None:
        return f"{latest}: not a regular file naming a step; load_checkpoint(root) ignores it"
    path = os.path.join(root, named)
    if not os.path.lexists(path):
        return f"{path}: {latest} names it, and it does not exist"
    if not is_real_dir(path):
        kind = f"a symlink to {os.readlink(path)!r}" if os.path.islink(path) else "not a directory"
        return (f"{path}: {latest} names it, and it is {kind}; step directories are never followed, so "
                "load_checkpoint(root) and verify skip it")
    return None


# -- export ----------------------------------------------------------------------------------
def _export_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("ckpt", help="a step directory, or a root (its latest valid step)")
    p.add_argument("out", help="output directory (Hugging Face layout)")
    p.add_argument("--max-shard-size", default="2GB", help="e.g. 2GB, 500MiB (default 2GB)")
    p.add_argument("--dtype", default=None, help="cast floating tensors: bf16, fp16, fp32")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--base", default=None, metavar="DIR",
                   help="the base model's Hugging Face directory (safetensors), for a checkpoint that left its "
                        "frozen weights out (a PEFT model's): they are read from there, checked against the "
                        "digests the checkpoint recorded, and the whole model is written")


class _Bar:
    """A dependency-free progress bar on stderr (tqdm when it is installed)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled, self.last = enabled, 0.0
        self.tqdm: Optional[Tqdm] = None
        self.t0 = time.perf_counter()

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        try:
            from tqdm import tqdm
            if self.tqdm is None:
                self.tqdm = tqdm(total=total, unit="B", unit_scale=True, desc="export")
            self.tqdm.update(done - self.tqdm.n)
            return
        except ImportError:
            pass
        now = time.perf_counter()
        if now - self.last < 0.1 and done < total:
            return
        self.last = now
        frac = done / total if total else 1.0
        rate = done / max(now - self.t0, 1e-9)
        sys.stderr.write(f"\rexport [{'#' * int(30 * frac):30s}] {100 * frac:5.1f}% "
                         f"{_human(done)}/{_human(total)} {_human(rate)}/s")
        sys.stderr.flush()

    def close(self) -> None:
        if self.tqdm is not None:
            self.tqdm.close()
        elif self.enabled:
            sys.stderr.write("\n")


def _export(args: argparse.Namespace) -> int:
    bar = _Bar(not args.no_progress)
    try:
        index = export_hf(args.ckpt, args.out, max_shard_size=args.max_shard_size, dtype=args.dtype,
                          progress=bar, base=args.base)
    finally:
        bar.close()
    with open(index) as f:
        files = json.load(f)["weight_map"]
    print(f"wrote {len(set(files.values()))} shard(s) and {os.path.basename(index)} to {args.out}")
    return 0


def _convert_dcp_args(p: argparse.ArgumentParser) -> None:
    from zeroshard.checkpoint import dcp_convert  # (it builds a ZeroOptimizer: imported when run)
    dcp_convert.add_arguments(p)


def _convert_dcp(args: argparse.Namespace) -> int:
    from zeroshard.checkpoint import dcp_convert
    return dcp_convert.run(args)


def _one_line(name: str, run: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """A refused checkpoint or path is one line on stderr and exit status 1, not a traceback
    (the errors are the loader's own, naming the file and the problem)."""
    def guarded(args: argparse.Namespace) -> int:
        try:
            return run(args)
        except (CheckpointError, OSError, ValueError) as exc:
            print(f"zeroshard {name}: {exc}", file=sys.stderr)
            return 1
    return guarded


COMMANDS = {
    "inspect": Command("show a checkpoint's steps, world size, stage, tensors and sizes", _inspect_args,
                       _one_line("inspect", _inspect)),
    "verify": Command("check every file's checksums; non-zero exit on damage", _verify_args,
                      _one_line("verify", _verify)),
    "export": Command("write a step's weights in the Hugging Face safetensors layout", _export_args,
                      _one_line("export", _export)),
    "convert-dcp": Command("convert between a zeroshard checkpoint and a torch Distributed Checkpoint (FSDP2, "
                           "torchtitan), either way", _convert_dcp_args, _one_line("convert-dcp", _convert_dcp)),
}
