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
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import time

MODEL = dict(vocab=4096, d_model=1536, n_layers=38, n_heads=12, seq_len=64)
CGROUP_ROOT = "/sys/fs/cgroup/memory"


# -- children (run inside the cgroup) ------------------------------------------------------------
def _config(args: argparse.Namespace):
    from zeroshard.toy import GPTConfig
    return GPTConfig(**{**MODEL, "n_layers": args.layers})


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def child_plain(args: argparse.Namespace) -> None:
    import torch
    from zeroshard.toy import TinyGPT, synthetic_batch
    cfg = _config(args)
    model = TinyGPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(*synthetic_batch(0, 1, cfg)).backward()
    opt.step()
    print(json.dumps({"survived": True, "peak_rss": _peak_rss()}))


def _zero(args: argparse.Namespace, swap: str):
    import torch
    import zeroshard
    from zeroshard.toy import TinyGPT
    cfg = _config(args)
    with torch.device("meta"):
        model = TinyGPT(cfg)
    opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-4, weight_decay=0.01, stage=3,
                                  offload_optimizer="nvme", offload_params="nvme", nvme_path=swap)
    return cfg, model, opt


def _steps(cfg, model, opt, start: int, n: int) -> tuple[list[float], list[float]]:
    from zeroshard.toy import synthetic_batch
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
    """Raw sequential write and read, GB/s, O_DIRECT 8 MiB x queue depth 16 (as bench_aio)."""
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
    return out


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

    def run(self, mode: str, args: argparse.Namespace) -> tuple[int, dict, float]:
        """Runs ``mode`` in the cgroup; (exit status, its JSON, peak cgroup usage incl. page cache)."""
        self._write("memory.max_usage_in_bytes", "0")
        cmd = [sys.executable, os.path.abspath(__file__), "--child", mode, "--dir", args.dir,
               "--steps", str(args.steps), "--resume-steps", str(args.resume_steps), "--layers", str(args.layers)]
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", required=True, help="directory on the NVMe drive (swap files, checkpoint)")
    ap.add_argument("--limit-gib", type=float, default=4.0)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--resume-steps", type=int, default=2)
    ap.add_argument("--layers", type=int, default=MODEL["n_layers"])
    ap.add_argument("--fio-gib", type=float, default=4.0)
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--child", choices=("plain", "train", "resume"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        {"plain": child_plain, "train": child_train, "resume": child_resume}[args.child](args)
        return
    os.makedirs(args.dir, exist_ok=True)
    for sub in ("swap", "ckpt"):
        shutil.rmtree(os.path.join(args.dir, sub), ignore_errors=True)
    raw = fio_speed(args.dir, args.fio_gib)
    print(f"raw disk (fio O_DIRECT 8 MiB x qd16): write {raw['write']:.2f} GB/s, read {raw['read']:.2f} GB/s",
          flush=True)
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
