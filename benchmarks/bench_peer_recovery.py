"""The memory tier's figures (issue 45), 2 gloo ranks on loopback, one session:

- per-step overhead of ``memory_checkpoint`` at ``--every`` (default ``auto``: the tier commits
  every step while that costs <= 5% of a step, else every K-th, Note [commit pacing]; the copy
  into the mapped slot, the crc, stamps and replica swap on the tier's thread; the next step
  waits for the copy only) on the step time: the summed time of alternating blocks of steps
  with and without it (sums, not medians of blocks: a block of K-step cycles may hold 0 or 1
  commit), after a warm-up with the tier that lets "auto" measure and choose K (goal <= 5%);
  the K chosen and the cost the tier measured (``MemoryTier.report()``, rank 0);
- disk bytes a recovery opens (files under the disk checkpoint, counted by an audit hook);
- the load part of recovery: ``load_checkpoint`` from the memory tiers vs from the disk
  checkpoint of the same step (both just written: the disk's pages are in the page cache, the
  best case for the disk), same model, same processes; and the disk bytes each read. The
  restart itself (torchrun starting workers, the process group) is the same for both and
  left out.

    python benchmarks/bench_peer_recovery.py [--hidden 2048 --layers 4 --blocks 5 --steps 16 --every auto]
        [--world 4 --parity 4]   (XOR parity over groups of 4 instead of a replica: parity_over_shard_bytes)

- ``--recovery N``: the whole recovery, kill -> next completed step, under torchrun
  (``--max-restarts``, one launcher of ``--world`` workers), N rounds of three paths, each a
  run that trains, commits and saves step 3, then SIGKILLs rank 1: "memory" (the restarted
  workers load from the memory tier), "disk-warm" (a run without the tier: they resume from
  the disk checkpoint of the same step, its pages still cached) and "disk-cold" (the same, the
  checkpoint's files dropped from the page cache before the kill with posix_fadvise DONTNEED:
  the node that died took its page cache with it). Each is broken into restart (kill -> the
  new workers' process group: torchrun noticing the death and stopping the others, starting
  the workers, imports, rendezvous), build (model and optimizer), restore (``load_checkpoint``)
  and first step; medians over the rounds, and memory / disk for both disks.

    python benchmarks/bench_peer_recovery.py --recovery 3 [--hidden 2048 --layers 4 --world 2]

- ``--recovery N --in-process``: the same kill, N rounds of "in-process" (``zeroshard.InProcessRecovery``,
  Note [in-process recovery]: this script hosts the store and starts the workers; the survivors
  re-form the group at ``--world`` - 1, rebuild and recover from the memory tiers in their
  processes), "memory" and "disk-warm" (the torchrun paths above); medians of kill -> next
  completed step and the ratios in-process / each torchrun path. The in-process breakdown:
  detect (kill -> a survivor's step fails), agree, group, build, restore, first step.

    python benchmarks/bench_peer_recovery.py --recovery 3 --in-process --world 3 [--hidden 2048 --layers 4]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

_STARTED = time.time()  # (a restarted worker's first moment, before its imports: the restart's breakdown)

import torch
import torch.distributed as dist

import zeroshard
from zeroshard.checkpoint.memory_commit import commit_step
from zeroshard.testing.launch import free_port, spawn
from zeroshard.train.finetune import setup_distributed


def _model(hidden: int, layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(hidden, hidden) for _ in range(layers)])


def _step(model: torch.nn.Module, opt: zeroshard.ZeroOptimizer, x: torch.Tensor) -> None:
    opt.backward(model(x).square().mean())
    opt.step()
    opt.zero_grad()


def _rank(rank: int, world: int, a: argparse.Namespace, tier: str, disk: str, out: str) -> None:
    model = _model(a.hidden, a.layers)
    opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-3, stage=2,
                                  redundancy=zeroshard.PeerRedundancy(path=tier, run_id="bench", every=a.every,
                                                                      parity=a.parity or None))
    x = torch.randn(a.batch, a.hidden)
    root = os.path.realpath(disk) + os.sep
    opened: list[str] = []  # files under the disk checkpoint this process opens (Python's audit events)
    sys.addaudithook(lambda event, args: opened.append(os.fsdecode(args[0])) if event == "open" and args and isinstance(
        args[0], (str, bytes)) and os.path.realpath(os.fsdecode(args[0])).startswith(root) else None)
    step, plain, tiered = 0, [], []
    for _ in range(2):  # warm-up
        _step(model, opt, x)
        step += 1
    tier_step = 0  # the steps of the run with the tier: its blocks, back to back (the tier's clock)
    for _ in range(a.warmup):  # with the tier: "auto" probes, measures and agrees on K here
        _step(model, opt, x)
        step += 1
        tier_step += 1
        zeroshard.memory_checkpoint(tier_step, model=model, optimizer=opt)
    opt.engine.memory_tier.wait()
    commits = 0
    for _ in range(a.blocks):
        for with_tier in (False, True):
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(a.steps):
                _step(model, opt, x)
                step += 1
                if with_tier:
                    tier_step += 1
                    commits += zeroshard.memory_checkpoint(tier_step, model=model, optimizer=opt)
            if with_tier:
                opt.engine.memory_tier.wait()  # (the block pays for its last background write too)
                if opt.engine.memory_tier.pacer is not None:  # (the block without it is no step of its clock)
                    opt.engine.memory_tier.pacer.pause()
            dist.barrier()
            (tiered if with_tier else plain).append((time.perf_counter() - t0) / a.steps)
    report = opt.engine.memory_tier.report()
    zeroshard.save_checkpoint(disk, step, model=model, optimizer=opt)
    commit_step(step, force=True, model=model, optimizer=opt)  # (this step whatever K is, as a handoff's)
    opt.engine.memory_tier.wait()
    state_bytes = opt.memory_report().master_weights + opt.memory_report().optimizer_states + \
        opt.memory_report().parameters
    tier_bytes = opt.memory_report().memory_tier
    opt.close()
    loads = {}
    for source in ("memory", "disk", "memory", "disk"):
        m = _model(a.hidden, a.layers)
        o = zeroshard.ZeroOptimizer(m, torch.optim.AdamW, lr=1e-3, stage=2, redundancy=zeroshard.PeerRedundancy(
            path=tier if source == "memory" else tier + "-none", run_id="bench", parity=a.parity or None))
        dist.barrier()
        opened.clear()
        t0 = time.perf_counter()
        info = zeroshard.load_checkpoint(disk, model=m, optimizer=o)
        _step(m, o, x)  # the next completed step
        dist.barrier()
        read = sum(os.path.getsize(p) for p in set(opened) if os.path.isfile(p))
        loads.setdefault(source, []).append((time.perf_counter() - t0, read, info.get("source")))
        o.close()
    if rank == 0:
        figures = {
            "step_s_plain": statistics.median(plain), "step_s_with_tier": statistics.median(tiered),
            "tier_overhead": sum(tiered) / sum(plain) - 1,
            "tier_overhead_median_blocks": statistics.median(tiered) / statistics.median(plain) - 1,
            "every": report["every"], "commits_in_measured_steps": commits,
            "measured_steps": a.blocks * a.steps, "tier_commit_cost": report["commit_cost"],
            "tier_step_cost": report["step_cost"],
            "load_and_step_s_memory": min(t for t, _, _ in loads["memory"]),
            "load_and_step_s_disk": min(t for t, _, _ in loads["disk"]),
            "disk_bytes_opened_memory": loads["memory"][0][1], "disk_bytes_opened_disk": loads["disk"][0][1],
            "sources": [s for _, _, s in loads["memory"]],
            "owned_state_bytes_rank0": state_bytes, "memory_report_tier_bytes_rank0": tier_bytes,
            "params": sum(p.numel() for p in _model(a.hidden, a.layers).parameters()),
            "world": world, "parity": a.parity or None,
            # (both slots of each: the own slots' data and the parity slots' data, Note [parity memory tier])
            "parity_over_shard_bytes": report["parity_bytes"] / max(report["shard_bytes"], 1),
        }
        figures["memory_vs_disk"] = figures["load_and_step_s_memory"] / figures["load_and_step_s_disk"]
        with open(out, "w") as f:
            json.dump(figures, f)


def _drop_page_cache(root: str) -> None:
    """Every file under ``root`` out of the page cache (written back first: only clean pages go)."""
    os.sync()
    for d, _, files in os.walk(root):
        for f in files:
            fd = os.open(os.path.join(d, f), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _worker(a: argparse.Namespace) -> None:
    """One torchrun worker of a ``--recovery`` run: the first attempt trains to step 3, commits,
    saves and dies; the restarted one recovers and completes step 4, timing each part."""
    imported = time.time()
    # (each torchrun attempt in its own key space: a plain init_process_group of a restarted
    # attempt read the dead workers' gloo addresses from torchrun's store and waited to connect
    # to them for the group's whole timeout, the "hang" of the earlier runs)
    setup_distributed(600.0)
    rank = dist.get_rank()
    dist.barrier()
    pg = time.time()
    model = _model(a.hidden, a.layers)
    tier = zeroshard.PeerRedundancy(path=a.tier, run_id="recovery", every=1) if a.path == "memory" else None
    opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-3, stage=2, redundancy=tier)
    x = torch.randn(a.batch, a.hidden)
    built = time.time()
    if not os.path.exists(a.out + ".kill"):  # (not the restart count: an attempt that failed to connect trains again)
        for step in range(1, 4):
            _step(model, opt, x)
            if tier is not None:
                zeroshard.memory_checkpoint(step, model=model, optimizer=opt)
        zeroshard.save_checkpoint(a.disk, 3, model=model, optimizer=opt)
        if tier is not None:
            opt.engine.memory_tier.wait()
        dist.barrier()
        if a.path == "disk-cold":
            _drop_page_cache(a.disk)
        dist.barrier()
        if rank == 1:
            with open(a.out + ".kill", "w") as f:
                f.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # (no agreed save with a dead rank: torchrun stops this one)
        time.sleep(3600)
    info = zeroshard.load_checkpoint(a.disk, model=model, optimizer=opt)
    dist.barrier()
    restored = time.time()
    _step(model, opt, x)
    dist.barrier()
    stepped = time.time()
    if rank == 0:
        with open(a.out + ".kill") as f:
            killed = float(f.read())
        with open(a.out, "w") as f:
            json.dump({"path": a.path, "source": info.get("source"), "step": info.get("step"),
                       "recovery_s": stepped - killed, "restart_s": pg - killed,
                       "restart_to_process_s": _STARTED - killed, "imports_s": imported - _STARTED,
                       "rendezvous_s": pg - imported, "build_s": built - pg, "restore_s": restored - built,
                       "first_step_s": stepped - restored}, f)
    opt.close()
    dist.destroy_process_group()


def _in_process_worker(a: argparse.Namespace) -> None:
    """One worker of an "in-process" run: trains to step 3, commits and saves; member 1 dies
    after the barrier of step 3; the survivors' step 4 fails, they recover in their processes and
    complete it, timing each part."""
    model_args = (a.hidden, a.layers)

    def build(rank: int, world: int) -> zeroshard.Trainee:
        model = _model(*model_args)
        return zeroshard.Trainee(model, zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-3, stage=2, redundancy=
                                 zeroshard.PeerRedundancy(path=a.tier, run_id="recovery", every=1)))
    x = torch.randn(a.batch, a.hidden)
    rec = zeroshard.InProcessRecovery(zeroshard.InProcessOptions("127.0.0.1", int(a.port), timeout_s=120.0),
                                      rank=int(a.member), world_size=a.world, build=build, root=a.disk)
    rec.start()

    def step_fn(t: zeroshard.Trainee, step: int) -> None:
        _step(t.model, t.optimizer, x)
        if step + 1 == 3:
            zeroshard.save_checkpoint(a.disk, 3, model=t.model, optimizer=t.optimizer)
    while rec.step < 3:
        rec.run(step_fn)
    rec.objects.optimizer.engine.memory_tier.wait()
    dist.barrier()
    if rec.member == 1:
        with open(a.out + ".kill", "w") as f:
            f.write(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    while rec.step < 4:
        rec.run(step_fn)
    dist.barrier()
    stepped = time.time()
    if rec.rank == 0:
        with open(a.out + ".kill") as f:
            killed = float(f.read())
        r = rec.recoveries[0]
        with open(a.out, "w") as f:
            json.dump({"path": "in-process", "source": r["source"], "step": r["step"], "recovery_s": stepped - killed,
                       "detect_s": r["at"] - killed, "agree_s": r["agree_s"], "group_s": r["group_s"],
                       "build_s": r["build_s"], "restore_s": r["restore_s"],
                       "first_step_s": stepped - r["at"] - r["seconds"], "world_after": rec.world_size}, f)
    rec.close()


def _in_process_run(a: argparse.Namespace, tier: str, disk: str, out: str) -> None:
    """Hosts the store (as torchrun's agent would) and starts ``--world`` workers."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--in-process-worker", "--member", str(m),
                               "--port", str(store.port), "--tier", tier, "--disk", disk, "--out", out,
                               "--world", str(a.world), "--hidden", str(a.hidden), "--layers", str(a.layers),
                               "--batch", str(a.batch)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=dict(os.environ, OMP_NUM_THREADS="1"))  # (as torchrun sets it)
             for m in range(a.world)]
    try:
        logs = [p.communicate(timeout=900)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    codes = [p.returncode for p in procs]
    if codes != [(-9 if m == 1 else 0) for m in range(a.world)]:
        raise RuntimeError(f"in-process run exited {codes}:\n" + "\n".join(log[-3000:] for log in logs))


def _recovery(a: argparse.Namespace) -> None:
    work = tempfile.mkdtemp(prefix="zs-peer-recovery-")
    runs: dict[str, list[dict]] = {}
    paths = ("in-process", "memory", "disk-warm") if a.in_process else ("memory", "disk-warm", "disk-cold")
    try:
        for i in range(a.recovery):
            for path in paths:
                tier = f"/dev/shm/zeroshard-recovery-{uuid.uuid4().hex[:8]}"
                disk, out = os.path.join(work, f"ckpt-{path}-{i}"), os.path.join(work, f"{path}-{i}.json")
                if path == "in-process":
                    try:
                        _in_process_run(a, tier, disk, out)
                    finally:
                        shutil.rmtree(tier, ignore_errors=True)
                        shutil.rmtree(disk, ignore_errors=True)
                    with open(out) as f:
                        runs.setdefault(path, []).append(json.load(f))
                    continue
                cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={a.world}", "--max-restarts=3",
                       "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--monitor-interval=0.1", os.path.abspath(__file__), "--worker",
                       "--path", path, "--tier", tier, "--disk", disk, "--out", out,
                       "--hidden", str(a.hidden), "--layers", str(a.layers), "--batch", str(a.batch)]
                try:
                    for _ in range(2):  # (a gloo connect refused on a loaded machine: the run again, once)
                        done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                              timeout=900)
                        if done.returncode == 0:
                            break
                    if done.returncode != 0:
                        raise RuntimeError(f"torchrun ({path}, round {i}) exited {done.returncode}:\n{done.stdout[-4000:]}")
                finally:
                    shutil.rmtree(tier, ignore_errors=True)
                    shutil.rmtree(disk, ignore_errors=True)
                with open(out) as f:
                    runs.setdefault(path, []).append(json.load(f))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    parts = ("recovery_s", "restart_s", "restart_to_process_s", "imports_s", "rendezvous_s", "build_s",
             "restore_s", "first_step_s", "detect_s", "agree_s", "group_s")
    figures: dict = {p: {k: statistics.median(r[k] for r in rs) for k in parts if k in rs[0]}
                     for p, rs in runs.items()}
    for p, rs in runs.items():
        figures[p]["sources"] = sorted({str(r["source"]) for r in rs})
        figures[p]["recovery_s_each"] = [round(r["recovery_s"], 3) for r in rs]
    if "in-process" in runs:  # (each round's parts: an outlier says where it waited)
        figures["in-process"]["rounds"] = [{k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()}
                                           for r in runs["in-process"]]
    mem = figures["memory"]
    for disk in [p for p in ("disk-warm", "disk-cold") if p in figures]:
        figures[f"memory_over_{disk}"] = mem["recovery_s"] / figures[disk]["recovery_s"]
        figures[f"memory_over_{disk}_restore"] = mem["restore_s"] / figures[disk]["restore_s"]
    if "in-process" in figures:
        for other in [p for p in ("memory", "disk-warm") if p in figures]:
            figures[f"in_process_over_{other}"] = figures["in-process"]["recovery_s"] / figures[other]["recovery_s"]
    figures["rounds"], figures["world"] = a.recovery, a.world
    figures["load_average"] = os.getloadavg()
    print(json.dumps(figures, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--blocks", type=int, default=5)
    ap.add_argument("--steps", type=int, default=16, help="steps per block")
    ap.add_argument("--warmup", type=int, default=16, help="steps with the tier before the measured blocks")
    ap.add_argument("--every", default="auto", type=lambda v: v if v == "auto" else int(v),
                    help="PeerRedundancy(every=): auto (the default) or K")
    ap.add_argument("--batch", type=int, default=8, help="rows per rank and step (compute per step vs state)")
    ap.add_argument("--world", type=int, default=2, help="gloo ranks")
    ap.add_argument("--parity", type=int, default=0, help="PeerRedundancy(parity=g): XOR parity over groups of g "
                    "ranks instead of a replica (0: a replica)")
    ap.add_argument("--recovery", type=int, default=0, help="rounds of the torchrun recovery comparison (0: none)")
    ap.add_argument("--in-process", action="store_true", help="with --recovery: in-process recovery "
                    "(zeroshard.InProcessRecovery) against the torchrun paths memory and disk-warm")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--in-process-worker", action="store_true", help=argparse.SUPPRESS)
    for internal in ("--path", "--tier", "--disk", "--out", "--member", "--port"):
        ap.add_argument(internal, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        return _worker(a)
    if a.in_process_worker:
        return _in_process_worker(a)
    if a.recovery:
        return _recovery(a)
    tier = f"/dev/shm/zeroshard-bench-{uuid.uuid4().hex[:8]}"
    work = tempfile.mkdtemp(prefix="zs-peer-bench-")
    try:
        out = os.path.join(work, "figures.json")
        spawn(_rank, a.world, a, tier, os.path.join(work, "ckpt"), out)
        with open(out) as f:
            print(json.dumps(json.load(f), indent=1))
    finally:
        shutil.rmtree(tier, ignore_errors=True)
        shutil.rmtree(tier + "-none", ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
