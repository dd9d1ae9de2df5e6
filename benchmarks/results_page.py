"""Assembles docs/results.md (the page the README links to) from ``zeroshard bench`` outputs.

    python benchmarks/results_page.py --memory bench-results/memory-medium \
        --estimate-check bench-results/memory-small,bench-results/memory-medium,bench-results/memory-large \
        --step bench-results/step --checkpoint docs/results/checkpoint.json --aio docs/results/aio.json \
        --bigger-than-memory docs/results/bigger_than_memory.json --out docs

Copies the chart and CSVs next to the page (docs/results/), so the page is reproducible from
the commands it prints and never depends on an ignored folder.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys

from zeroshard.bench import memory_bench as memory, step, tables

_COMPACT_KEYS = ("world_size", "config", "model_states", "theory_model_states", "fraction_of_stage0",
                 "theory_fraction_of_stage0", "estimate_over_measured", "rss_growth", "estimate_peak")
COMPACT: list[tables.Column] = [c for c in memory.COLUMNS if c[1] in _COMPACT_KEYS]


def _load(directory: str, name: str) -> dict:
    with open(os.path.join(directory, f"{name}.json")) as f:
        return json.load(f)


def _commit() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def compact_memory(result: dict, world: int) -> str:
    rows = [r for r in result["rows"] if r["world_size"] == world]
    return tables.markdown(rows, COMPACT)


def estimate_section(dirs: list[str]) -> list[str]:
    lines = ["| model | parameters | rows (stage × offload × world size) | worst estimate ÷ measured (model states) "
             "| estimate peak ÷ peak RSS growth (range) |", "|---|---|---|---|---|"]
    for d in dirs:
        r = _load(d, "memory")
        ok = [row for row in r["rows"] if not row.get("error")]
        worst = max(ok, key=lambda row: abs(row["estimate_over_measured"] - 1))
        peak = [row["estimate_peak"] / row["rss_growth"] for row in ok if row.get("estimate_peak") and row.get("rss_growth")]
        span = f"{min(peak):.2f}–{max(peak):.2f}" if peak else "not recorded"
        lines.append(f"| {r['model']} | {r['params'] / 1e6:.2f}M | {len(ok)} | {worst['estimate_over_measured']:.3f} "
                     f"({worst['config']}, N={worst['world_size']}) | {span} |")
    return lines


def checkpoint_section(path: str) -> list[str]:
    """Checkpoint save/load against the raw disk and peers (benchmarks/bench_checkpoint.py --json)."""
    with open(path) as f:
        c = json.load(f)
    gb = c["bytes"] / 1e9
    lines = ["## Checkpoints", "",
             f"```\npython benchmarks/bench_checkpoint.py --size-gb {gb:.0f} --rounds 3 --json {path}\n```", "",
             f"{gb:.1f} GB of training state (fp32 parameters + AdamW moments), best round of 3, page cache "
             f"dropped before every load; raw = dd O_DIRECT on the same disk (write {c['raw_write'] / 1e9:.2f}, "
             f"read {c['raw_read'] / 1e9:.2f} GB/s). Targets: save and load >= 80% of raw, async stall <= 5%.", "",
             "| | zeroshard | torch.save/load | safetensors | DCP |", "|---|---|---|---|---|"]
    for way, raw in (("save", c["raw_write"]), ("load", c["raw_read"])):
        cells = [f"{c[f'{k}_{way}'] / 1e9:.2f} GB/s ({c[f'{k}_{way}'] / raw:.0%})"
                 for k in ("zs", "torch", "safetensors", "dcp")]
        lines.append(f"| {way} (÷ raw) | " + " | ".join(cells) + " |")
    lines += ["", f"Async save: the training loop is blocked {c['async_call_s'] * 1e3:.0f} ms plus "
              f"{c['async_step_wait_s'] * 1e3:.0f} ms at the next step = {c['async_stall_fraction']:.1%} of a "
              f"synchronous save ({c['sync_save_s']:.2f} s); DCP's async_save blocks "
              f"{c['dcp_async_call_s'] * 1e3:.0f} ms = {c['dcp_async_fraction']:.1%} of its save.", ""]
    return lines


def offload_section(aio: str, big: str) -> list[str]:
    """NVMe offload: the I/O engine against fio, and the bigger-than-memory run (JSON files
    written by benchmarks/bench_aio.py --json and bench_bigger_than_memory.py --out)."""
    lines = ["## NVMe offload", ""]
    if aio and os.path.exists(aio):
        with open(aio) as f:
            r = json.load(f)
        g, q = r["median_gbps"], r["median_ratio_to_raw"]
        peers = " --peers deepspeed" if r.get("median_ratio_to_deepspeed") else ""
        lines += [f"```\npython benchmarks/bench_aio.py --path DIR --size {r['file_bytes'] >> 30}G "
                  f"--rounds {r['rounds']}{peers} --json {aio}\n```", "",
                  f"Sequential I/O on one {r['file_bytes'] / 2**30:.0f} GiB file, {r['block_size'] >> 20} MiB "
                  f"blocks x queue depth {r['queue_depth']}, O_DIRECT, medians of {r['rounds']} interleaved rounds "
                  "(target: the engine >= 90% of fio both ways; `--peers deepspeed` adds DeepSpeed's aio handle):", "",
                  "| contender | write GB/s | read GB/s | write ÷ fio | read ÷ fio |", "|---|---|---|---|---|"]
        for name in g:
            ratio = q.get(name, {})
            lines.append(f"| {name} | {g[name]['write_gbps']:.2f} | {g[name]['read_gbps']:.2f} | "
                         f"{ratio.get('write', 1.0):.2f} | {ratio.get('read', 1.0):.2f} |")
        lines.append("")
        for name, v in r.get("median_ratio_to_deepspeed", {}).items():
            lines.append(f"- {name} ÷ DeepSpeed's aio (same rounds): write {v['write']:.2f}x, read {v['read']:.2f}x")
        lines += ["", "`native` is the default engine (a pool of pread/pwrite threads), `kaio` the kernel-AIO "
                  "one (`AsyncIO(backend=\"kaio\")`), `python` the fallback without the extension.", ""]
    if big and os.path.exists(big):
        with open(big) as f:
            b = json.load(f)
        gib = 2**30
        lines += [f"```\nsudo python benchmarks/bench_bigger_than_memory.py --dir DIR --out {big}\n```", "",
                  f"One process in a cgroup limited to {b['limit_bytes'] / gib:.1f} GiB trains a "
                  f"{b['params'] / 1e9:.3f} B-parameter TinyGPT whose fp32 training state (16 B/parameter: "
                  f"weights, gradients, two Adam moments) is {b['state_bytes'] / gib:.1f} GiB = "
                  f"{b['state_over_limit']:.2f}x the limit, with stage 3, `offload_params=\"nvme\"`, "
                  "`offload_optimizer=\"nvme\"`; it saves a checkpoint, and a fresh process resumes from it.", "",
                  "| | |", "|---|---|",
                  f"| plain `torch.optim.AdamW`, same limit | {'killed by the OOM killer' if b['plain_adamw']['killed'] else 'ran'} |",
                  f"| peak RSS (train / resume) | {b['peak_rss']['train'] / gib:.2f} / {b['peak_rss']['resume'] / gib:.2f} GiB |",
                  f"| seconds per step (median, after each process's first) | {b['step_s']:.1f} |",
                  f"| raw disk (fio) write / read | {b['raw_gbps']['write']:.2f} / {b['raw_gbps']['read']:.2f} GB/s |",
                  f"| step ÷ time to read and write the state once at raw speed ({b['disk_once_s']:.1f} s) | "
                  f"{b['step_over_disk_once']:.2f} |",
                  f"| checkpoint save / load (streamed through the swap files) | {b['save_s']:.1f} / {b['load_s']:.1f} s |",
                  f"| resumed losses equal the uninterrupted run's, bit for bit | {b['resume_bitwise']} |", ""]
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--memory", required=True, help="output folder of the headline `bench memory` run")
    ap.add_argument("--estimate-check", default="", help="comma-separated `bench memory` folders (model sizes)")
    ap.add_argument("--step", default="", help="output folder of `bench step`")
    ap.add_argument("--checkpoint", default="", help="JSON of benchmarks/bench_checkpoint.py --json")
    ap.add_argument("--aio", default="", help="JSON of benchmarks/bench_aio.py --json")
    ap.add_argument("--bigger-than-memory", default="", help="JSON of benchmarks/bench_bigger_than_memory.py --out")
    ap.add_argument("--out", default="docs")
    a = ap.parse_args(argv)
    assets = os.path.join(a.out, "results")
    os.makedirs(assets, exist_ok=True)
    mem = _load(a.memory, "memory")
    shutil.copy(os.path.join(a.memory, "memory.png"), os.path.join(assets, "memory.png"))
    shutil.copy(os.path.join(a.memory, "memory.csv"), os.path.join(assets, "memory.csv"))
    top = max(r["world_size"] for r in mem["rows"])
    page = [
        "# Results", "",
        f"Measured {datetime.date.today().isoformat()} at commit `{_commit()}` on: {mem['machine']}. "
        "Every figure below is reproduced by the command above its table; tables are written by "
        "`zeroshard bench` (Markdown, CSV, JSON) and assembled by `benchmarks/results_page.py`.", "",
        "## Memory per rank by category (`zeroshard bench memory`)", "",
        f"```\nzeroshard bench memory --model {_model_arg(mem)} --out bench-results/memory-{_model_arg(mem)}\n```", "",
        f"World size {top}, model states per rank as a fraction of stage 0, measured by tensor accounting "
        "against the ZeRO formula:", "", compact_memory(mem, top), "",
        "![model states per rank](results/memory.png)", "",
        "Full table (all categories, world sizes 1, 2, 4, offload rows; CSV in `results/memory.csv`):", "",
        memory.report_markdown(mem), "",
    ]
    if a.estimate_check:
        dirs = a.estimate_check.split(",")
        page += ["## `zeroshard estimate` against `bench memory`", "",
                 "```\n" + "\n".join(f"zeroshard bench memory --model {_model_arg(_load(d, 'memory'))} --out {d}"
                                     for d in dirs) + "\n```", "",
                 "The planner's model-state bytes per rank for every configuration and world size, "
                 "divided by the measured ones (target: within 10%). The last column compares the "
                 "planner's whole device total (model states, buffers, activations) with the measured "
                 "growth of peak RSS, which also holds allocator and communication overheads:", "",
                 *estimate_section(dirs), ""]
    if a.step:
        st = _load(a.step, "step")
        shutil.copy(os.path.join(a.step, "step.csv"), os.path.join(assets, "step.csv"))
        page += ["## Step time and memory against peers (`zeroshard bench step`)", "",
                 f"```\nzeroshard bench step --model {_model_arg(st)} --world-size {st['world_size']} "
                 f"--rounds {st['rounds']} --steps {st['steps']} --out bench-results/step\n```", "",
                 step.report_markdown(st), "",
                 "Ratios within one run are what this measures; absolute seconds move with the "
                 "machine's load (2 cores here, shared by both ranks and their gloo threads).", ""]
    if a.checkpoint:
        page += checkpoint_section(a.checkpoint)
    if a.aio or a.bigger_than_memory:
        page += offload_section(a.aio, a.bigger_than_memory)
    page += ["## On a GPU", "",
             "`bash benchmarks/gpu_check.sh OUT` measures the same memory table with "
             "`torch.cuda.max_memory_allocated` per rank (bf16 and fp32, world sizes 1, 2, 4 on the "
             "visible GPUs) and prints the planner's table for that GPU.", ""]
    with open(os.path.join(a.out, "results.md"), "w") as f:
        f.write("\n".join(page))
    print(os.path.join(a.out, "results.md"))
    return 0


def _model_arg(result: dict) -> str:
    """The preset name of a TinyGPT run (the JSON keeps the model's description)."""
    from zeroshard.bench.models import PRESETS

    for name, c in PRESETS.items():
        if result["model"] == f"TinyGPT d={c.d_model} L={c.n_layers}":
            return name
    return result["model"]


if __name__ == "__main__":
    sys.exit(main())
