"""Checkpoint save/load throughput against peers and the raw disk, and the async-save stall.

    python benchmarks/bench_checkpoint.py --size-gb 2 --dir /tmp/ckbench

One process, one state of ``--size-gb`` (fp32 parameters + AdamW exp_avg/exp_avg_sq), saved
and loaded by: zeroshard (checksums included), torch.save/torch.load, safetensors
save_file/load_file, torch.distributed.checkpoint (FileSystemWriter, 2 threads); every save
is fsynced, every load starts from a cold page cache (drop_caches as root, else
posix_fadvise DONTNEED). The raw disk is measured with dd and O_DIRECT on the same
directory. All figures of one run are printed as GB/s and as ratios, so they compare on
the same machine state. Writes a JSON summary with ``--json PATH``.
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
    for run in opt.runs:
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gb", type=float, default=2.0)
    ap.add_argument("--dir", default=None, help="where to write (default: a new directory under /tmp)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", default=None)
    ap.add_argument("--export-shard-mb", type=int, default=0,
                    help="also export_hf the state in shards of this size and report peak RSS")
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    args.dir = args.dir or tempfile.mkdtemp(prefix="zeroshard-ckbench-", dir="/tmp")
    os.makedirs(args.dir, exist_ok=True)
    model, opt = build(args.size_gb)
    state = flat_state(model, opt)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    raw_w, raw_r = dd_speed(args.dir, nbytes)
    res: dict[str, float] = {"bytes": nbytes, "raw_write": raw_w, "raw_read": raw_r}
    d = args.dir

    # -- zeroshard --------------------------------------------------------------------------
    zroot = os.path.join(d, "zs")
    step = iter(range(1, 1000))
    res["zs_save"] = nbytes / timed(lambda: zeroshard.save_checkpoint(zroot, next(step), model=model, optimizer=opt,
                                                                      keep_last=1), args.repeats)
    m2, o2 = build(args.size_gb, seed=1)
    res["zs_load"] = nbytes / timed(lambda: zeroshard.load_checkpoint(zroot, model=m2, optimizer=o2),
                                    args.repeats, lambda: drop_cache(zroot))
    if not all(torch.equal(a, b) for a, b in zip(model, m2)):
        raise RuntimeError("zeroshard load is not exact")
    del m2, o2

    # -- async stall: time save_checkpoint blocks + the extra wait of the next optimizer step
    sync_time = nbytes / res["zs_save"]
    t0 = time.perf_counter()
    handle = zeroshard.save_checkpoint(zroot, next(step), model=model, optimizer=opt, async_save=True, keep_last=1)
    call = time.perf_counter() - t0
    busy_until = time.perf_counter() + max(1.0, sync_time)  # a training step's forward/backward
    x = torch.randn(512, 512)
    while time.perf_counter() < busy_until:
        x = torch.tanh(x @ x) * 0.5
    t0 = time.perf_counter()
    from zeroshard.checkpoint.saver import _SAVER
    _SAVER._staged.wait()  # what optimizer.step() waits for before it may modify the tensors
    step_wait = time.perf_counter() - t0
    handle.wait()
    res["async_call_s"], res["async_step_wait_s"], res["sync_save_s"] = call, step_wait, sync_time
    res["async_stall_fraction"] = (call + step_wait) / sync_time

    # -- peers ------------------------------------------------------------------------------
    ts = os.path.join(d, "torch.pt")

    def torch_save() -> None:
        torch.save(state, ts)
        fsync_tree(ts)
    res["torch_save"] = nbytes / timed(torch_save, args.repeats)
    res["torch_load"] = nbytes / timed(lambda: copy_into(state, torch.load(ts, weights_only=True)), args.repeats,
                                       lambda: drop_cache(ts))
    os.unlink(ts)
    from safetensors.torch import load_file, save_file
    st = os.path.join(d, "st.safetensors")

    def st_save() -> None:
        save_file({k: v.contiguous() for k, v in state.items()}, st)
        fsync_tree(st)
    res["safetensors_save"] = nbytes / timed(st_save, args.repeats)
    res["safetensors_load"] = nbytes / timed(lambda: copy_into(state, load_file(st)), args.repeats,
                                             lambda: drop_cache(st))
    os.unlink(st)
    import torch.distributed.checkpoint as dcp
    dd = os.path.join(d, "dcp")

    def dcp_save() -> None:
        shutil.rmtree(dd, ignore_errors=True)
        dcp.save(state, storage_writer=dcp.FileSystemWriter(dd, thread_count=2, sync_files=True))
    res["dcp_save"] = nbytes / timed(dcp_save, args.repeats)
    res["dcp_load"] = nbytes / timed(lambda: dcp.load(state, storage_reader=dcp.FileSystemReader(dd)),
                                     args.repeats, lambda: drop_cache(dd))  # DCP loads in place
    t0 = time.perf_counter()
    fut = dcp.async_save(state, storage_writer=dcp.FileSystemWriter(dd + "-async", thread_count=2, sync_files=True))
    res["dcp_async_call_s"] = time.perf_counter() - t0
    fut.result()
    res["dcp_async_fraction"] = res["dcp_async_call_s"] / (nbytes / res["dcp_save"])
    if args.export_shard_mb:
        res.update(export_rss(zroot, os.path.join(d, "hf"), args.export_shard_mb))
    shutil.rmtree(args.dir, ignore_errors=True)
    report(res)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


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


def report(r: dict) -> None:
    print(f"state: {r['bytes'] / GB:.2f} GB (fp32 params + AdamW moments), {os.cpu_count()} cores")
    print(f"raw disk (dd O_DIRECT): write {r['raw_write'] / GB:.2f} GB/s, read {r['raw_read'] / GB:.2f} GB/s")
    peers_save = {k: r[k] for k in ("torch_save", "safetensors_save", "dcp_save")}
    peers_load = {k: r[k] for k in ("torch_load", "safetensors_load", "dcp_load")}
    for what, mine, raw, peers in (("save", r["zs_save"], r["raw_write"], peers_save),
                                   ("load", r["zs_load"], r["raw_read"], peers_load)):
        best = max(peers.values())
        print(f"zeroshard {what}: {mine / GB:.2f} GB/s = {mine / raw:.0%} of raw, {mine / best:.2f}x the best peer")
        for k, v in peers.items():
            print(f"  {k:18s} {v / GB:.2f} GB/s ({v / raw:.0%} of raw)")
    print(f"async save: blocks {r['async_call_s'] * 1e3:.0f} ms + next step waits {r['async_step_wait_s'] * 1e3:.0f} ms "
          f"= {r['async_stall_fraction']:.1%} of the synchronous save ({r['sync_save_s']:.2f} s); "
          f"DCP async_save blocks {r['dcp_async_call_s'] * 1e3:.0f} ms = {r['dcp_async_fraction']:.1%} of its save")
    if "export_peak_growth" in r:
        print(f"export_hf: {r['export_model_bytes'] / 2**20:.0f} MiB of weights in {r['export_shard_bytes'] / 2**20:.0f} "
              f"MiB shards: peak RSS grew {r['export_peak_growth'] / 2**20:.0f} MiB over the post-import baseline "
              f"(absolute peak {r['export_peak_rss'] / 2**20:.0f} MiB), {r['export_s']:.1f} s")


if __name__ == "__main__":
    sys.exit(main())
