"""Bigger than memory: train a model whose fp32 training state is >= 4x a cgroup memory limit.

    sudo python benchmarks/bench_bigger_than_memory.py --dir /mnt/nvme/zs-big --limit-gib 4

What it does (root and cgroup v1 memory control are needed for the limit; it says so if not):
1. measures the disk's raw sequential write and read speed with fio (O_DIRECT, 8 MiB x qd 16)
   on a file in ``--dir``;
2. in a cgroup limited to ``--limit-gib`` GiB, builds the same model eagerly with plain
   ``torch.optim.AdamW`` and shows it cannot run (killed by the OOM killer);
3. in the same cgroup, a single process builds the model on the meta device, initialises it
   straight into swap files (zeroshard stage 3, ``offload_params="nvme"``,
   ``offload_optimizer="nvme"``), trains ``--steps`` steps, saves a checkpoint (streamed
   from the swap files) and trains ``--resume-steps`` more;
4. a fresh process in the cgroup loads that checkpoint (streamed into new swap files) and
   trains the same ``--resume-steps`` steps: the losses must equal phase 3's bit for bit.

It reports parameters, peak RSS, seconds per step, and the step time as a multiple of the
time the disk needs to read and write the 16 B/parameter state once at the raw speed.

``--auto`` compares placements instead (Note [automatic placement] in
zeroshard/planner/auto_placement.py), each in a fresh process in the cgroup, same model:
- "all NVMe": ``offload_optimizer="nvme", offload_params="nvme"`` under ``--limit-gib``;
- "auto at the limit": ``offload="auto"`` with ``memory_budget`` = the limit less
  ``--headroom-gib`` (page cache: the budget covers the process's resident memory, Note [what
  the budget covers] in zeroshard/planner/auto_placement.py, but the cgroup counts the page cache too);
  its step time is compared with the floor of the bytes it still streams (measured by the swap
  files per step, at the raw disk speed both ways);
- "auto, half the state": a budget holding the planner's minimum plus half of the state, in a
  cgroup of that budget plus the headroom; its step time is compared with the all-NVMe step.
Peak RSS and the cgroup's peak usage are reported for each. Every placement runs with
``overlap_step`` as ``--overlap-step`` says (on by default: Note [overlapped step] in
zeroshard/units/step_in_flight.py); the medians leave out the first two steps (the first
reads no moments; the benchmark finishes it to start counting bytes, so the second has no
step to overlap), and the bytes per step are counted over the later steps whole.
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
import time
from typing import Optional

MODEL = dict(vocab=4096, d_model=1536, n_layers=38, n_heads=12, seq_len=64)
CGROUP_ROOT = "/sys/fs/cgroup/memory"


# -- children (run inside the cgroup) ------------------------------------------------------------
def _config(args: argparse.Namespace):
    from zeroshard.testing.toy import GPTConfig
    return GPTConfig(**{**MODEL, "n_layers": args.layers})


_SAMPLED = [0]


def _sample_rss() -> None:
    """A thread's VmRSS samples every 5 ms: offload="auto" resets VmHWM per step (to measure
    each step's peak), so the process's own peak is sampled, independently of zeroshard."""
    import threading

    from zeroshard.offload.process_rss import current_rss

    def run() -> None:
        while True:
            _SAMPLED[0] = max(_SAMPLED[0], current_rss())
            time.sleep(0.005)
    threading.Thread(target=run, daemon=True).start()


def _peak_rss() -> int:
    """This process's resident peak: VmHWM (ru_maxrss would count a parent's before exec), or
    the sampled peak where that is larger (VmHWM was reset)."""
    from zeroshard.offload.process_rss import peak_rss
    return max(peak_rss(), _SAMPLED[0])


def child_plain(args: argparse.Namespace) -> None:
    import torch
    from zeroshard.testing.toy import TinyGPT, synthetic_batch
    cfg = _config(args)
    model = TinyGPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(*synthetic_batch(0, 1, cfg)).backward()
    opt.step()
    print(json.dumps({"survived": True, "peak_rss": _peak_rss()}))


def _zero(args: argparse.Namespace, swap: str):
    import torch
    import zeroshard
    from zeroshard.testing.toy import TinyGPT
    cfg = _config(args)
    with torch.device("meta"):
        model = TinyGPT(cfg)
    opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-4, weight_decay=0.01, stage=3,
                                  offload_optimizer="nvme", offload_params="nvme", nvme_path=swap)
    return cfg, model, opt


def _steps(cfg, model, opt, start: int, n: int) -> tuple[list[float], list[float]]:
    from zeroshard.testing.toy import synthetic_batch
    losses, times = [], []
    for step in range(start, start + n):
        t0 = time.perf_counter()
        loss = model(*synthetic_batch(step, 1, cfg))
        loss.backward()
        opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
        print(f"  step {step + 1}: loss {loss.item():.6f} in {times[-1]:.1f}s, peak RSS "
              f"{_peak_rss() / 2**30:.2f} GiB", file=sys.stderr, flush=True)
    return losses, times


def child_train(args: argparse.Namespace) -> None:
    import zeroshard
    swap = os.path.join(args.dir, "swap")
    os.makedirs(swap, exist_ok=True)
    t0 = time.perf_counter()
    cfg, model, opt = _zero(args, swap)
    zeroshard.init_meta_weights(model, seed=0)
    init_s = time.perf_counter() - t0
    n = sum(p.numel() for p in model.parameters())
    losses, times = _steps(cfg, model, opt, 0, args.steps)
    t0 = time.perf_counter()
    zeroshard.save_checkpoint(os.path.join(args.dir, "ckpt"), args.steps, model=model, optimizer=opt)
    save_s = time.perf_counter() - t0
    more, more_times = _steps(cfg, model, opt, args.steps, args.resume_steps)
    rep = opt.memory_report()
    print(json.dumps({"params": n, "init_s": init_s, "step_s": times + more_times, "losses": losses,
                      "after_save_losses": more, "save_s": save_s, "peak_rss": _peak_rss(),
                      "offloaded_bytes": rep.offloaded, "memory_report": str(rep)}))


def child_placed(args: argparse.Namespace) -> None:
    """--auto: one placement (``--budget`` bytes, 0 = all NVMe), ``--steps`` steps, the swap files'
    bytes per step; with ``--budget -1`` only the planner's minimum and the state's size."""
    import torch
    import zeroshard
    from zeroshard.planner.auto_placement import PlacementError
    from zeroshard.testing.toy import TinyGPT
    swap = os.path.join(args.dir, "swap")
    os.makedirs(swap, exist_ok=True)
    cfg = _config(args)
    with torch.device("meta"):
        model = TinyGPT(cfg)
    place = (dict(offload_optimizer="nvme", offload_params="nvme") if args.budget == 0 else
             dict(offload="auto", memory_budget={"host": max(1, args.budget)}))
    place["overlap_step"] = args.overlap_step == "on"  # (all NVMe too: the same step either way)
    try:
        opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-4, weight_decay=0.01, stage=3,
                                      nvme_path=swap, **place)
    except PlacementError as exc:
        if args.budget != -1:
            raise
        print(json.dumps({"minimum": exc.minimum["host"], "state": exc.state}))
        return
    t0 = time.perf_counter()
    zeroshard.init_meta_weights(model, seed=0)
    init_s = time.perf_counter() - t0
    steps, phases = [], []
    from zeroshard.testing.toy import synthetic_batch
    from zeroshard.bench.phases import timed_step
    for step in range(args.steps):
        loss, phase = timed_step(model, opt, synthetic_batch(step, 1, cfg), lambda: opt.clip_grad_norm_(1.0))
        phases.append(phase)
        steps.append(sum(phase.values()))
        if step == 0:  # bytes are counted from here, over whole steps (the report waits for a step)
            opt.finish_step()
            before = opt.placement_report()["measured_io"]
        print(f"  step {step + 1}: loss {loss.item():.6f} in {steps[-1]:.1f}s, peak RSS {_peak_rss() / 2**30:.2f} GiB",
              file=sys.stderr, flush=True)
    opt.finish_step()
    rep = opt.placement_report()
    io = {k: (rep["measured_io"][k] - before[k]) / (args.steps - 1) for k in before}
    print(json.dumps({"init_s": init_s, "step_s": steps, "io": io, "predicted_io": rep["predicted_step_io"],
                      "predicted_memory": rep["predicted_memory"], "peak_rss": _peak_rss(),
                      "step_peaks": rep["peak_memory"], "direct_fraction": _direct_fraction(rep["measured_io"]),
                      "phases": phases,
                      "placement": rep["text"], "memory_report": str(opt.memory_report())}))


def _direct_fraction(io: dict) -> float:
    """Of the swap files' bytes, the share that went through O_DIRECT (Note [aligned swap parts])."""
    moved = io["read"] + io["written"]
    return io["direct"] / moved if moved else 1.0


def child_resume(args: argparse.Namespace) -> None:
    import zeroshard
    swap = os.path.join(args.dir, "swap")
    cfg, model, opt = _zero(args, swap)
    t0 = time.perf_counter()
    info = zeroshard.load_checkpoint(os.path.join(args.dir, "ckpt"), model=model, optimizer=opt)
    load_s = time.perf_counter() - t0
    losses, times = _steps(cfg, model, opt, info["step"], args.resume_steps)
    print(json.dumps({"load_s": load_s, "losses": losses, "step_s": times, "peak_rss": _peak_rss()}))


# -- the orchestrator -----------------------------------------------------------------------------
def fio_speed(directory: str, size_gib: float) -> dict:
    """Raw sequential write and read, GB/s, O_DIRECT 8 MiB x queue depth 16 (as bench_aio);
    without fio, the same pattern through zeroshard's engine (``source`` says which)."""
    if shutil.which("fio") is None:
        import torch
        from zeroshard.io import AsyncIO
        from zeroshard.io.bench import measure
        from zeroshard.io.buffers import aligned_empty
        buf = aligned_empty(256 * 2**20, torch.uint8, pin=False).random_(0, 256)
        with AsyncIO(block_size=8 * 2**20, queue_depth=16) as io:
            w, r = measure(io, os.path.join(directory, "raw.dat"), int(size_gib * 2**30) // buf.numel() * buf.numel(),
                           buf)
        return {"write": w, "read": r, "source": "zeroshard AsyncIO, O_DIRECT 8 MiB x qd16 (no fio here)"}
    path = os.path.join(directory, "fio-raw.dat")
    out = {}
    try:
        for rw in ("write", "read"):
            r = subprocess.run(["fio", "--name=raw", f"--filename={path}", f"--rw={rw}", "--bs=8M",
                                "--iodepth=16", "--ioengine=libaio", "--direct=1", f"--size={int(size_gib * 2**30)}",
                                "--output-format=json"], capture_output=True, text=True, check=True)
            job = json.loads(r.stdout)["jobs"][0][rw]
            out[rw] = job["bw_bytes"] / 1e9
    finally:
        if os.path.exists(path):
            os.unlink(path)
    return {**out, "source": "fio"}


class Cgroup:
    def __init__(self, limit_bytes: int) -> None:
        if os.geteuid() != 0 or not os.path.isdir(CGROUP_ROOT):
            raise SystemExit(f"needs root and cgroup v1 memory control at {CGROUP_ROOT} to set a memory limit")
        self.path = os.path.join(CGROUP_ROOT, f"zeroshard-big-{os.getpid()}")
        os.makedirs(self.path, exist_ok=True)
        self._write("memory.limit_in_bytes", str(limit_bytes))
        if os.path.exists(os.path.join(self.path, "memory.memsw.limit_in_bytes")):
            self._write("memory.memsw.limit_in_bytes", str(limit_bytes))  # no escape into swap
        self.limit = int(self._read("memory.limit_in_bytes"))

    def _write(self, name: str, value: str) -> None:
        with open(os.path.join(self.path, name), "w") as f:
            f.write(value)

    def _read(self, name: str) -> str:
        with open(os.path.join(self.path, name)) as f:
            return f.read().strip()

    def set_limit(self, limit_bytes: int) -> None:
        if os.path.exists(os.path.join(self.path, "memory.memsw.limit_in_bytes")) and limit_bytes > self.limit:
            self._write("memory.memsw.limit_in_bytes", str(limit_bytes))  # (memsw >= limit at all times)
            self._write("memory.limit_in_bytes", str(limit_bytes))
        else:
            self._write("memory.limit_in_bytes", str(limit_bytes))
            if os.path.exists(os.path.join(self.path, "memory.memsw.limit_in_bytes")):
                self._write("memory.memsw.limit_in_bytes", str(limit_bytes))
        self.limit = int(self._read("memory.limit_in_bytes"))

    def run(self, mode: str, args: argparse.Namespace, *extra: str) -> tuple[int, dict, float]:
        """Runs ``mode`` in the cgroup; (exit status, its JSON, peak cgroup usage incl. page cache)."""
        self._write("memory.max_usage_in_bytes", "0")
        cmd = [sys.executable, os.path.abspath(__file__), "--child", mode, "--dir", args.dir,
               "--steps", str(args.steps), "--resume-steps", str(args.resume_steps), "--layers", str(args.layers),
               "--overlap-step", args.overlap_step, *extra]
        procs = os.path.join(self.path, "cgroup.procs")
        shell = f'echo $$ > {procs} && exec "$@"'
        p = subprocess.run(["sh", "-c", shell, "sh", *cmd], stdout=subprocess.PIPE, text=True)
        lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
        return p.returncode, json.loads(lines[-1]) if lines else {}, int(self._read("memory.max_usage_in_bytes"))

    def oom_kills(self) -> int:
        for line in self._read("memory.oom_control").splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
        return -1

    def remove(self) -> None:
        try:
            os.rmdir(self.path)
        except OSError:
            pass


def _ratio(x: Optional[float]) -> str:
    return "n/a (nothing streams)" if x is None else f"{x:.2f}x"


def main_auto(args: argparse.Namespace, raw: dict) -> None:
    """--auto: all NVMe vs automatic placement at the limit and with half the state in memory."""
    limit = int(args.limit_gib * 2**30)
    headroom = int(args.headroom_gib * 2**30)
    cg = Cgroup(limit)
    runs: dict = {}
    try:
        code, probe, _ = cg.run("placed", args, "--budget", "-1")
        if code != 0 or "minimum" not in probe:
            raise SystemExit(f"the planner probe failed with exit {code}")
        half_budget = probe["minimum"] + probe["state"] // 2
        plan = [("all NVMe", 0, limit), ("auto at the limit", limit - headroom, limit),
                ("auto, half the state", half_budget, half_budget + headroom)]
        for name, budget, cg_limit in plan:
            cg.set_limit(cg_limit)
            print(f"{name}: budget {budget / 2**30:.2f} GiB, cgroup limit {cg.limit / 2**30:.2f} GiB", flush=True)
            code, res, peak = cg.run("placed", args, "--budget", str(budget))
            if code != 0:
                raise SystemExit(f"{name} failed with exit {code} (OOM kills so far: {cg.oom_kills()})")
            # The first step reads no moments (they start at zero), and the second has no step
            # before it to overlap (the first was finished there to start counting bytes).
            steps = res["step_s"][2:]
            step_s = statistics.median(steps)
            read, written = res["io"]["read"], res["io"]["written"]
            runs[name] = {"budget": budget, "cgroup_limit": cg.limit, "step_s": step_s, "all_step_s": res["step_s"],
                          "read_per_step": read, "written_per_step": written, "predicted_io": res["predicted_io"],
                          "peak_rss": res["peak_rss"], "peak_cgroup": peak, "predicted_memory": res["predicted_memory"],
                          "step_peaks": res["step_peaks"], "direct_fraction": res["direct_fraction"],
                          "phases_s": {k: statistics.median(p[k] for p in res["phases"][2:]) for k in res["phases"][0]},
                          "overlap_step": args.overlap_step,
                          "rss_within_budget": None if budget <= 0 else res["peak_rss"] <= budget,
                          "init_s": res["init_s"], "placement": res["placement"]}
            print(res["placement"], flush=True)
    finally:
        cg.remove()
    # The disk is measured again after the runs and the faster of each direction makes the
    # floor: a disk slowed by something else at one of the two moments must not lower it.
    after = fio_speed(args.dir, args.fio_gib)
    raw = {"write": max(raw["write"], after["write"]), "read": max(raw["read"], after["read"]),
           "before": {k: raw[k] for k in ("write", "read")}, "after": {k: after[k] for k in ("write", "read")},
           "source": raw["source"]}
    for r in runs.values():
        floor = r["read_per_step"] / (raw["read"] * 1e9) + r["written_per_step"] / (raw["write"] * 1e9)
        r.update(floor_s=floor, step_over_floor=r["step_s"] / floor if floor else None)
    base = runs["all NVMe"]["step_s"]
    result = {"raw_gbps": raw, "state_bytes": probe["state"], "minimum_budget": probe["minimum"],
              "headroom": headroom, "runs": runs,
              "auto_at_limit_over_floor": runs["auto at the limit"]["step_over_floor"],
              "half_over_all_nvme": runs["auto, half the state"]["step_s"] / base,
              "load_average": os.getloadavg()}
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    print(f"\nstate {probe['state'] / 2**30:.1f} GiB; raw disk write {raw['write']:.2f} / read {raw['read']:.2f} GB/s "
          f"({raw['source']})")
    for name, r in runs.items():
        print(f"{name:>22}: {r['step_s']:.1f} s/step, streams {r['read_per_step'] / 2**30:.2f} GiB read + "
              f"{r['written_per_step'] / 2**30:.2f} GiB written per step (floor {r['floor_s']:.1f} s, "
              f"{_ratio(r['step_over_floor'])}), peak RSS {r['peak_rss'] / 2**30:.2f} GiB"
              + (f" (budget {r['budget'] / 2**30:.2f} GiB, predicted {r['predicted_memory']['host'] / 2**30:.2f})"
                 if r["budget"] > 0 else "")
              + f", cgroup peak {r['peak_cgroup'] / 2**30:.2f} of {r['cgroup_limit'] / 2**30:.2f} GiB, "
              f"O_DIRECT {100 * r['direct_fraction']:.0f}% of swap bytes")
    print(f"auto at the limit: {_ratio(result['auto_at_limit_over_floor'])} the floor of its streamed bytes "
          "(target <= 1.15)\n"
          f"half the state in memory: {result['half_over_all_nvme']:.2f}x the all-NVMe step (target <= 0.6)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", required=True, help="directory on the NVMe drive (swap files, checkpoint)")
    ap.add_argument("--limit-gib", type=float, default=4.0)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--resume-steps", type=int, default=2)
    ap.add_argument("--layers", type=int, default=MODEL["n_layers"])
    ap.add_argument("--fio-gib", type=float, default=4.0)
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--auto", action="store_true", help="compare all-NVMe with offload='auto' placements")
    ap.add_argument("--headroom-gib", type=float, default=0.5,
                    help="--auto: cgroup memory the budget leaves to the kernel's page cache (the budget "
                         "itself covers the whole process's resident memory)")
    ap.add_argument("--overlap-step", choices=("on", "off"), default="on",
                    help="--auto: overlap_step for every placement (Note [overlapped step])")
    ap.add_argument("--budget", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--child", choices=("plain", "train", "resume", "placed"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        _sample_rss()
        {"plain": child_plain, "train": child_train, "resume": child_resume, "placed": child_placed}[args.child](args)
        return
    if args.auto and args.steps < 4:
        raise SystemExit(f"--auto needs --steps >= 4 (got {args.steps}): the first two steps are left out of the median")
    os.makedirs(args.dir, exist_ok=True)
    for sub in ("swap", "ckpt"):
        shutil.rmtree(os.path.join(args.dir, sub), ignore_errors=True)
    raw = fio_speed(args.dir, args.fio_gib)
    print(f"raw disk ({raw['source']}): write {raw['write']:.2f} GB/s, read {raw['read']:.2f} GB/s", flush=True)
    if args.auto:
        main_auto(args, raw)
        return
    cg = Cgroup(int(args.limit_gib * 2**30))
    try:
        print(f"cgroup memory limit {cg.limit / 2**30:.2f} GiB", flush=True)
        print("plain torch.optim.AdamW, eager model:", flush=True)
        plain_code, _, plain_peak = cg.run("plain", args)
        plain_killed = plain_code in (-signal.SIGKILL, 128 + signal.SIGKILL) or cg.oom_kills() > 0
        print(f"  exit {plain_code} ({'killed by the OOM killer' if plain_killed else 'NOT killed'})", flush=True)
        print("zeroshard, NVMe offload:", flush=True)
        code, train, train_peak = cg.run("train", args)
        if code != 0:
            raise SystemExit(f"the zeroshard run failed with exit {code}")
        code, resume, resume_peak = cg.run("resume", args)
        if code != 0:
            raise SystemExit(f"the resumed run failed with exit {code}")
    finally:
        cg.remove()
    n = train["params"]
    state = 16 * n  # fp32 params (= master) + grads + exp_avg + exp_avg_sq
    steps = train["step_s"][1:] + resume["step_s"][1:]  # the first step of a process warms up
    step_s = statistics.median(steps)
    disk_once = state / (raw["read"] * 1e9) + state / (raw["write"] * 1e9)
    result = {
        "params": n, "state_bytes": state, "limit_bytes": cg.limit, "state_over_limit": state / cg.limit,
        "plain_adamw": {"exit": plain_code, "killed": plain_killed, "peak_cgroup": plain_peak},
        "raw_gbps": raw, "init_s": train["init_s"], "step_s": step_s, "all_step_s": train["step_s"] + resume["step_s"],
        "step_over_disk_once": step_s / disk_once, "disk_once_s": disk_once,
        "save_s": train["save_s"], "load_s": resume["load_s"],
        "peak_rss": {"train": train["peak_rss"], "resume": resume["peak_rss"]},
        "peak_cgroup": {"train": train_peak, "resume": resume_peak},
        "resume_bitwise": train["after_save_losses"] == resume["losses"],
        "losses": {"before_save": train["losses"], "after_save": train["after_save_losses"],
                   "resumed": resume["losses"]},
        "memory_report": train["memory_report"],
    }
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    print(f"\n{n / 1e9:.3f} B parameters, fp32 training state {state / 2**30:.1f} GiB = "
          f"{state / cg.limit:.2f}x the {cg.limit / 2**30:.1f} GiB limit\n"
          f"plain AdamW: {'killed (OOM)' if plain_killed else 'ran'}\n"
          f"peak RSS {max(train['peak_rss'], resume['peak_rss']) / 2**30:.2f} GiB; "
          f"{step_s:.1f} s/step = {step_s / disk_once:.2f}x the {disk_once:.1f} s the disk needs to read and "
          f"write the state once\ncheckpoint save {train['save_s']:.1f} s, load {resume['load_s']:.1f} s; "
          f"resumed losses bit-identical: {result['resume_bitwise']}")
    if not result["resume_bitwise"] or not plain_killed:
        sys.exit(1)


if __name__ == "__main__":
    main()
