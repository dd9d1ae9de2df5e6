"""Checkpoint save/load throughput against peers and the raw disk, and the async-save stall.

    python benchmarks/bench_checkpoint.py --size-gb 2 --dir /tmp/ckbench

One process, one state of ``--size-gb`` (fp32 parameters + AdamW exp_avg/exp_avg_sq), saved
and loaded by: zeroshard (checksums included), torch.save/torch.load, safetensors
save_file/load_file, torch.distributed.checkpoint (FileSystemWriter, 2 threads); every save
is fsynced, every load starts from a cold page cache (drop_caches as root, else
posix_fadvise DONTNEED). The raw disk is measured with dd and O_DIRECT on the same
directory (the headline ratios: one request of 64 MiB at a time) and, as a second
reference, as bench_bigger_than_memory does (fio or zeroshard's AsyncIO, O_DIRECT 8 MiB x
queue depth 16: what the disk gives many requests in flight). All figures of one run are
printed as GB/s and as ratios, so they compare on the same machine state; the median of
each round's own zeroshard/dd ratio is printed too, and how long the deletion of
the step each zeroshard save rotates out (keep_last=1; a background thread) went on after it. After the rounds, one more cold load
each way (optimizer moments adopted from the verified buffer, or copied as before) gives
the peak and the remaining RSS growth of a load. Writes a JSON summary with ``--json PATH``.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable

import torch

import zeroshard

GB = 1e9


def drop_cache(path: str) -> None:
    """Evicts ``path``'s pages so the next read comes from the disk."""
    try:
        subprocess.run(["sync"], check=True)
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return
    except OSError:
        pass
    for dirpath, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)


def fsync_tree(path: str) -> None:
    paths = [path] if os.path.isfile(path) else [os.path.join(d, n) for d, _, fs in os.walk(path) for n in fs]
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)


def dd_speed(path: str, nbytes: int) -> tuple[float, float]:
    """Sequential O_DIRECT write and read speed of ``path``'s disk, in bytes/s."""
    target = os.path.join(path, "dd.bin")
    count = max(1, nbytes // (64 << 20))

    def run(args: list[str]) -> float:
        out = subprocess.run(["dd", "bs=64M", f"count={count}", *args], capture_output=True, text=True).stderr
        m = re.search(r"(\d+) bytes .* copied, ([\d.]+) s", out)
        return int(m.group(1)) / float(m.group(2))
    write = run(["if=/dev/zero", f"of={target}", "oflag=direct", "conv=fsync"])
    drop_cache(target)
    read = run([f"if={target}", "of=/dev/null", "iflag=direct"])
    os.unlink(target)
    return write, read


def build(size_gb: float, seed: int = 0) -> tuple[torch.nn.Module, zeroshard.ZeroOptimizer]:
    numel = int(size_gb * GB / 12)  # fp32 parameter + two fp32 Adam moments
    torch.manual_seed(seed)
    model = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(numel // 8)) for _ in range(8)])
    opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, stage=0, lr=1e-3, bucket_size_mb=512)
    for p in model:
        p.grad = None
    sum(p.sum() for p in model).backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def flat_state(model: torch.nn.Module, opt: zeroshard.ZeroOptimizer) -> dict[str, torch.Tensor]:
    """The same bytes as the checkpoint, as one dict of tensors, for the peers."""
    out = {f"param.{i}": p.detach() for i, p in enumerate(model)}
    for run in opt.engine.joined().runs:
        for k, v in opt.inner.state[run.tensor].items():
            if v.dim() > 0:
                for piece in run.unit.layout.pieces_in(run.a, run.b):
                    a = piece.unit_offset - run.a
                    out[f"{k}.{piece.segment.name}"] = v[a:a + piece.numel]
    return out


def copy_into(targets: dict[str, torch.Tensor], loaded: dict[str, torch.Tensor]) -> None:
    """A load ends with the bytes in the training tensors (as load_checkpoint's does): for the
    peers that return new tensors (safetensors maps the file lazily) that is this copy."""
    for k, t in targets.items():
        t.copy_(loaded[k])


def timed(fn: Callable[[], object], repeats: int, before: Callable[[], None] = lambda: None) -> float:
    times = []
    for _ in range(repeats):
        before()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


class Contenders:
    """Every save and load, as (name, run, prepare) callables over one state, so a round can
    run each once; the state lives in one copy and every save writes the same bytes."""

    def __init__(self, d: str, model: torch.nn.Module, opt: zeroshard.ZeroOptimizer,
                 state: dict[str, torch.Tensor]) -> None:
        self.d, self.model, self.opt, self.state = d, model, opt, state
        self.zroot = os.path.join(d, "zs")
        self.step = 0
        self.paths = {"torch": os.path.join(d, "torch.pt"), "st": os.path.join(d, "st.safetensors"),
                      "dcp": os.path.join(d, "dcp")}

    def zs_save(self) -> None:
        self.step += 1
        zeroshard.save_checkpoint(self.zroot, self.step, model=self.model, optimizer=self.opt, keep_last=1)

    def zs_load(self) -> None:
        # In place into the live model and optimizer: the bytes land where training reads them.
        zeroshard.load_checkpoint(self.zroot, model=self.model, optimizer=self.opt)

    def torch_save(self) -> None:
        torch.save(self.state, self.paths["torch"])
        fsync_tree(self.paths["torch"])

    def torch_load(self) -> None:
        copy_into(self.state, torch.load(self.paths["torch"], weights_only=True))

    def safetensors_save(self) -> None:
        from safetensors.torch import save_file
        save_file({k: v.contiguous() for k, v in self.state.items()}, self.paths["st"])
        fsync_tree(self.paths["st"])

    def safetensors_load(self) -> None:
        from safetensors.torch import load_file
        copy_into(self.state, load_file(self.paths["st"]))

    def dcp_save(self) -> None:
        import torch.distributed.checkpoint as dcp
        shutil.rmtree(self.paths["dcp"], ignore_errors=True)
        dcp.save(self.state, storage_writer=dcp.FileSystemWriter(self.paths["dcp"], thread_count=2, sync_files=True))

    def dcp_load(self) -> None:
        import torch.distributed.checkpoint as dcp
        dcp.load(self.state, storage_reader=dcp.FileSystemReader(self.paths["dcp"]))  # in place


def async_stall(c: Contenders, sync_time: float) -> dict[str, float]:
    """How long an async save holds training up: the call itself plus what the next
    optimizer step waits for staging, after a forward/backward-sized stretch of compute."""
    from zeroshard.checkpoint.saver import _SAVER
    c.step += 1
    t0 = time.perf_counter()
    handle = zeroshard.save_checkpoint(c.zroot, c.step, model=c.model, optimizer=c.opt, async_save=True,
                                       keep_last=1)
    call = time.perf_counter() - t0
    busy_until = time.perf_counter() + max(1.0, sync_time)
    x = torch.randn(512, 512)
    while time.perf_counter() < busy_until:
        x = torch.tanh(x @ x) * 0.5
    t0 = time.perf_counter()
    _SAVER._staged.wait()  # what optimizer.step() waits for before it may modify the tensors
    step_wait = time.perf_counter() - t0
    handle.wait()
    import torch.distributed.checkpoint as dcp
    t0 = time.perf_counter()
    fut = dcp.async_save(c.state, storage_writer=dcp.FileSystemWriter(c.paths["dcp"] + "-async", thread_count=2,
                                                                       sync_files=True))
    dcp_call = time.perf_counter() - t0
    t0 = time.perf_counter()
    fut.result()
    return {"async_call_s": call, "async_step_wait_s": step_wait, "sync_save_s": sync_time,
            "async_stall_fraction": (call + step_wait) / sync_time, "dcp_async_call_s": dcp_call,
            "dcp_async_total_s": dcp_call + time.perf_counter() - t0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gb", type=float, default=2.0)
    ap.add_argument("--dir", default=None, help="where to write (default: a new directory under /tmp)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="each round runs every contender once; the best round of each is reported")
    ap.add_argument("--json", default=None)
    ap.add_argument("--export-shard-mb", type=int, default=0,
                    help="also export_hf the state in shards of this size and report peak RSS")
    ap.add_argument("--export-model-gb", type=float, default=0,
                    help="only measure export_hf of a parameters-only model this large (with --export-shard-mb)")
    args = ap.parse_args()
    if args.export_model_gb:
        return export_only(args.export_model_gb, args.export_shard_mb or 256)
    torch.set_num_threads(os.cpu_count() or 1)
    args.dir = args.dir or tempfile.mkdtemp(prefix="zeroshard-ckbench-", dir="/tmp")
    os.makedirs(args.dir, exist_ok=True)
    model, opt = build(args.size_gb)
    expect = [p.detach().clone() for p in model]
    state = flat_state(model, opt)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    c = Contenders(args.dir, model, opt, state)
    names = ["zs", "torch", "safetensors", "dcp"]
    best: dict[str, float] = {}
    paired: dict[str, list[float]] = {"save": [], "load": []}
    loads: list[float] = []
    cleanup: list[float] = []
    for _ in range(args.rounds):
        # Interleaved, so every contender meets the same disk and CPU weather; the raw disk
        # is re-measured each round too. Loads start from a cold page cache.
        w, r = dd_speed(args.dir, nbytes)
        best["raw_write"], best["raw_read"] = max(best.get("raw_write", 0), w), max(best.get("raw_read", 0), r)
        deep = queue_depth_speed(args.dir, nbytes)
        best["raw_write_qd16"] = max(best.get("raw_write_qd16", 0), deep["write"])
        best["raw_read_qd16"] = max(best.get("raw_read_qd16", 0), deep["read"])
        best["raw_qd16_source"] = deep["source"]
        loads.append(os.getloadavg()[0])
        for name in names:
            for op in ("save", "load"):
                key = f"{name}_{op}"
                if op == "load":
                    drop_cache(args.dir)
                    with torch.no_grad():
                        for p in model:
                            p.zero_()
                speed = nbytes / timed(getattr(c, key), 1)
                best[key] = max(best.get(key, 0.0), speed)
                if name == "zs":
                    paired[op].append(speed / (w if op == "save" else r))
                if key == "zs_save":  # the rotated-out step, deleted in the background: timed apart
                    t0 = time.perf_counter()
                    zeroshard.wait_checkpoint()
                    cleanup.append(time.perf_counter() - t0)
        if not all(torch.equal(a, b) for a, b in zip(model, expect)):
            raise RuntimeError("a load did not restore the state exactly")
    res: dict[str, float] = {"bytes": nbytes, **best, **async_stall(c, nbytes / best["zs_save"])}
    res["dcp_async_fraction"] = res["dcp_async_call_s"] / (nbytes / best["dcp_save"])
    res["zs_save_round_ratios"], res["zs_load_round_ratios"] = paired["save"], paired["load"]
    res["load_average_each_round"] = loads
    res["zs_save_cleanup_s_each_round"] = cleanup
    res["load_average_1_5_15_at_end"] = list(os.getloadavg())
    res.update(load_memory(c))
    if args.export_shard_mb:
        res.update(export_rss(c.zroot, os.path.join(args.dir, "hf"), args.export_shard_mb))
    shutil.rmtree(args.dir, ignore_errors=True)
    report(res)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


def queue_depth_speed(directory: str, nbytes: int) -> dict:
    """The second raw reference: bench_bigger_than_memory's (O_DIRECT 8 MiB x qd16), in B/s."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_bigger_than_memory import fio_speed
    out = fio_speed(directory, nbytes / 2**30)
    return {"write": out["write"] * GB, "read": out["read"] * GB, "source": out["source"]}


def _status(key: str) -> int:
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(key))


def load_memory(c: Contenders) -> dict[str, float]:
    """Peak RSS growth (VmHWM over the RSS before) and what remains a second later, of one
    cold load each way: moments adopted as views of the verified buffer (as loads run), and
    copied into the live tensors (adoption off: the load before Note [adopting verified
    state] in zeroshard/checkpoint/load.py)."""
    from zeroshard.checkpoint import load as load_mod
    adopter = load_mod._adopter
    out = {}
    try:
        for mode in ("adopt", "copy"):
            if mode == "copy":
                load_mod._adopter = lambda *a: None
            drop_cache(c.d)
            time.sleep(1.0)  # the previous load's buffers are unmapped
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5\n")  # VmHWM := VmRSS
            base = _status("VmRSS:")
            t0 = time.perf_counter()
            c.zs_load()
            out[f"zs_load_{mode}_s"] = time.perf_counter() - t0
            out[f"zs_load_{mode}_peak_growth"] = _status("VmHWM:") - base
            time.sleep(1.0)
            out[f"zs_load_{mode}_after_growth"] = _status("VmRSS:") - base
    except OSError:  # no clear_refs (not Linux, or not allowed): no memory figures
        pass
    finally:
        load_mod._adopter = adopter
    return out


_RSS_CHILD = """
import sys, time, psutil, zeroshard
base = psutil.Process().memory_info().rss
t0 = time.perf_counter()
zeroshard.export_hf(sys.argv[1], sys.argv[2], max_shard_size=int(sys.argv[3]))
took = time.perf_counter() - t0
hwm = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM"))
print(base, hwm, took)
"""


def export_rss(root: str, out: str, shard_mb: int) -> dict[str, float]:
    """export_hf in a fresh process: its peak RSS (VmHWM) above the post-import baseline."""
    proc = subprocess.run([sys.executable, "-c", _RSS_CHILD, root, out, str(shard_mb << 20)],
                          capture_output=True, text=True, check=True)
    base, hwm, took = (float(x) for x in proc.stdout.split())
    size = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out) if f.endswith(".safetensors"))
    shutil.rmtree(out)
    return {"export_model_bytes": size, "export_shard_bytes": shard_mb << 20, "export_peak_growth": hwm - base,
            "export_peak_rss": hwm, "export_s": took}


def export_only(model_gb: float, shard_mb: int) -> None:
    """export_hf's peak RSS for a model many times ``shard_mb``: 256 MiB parameters, no state."""
    d = tempfile.mkdtemp(prefix="zeroshard-export-", dir="/tmp")
    n = max(1, int(model_gb * 2**30) // (256 << 20))
    model = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(64 << 20)) for _ in range(n)])
    opt = zeroshard.ZeroOptimizer(model, torch.optim.SGD, stage=0, lr=0.1)
    zeroshard.save_checkpoint(os.path.join(d, "ck"), 1, model=model, optimizer=opt)
    del model, opt
    r = export_rss(os.path.join(d, "ck"), os.path.join(d, "hf"), shard_mb)
    shutil.rmtree(d)
    print(f"export_hf: {r['export_model_bytes'] / 2**20:.0f} MiB model, max_shard_size {shard_mb} MiB: peak RSS grew "
          f"{r['export_peak_growth'] / 2**20:.0f} MiB over the post-import baseline (absolute peak "
          f"{r['export_peak_rss'] / 2**20:.0f} MiB), {r['export_s']:.1f} s")


def report(r: dict) -> None:
    print(f"state: {r['bytes'] / GB:.2f} GB (fp32 params + AdamW moments), {os.cpu_count()} cores, "
          f"load average {os.getloadavg()[0]:.1f} (rounds: "
          f"{', '.join(f'{x:.1f}' for x in r.get('load_average_each_round', []))}); best round of each")
    print(f"raw disk (dd O_DIRECT): write {r['raw_write'] / GB:.2f} GB/s, read {r['raw_read'] / GB:.2f} GB/s")
    if "raw_read_qd16" in r:
        print(f"raw disk ({r['raw_qd16_source']}): write {r['raw_write_qd16'] / GB:.2f} GB/s, "
              f"read {r['raw_read_qd16'] / GB:.2f} GB/s")
    for what, raw in (("save", r["raw_write"]), ("load", r["raw_read"])):
        mine = r[f"zs_{what}"]
        peers = {f"{k}_{what}": r[f"{k}_{what}"] for k in ("torch", "safetensors", "dcp")}
        best = max(peers.values())
        deep = r.get(f"raw_{'write' if what == 'save' else 'read'}_qd16")
        print(f"zeroshard {what}: {mine / GB:.2f} GB/s = {mine / raw:.0%} of raw, {mine / best:.2f}x the best peer"
              + (f"; {mine / deep:.0%} of the qd16 raw {deep / GB:.2f} GB/s" if deep else "")
              + (f"; median of the rounds' own ratios {statistics.median(r[f'zs_{what}_round_ratios']):.0%}"
                 if r.get(f"zs_{what}_round_ratios") else ""))
        for k, v in peers.items():
            print(f"  {k:18s} {v / GB:.2f} GB/s ({v / raw:.0%} of raw)")
    if r.get("zs_save_cleanup_s_each_round"):
        print(f"after each zeroshard save, deleting the rotated-out step went on for "
              f"{', '.join(f'{x:.2f}' for x in r['zs_save_cleanup_s_each_round'])} s in the background")
    print(f"async save: blocks {r['async_call_s'] * 1e3:.0f} ms + next step waits {r['async_step_wait_s'] * 1e3:.0f} ms "
          f"= {r['async_stall_fraction']:.1%} of the synchronous save ({r['sync_save_s']:.2f} s); "
          f"DCP async_save blocks {r['dcp_async_call_s'] * 1e3:.0f} ms = {r['dcp_async_fraction']:.1%} of its save")
    if "zs_load_adopt_peak_growth" in r:
        print("load memory (RSS growth, GiB): " + "; ".join(
            f"{m} {'moments as views of the verified buffer' if m == 'adopt' else 'copied'}: peak "
            f"{r[f'zs_load_{m}_peak_growth'] / 2**30:.2f}, a second after {r[f'zs_load_{m}_after_growth'] / 2**30:.2f}"
            f" ({r[f'zs_load_{m}_s']:.2f} s)" for m in ("adopt", "copy")))
    if "export_peak_growth" in r:
        print(f"export_hf: {r['export_model_bytes'] / 2**20:.0f} MiB of weights in {r['export_shard_bytes'] / 2**20:.0f} "
              f"MiB shards: peak RSS grew {r['export_peak_growth'] / 2**20:.0f} MiB over the post-import baseline "
              f"(absolute peak {r['export_peak_rss'] / 2**20:.0f} MiB), {r['export_s']:.1f} s")


if __name__ == "__main__":
    sys.exit(main())
