"""LoRA fine-tuning of a base model three times bigger than memory: the base on NVMe.

    sudo python benchmarks/bench_lora_bigger_than_memory.py --dir /mnt/nvme/zs-lora

What it does (root and cgroup v1 memory control are needed for the limit; it says so if not):
1. writes a ``transformers`` Llama with random bf16 weights as a Hugging Face directory
   (outside the cgroup) and measures the disk's sequential read (fio if installed, else
   zeroshard's O_DIRECT engine: 8 MiB x queue depth 16);
2. in a cgroup whose limit is at most a third of the base's bf16 bytes, plain PEFT
   (``from_pretrained`` + ``get_peft_model`` + ``torch.optim.AdamW``) is OOM-killed;
3. in the same cgroup one process builds the model on ``meta``, wraps it with
   ``peft.get_peft_model``, partitions it with zeroshard stage 3 (base shards and adapter
   state in swap files: ``offload_params="nvme"``), fills the base from the directory
   (``load_safetensors``) and the adapters by PEFT's init (``init_meta_weights``), trains
   ``--steps`` steps, saves a checkpoint (adapters and their state only), trains
   ``--resume-steps`` more, and exports the adapter in PEFT's format;
4. a fresh process in the cgroup loads the base and that checkpoint and trains the same
   steps: losses must equal phase 3's bit for bit;
5. outside the cgroup, ``PeftModel.from_pretrained`` loads the exported adapter.

It reports the step time as a multiple of the time to read the base once at the measured
speed (the floor is 2x: forward and backward each read every block's shard).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_bigger_than_memory import CGROUP_ROOT, Cgroup, fio_speed  # noqa: E402 - the same cgroup method

MODEL = dict(hidden_size=2048, intermediate_size=5632, num_attention_heads=16, num_key_value_heads=4,
             vocab_size=4096, max_position_embeddings=128, tie_word_embeddings=False)
SEQ, LR = 16, 1e-3
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


def _config(layers: int):
    from transformers import LlamaConfig
    return LlamaConfig(num_hidden_layers=layers, **MODEL)


def _lora():
    from peft import LoraConfig
    return LoraConfig(r=16, lora_alpha=32, target_modules=TARGETS, lora_dropout=0.0)


def _batch(step: int):
    import torch
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, MODEL["vocab_size"], (1, SEQ), generator=g)


# -- children (run inside the cgroup) ------------------------------------------------------------
def _peak_rss() -> int:
    """This process's peak resident set (VmHWM). Not ``ru_maxrss``: Linux carries that across
    fork and exec, so a child would report the orchestrator's peak (it built the base)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def child_plain(args: argparse.Namespace, resident: bool = True) -> None:
    """Plain PEFT + torch.optim.AdamW. ``resident``: the base's weights in the process's own
    memory, as a model moved to a device must be; otherwise as ``from_pretrained`` leaves a
    bf16 safetensors file on a CPU: zero-copy views of the memory-mapped file, whose pages
    the kernel may drop and re-read (file-backed, so the cgroup can reclaim them)."""
    import torch
    from peft import get_peft_model
    from transformers import LlamaForCausalLM
    base = LlamaForCausalLM.from_pretrained(os.path.join(args.dir, "base"), dtype=torch.bfloat16)
    if resident:
        with torch.no_grad():
            for p in base.parameters():
                p.data = p.data.clone()
    model = get_peft_model(base, _lora())
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    losses, times = _steps(model, opt, 0, args.steps)
    print(json.dumps({"survived": True, "peak_rss": _peak_rss(), "step_s": times, "losses": losses}))


def _zero(args: argparse.Namespace, swap: str):
    import torch
    from peft import get_peft_model
    from transformers import LlamaForCausalLM

    import zeroshard
    with torch.device("meta"):
        model = get_peft_model(LlamaForCausalLM(_config(args.layers)).to(torch.bfloat16), _lora())
    if args.placement == "auto":  # (the budget covers the process's resident memory; the cgroup also
        # counts reclaimable page cache, which --headroom leaves it)
        place = dict(offload="auto", memory_budget={"host": args.budget})
    else:
        place = dict(offload_optimizer="nvme", offload_params="nvme")
    opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=LR, stage=3, nvme_path=swap, **place)
    t0 = time.perf_counter()
    zeroshard.load_safetensors(model, os.path.join(args.dir, "base"))
    load_s = time.perf_counter() - t0
    return model, opt, load_s


def _cgroup_cache() -> int:
    """Page-cache bytes charged to this process's memory cgroup (v1 ``memory.stat`` "cache");
    -1 where there is none: O_DIRECT reads must not grow it with the base."""
    try:
        with open("/proc/self/cgroup") as f:
            path = next(ln.split(":", 2)[2].strip() for ln in f if ":memory:" in ln)
        with open(os.path.join(CGROUP_ROOT, path.lstrip("/"), "memory.stat")) as f:
            return next(int(ln.split()[1]) for ln in f if ln.startswith("cache "))
    except (OSError, StopIteration, ValueError):
        return -1


def _steps(model, opt, start: int, n: int, io: list | None = None) -> tuple[list[float], list[float]]:
    """``io``: per step, what the swap files did (``placement_report()["measured_io"]`` deltas)
    and the cgroup's page cache after it."""
    import torch
    losses, times = [], []
    for step in range(start, start + n):
        before = opt.placement_report()["measured_io"] if io is not None else None
        t0 = time.perf_counter()
        ids = _batch(step)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
        if io is not None and before is not None:
            after = opt.placement_report()["measured_io"]
            io.append({**{k: after[k] - before[k] for k in before}, "cgroup_cache": _cgroup_cache()})
        print(f"  step {step + 1}: loss {loss.item():.6f} in {times[-1]:.1f}s, peak RSS "
              f"{_peak_rss() / 2**30:.2f} GiB", file=sys.stderr, flush=True)
    return losses, times


def child_train(args: argparse.Namespace) -> None:
    import zeroshard
    swap = os.path.join(args.dir, "swap")
    os.makedirs(swap, exist_ok=True)
    model, opt, load_s = _zero(args, swap)
    zeroshard.init_meta_weights(model, seed=0)
    rep = opt.memory_report()
    io: list[dict] = []
    losses, times = _steps(model, opt, 0, args.steps, io)
    t0 = time.perf_counter()
    zeroshard.save_checkpoint(os.path.join(args.dir, "ckpt"), args.steps, model=model, optimizer=opt)
    save_s = time.perf_counter() - t0
    more, more_times = _steps(model, opt, args.steps, args.resume_steps)
    zeroshard.save_adapter(model, os.path.join(args.dir, "adapter"))
    print(json.dumps({"base_load_s": load_s, "step_s": times + more_times, "losses": losses,
                      "after_save_losses": more, "save_s": save_s, "peak_rss": _peak_rss(),
                      "frozen_resident": rep.frozen, "frozen_on_nvme": rep.frozen_offloaded, "step_io": io,
                      "placement": opt.placement_report()["text"], "budget": args.budget,
                      "live_units": opt.engine.gatherer.max_live,
                      "memory_report": str(rep)}))


def child_resume(args: argparse.Namespace) -> None:
    import zeroshard
    swap = os.path.join(args.dir, "swap")
    model, opt, load_s = _zero(args, swap)
    t0 = time.perf_counter()
    info = zeroshard.load_checkpoint(os.path.join(args.dir, "ckpt"), model=model, optimizer=opt)
    ckpt_s = time.perf_counter() - t0
    losses, times = _steps(model, opt, info["step"], args.resume_steps)
    print(json.dumps({"base_load_s": load_s, "ckpt_load_s": ckpt_s, "losses": losses, "step_s": times,
                      "peak_rss": _peak_rss()}))


# -- the orchestrator -----------------------------------------------------------------------------
def write_base(directory: str, layers: int) -> int:
    import torch
    from transformers import LlamaForCausalLM
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # initialised in bf16 directly: half the memory of fp32
    try:
        model = LlamaForCausalLM(_config(layers))
    finally:
        torch.set_default_dtype(default)
    model.save_pretrained(directory, max_shard_size="1GB")
    n = sum(p.numel() for p in model.parameters())
    del model
    return n


def read_speed(directory: str, size_gib: float) -> tuple[str, float]:
    if shutil.which("fio"):
        return "fio", fio_speed(directory, size_gib)["read"]
    import torch

    from zeroshard.io.bench import measure
    from zeroshard.io.buffers import aligned_empty
    from zeroshard.io.aio_engine import AsyncIO
    buffer = aligned_empty(256 << 20, torch.uint8, pin=False)
    buffer.random_(0, 256)
    with AsyncIO(block_size=8 << 20, queue_depth=16) as io:
        reads = [measure(io, os.path.join(directory, "speed.dat"), int(size_gib * 2**30), buffer)[1]
                 for _ in range(3)]
    return "zeroshard AsyncIO O_DIRECT 8 MiB x qd16 (no fio here)", statistics.median(reads)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", required=True, help="directory on the NVMe drive (base, swap files, checkpoint)")
    ap.add_argument("--layers", type=int, default=64, help="Llama blocks (64: 2.9 B parameters, 5.8 GB in bf16)")
    ap.add_argument("--limit-fraction", type=float, default=1 / 3, help="cgroup limit as a share of the base bytes")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--resume-steps", type=int, default=2)
    ap.add_argument("--read-gib", type=float, default=2.0)
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--placement", choices=("auto", "nvme"), default="auto",
                    help="auto: offload='auto' with memory_budget = the cgroup limit less --headroom (the base "
                         "streams, what fits stays, the parameter cache and prefetch depth follow the budget); "
                         "nvme: offload_optimizer/offload_params='nvme' (everything streams)")
    ap.add_argument("--headroom", type=float, default=0.1,
                    help="--placement auto: share of the cgroup limit left out of the budget (page cache, kernel)")
    ap.add_argument("--budget", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--no-peers", action="store_true",
                    help="skip plain PEFT in the cgroup (the OOM-kill and memory-mapped runs): a quicker run")
    ap.add_argument("--child", choices=("plain", "plain_mmap", "train", "resume"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        {"plain": child_plain, "plain_mmap": lambda a: child_plain(a, resident=False), "train": child_train,
         "resume": child_resume}[args.child](args)
        return
    os.makedirs(args.dir, exist_ok=True)
    for sub in ("swap", "ckpt", "adapter", "base"):
        shutil.rmtree(os.path.join(args.dir, sub), ignore_errors=True)
    n = write_base(os.path.join(args.dir, "base"), args.layers)
    base_bytes = 2 * n
    tool, read_gbps = read_speed(args.dir, args.read_gib)
    print(f"base: {n / 1e9:.3f} B parameters, {base_bytes / 2**30:.2f} GiB in bf16; disk read {read_gbps:.2f} GB/s "
          f"({tool})", flush=True)
    # Compute alone: the same PEFT model with its base resident in memory, outside the cgroup
    # (no I/O at all), the same steps: what a step would take at infinite disk speed.
    res_code, resident, _ = _run(None, "plain", args)
    resident_s = statistics.median(resident["step_s"][1:]) if res_code == 0 and resident.get("step_s") else None
    print(f"resident model (no limit, no I/O): {resident_s} s/step", flush=True)
    os.system("sync; echo 3 > /proc/sys/vm/drop_caches")  # the base is read from disk, not page cache
    cg = Cgroup(int(base_bytes * args.limit_fraction))
    plain_code, plain_killed, plain_peak, mmap_code, mmap_run, mmap_peak = None, None, None, None, {}, None
    try:
        print(f"cgroup memory limit {cg.limit / 2**30:.2f} GiB ({cg.limit / base_bytes:.2f}x the base)", flush=True)
        if not args.no_peers:
            plain_code, _, plain_peak = _run(cg, "plain", args)
            plain_killed = plain_code in (-signal.SIGKILL, 128 + signal.SIGKILL) or cg.oom_kills() > 0
            print(f"plain PEFT, base in process memory: exit {plain_code} "
                  f"({'killed by the OOM killer' if plain_killed else 'NOT killed'})", flush=True)
            os.system("sync; echo 3 > /proc/sys/vm/drop_caches")
            mmap_code, mmap_run, mmap_peak = _run(cg, "plain_mmap", args)
            print(f"plain PEFT, base memory-mapped (from_pretrained's zero-copy): exit {mmap_code}", flush=True)
            os.system("sync; echo 3 > /proc/sys/vm/drop_caches")
        code, train, train_peak = _run(cg, "train", args)
        if code != 0:
            raise SystemExit(f"the zeroshard run failed with exit {code}")
        code, resume, resume_peak = _run(cg, "resume", args)
        if code != 0:
            raise SystemExit(f"the resumed run failed with exit {code}")
    finally:
        cg.remove()
    adapter_ok = _check_adapter(args.dir)
    # The disk's speed drifts on a shared machine (1.9-2.5 GB/s within minutes here): measured
    # again after the runs, the faster of the two makes the floor (the ratios err against us).
    _, read_after = read_speed(args.dir, args.read_gib)
    read_before, read_gbps = read_gbps, max(read_gbps, read_after)
    steps = train["step_s"][1:] + resume["step_s"][1:]  # the first step of a process warms up
    step_s = statistics.median(steps)
    read_once = base_bytes / (read_gbps * 1e9)
    # The step split (train's steps after the first): compute = the resident model's step;
    # I/O wait = what forward and backward waited on gather reads (the prefetch did not hide);
    # overhead = the rest (zeroshard's own CPU work, the adapters' state I/O, the step).
    io = train["step_io"][1:]
    io_wait = statistics.median(r["gather_wait_s"] for r in io) if io else None
    base_read = statistics.median(r["frozen_gather_read"] for r in io) if io else None
    split = {"compute_s": resident_s, "io_wait_s": io_wait,
             "overhead_s": (step_s - resident_s - io_wait) if resident_s is not None and io_wait is not None else None}
    ckpt_bytes = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(os.path.join(args.dir, "ckpt"))
                     for f in fs)
    result = {
        "params": n, "base_bytes": base_bytes, "limit_bytes": cg.limit, "limit_over_base": cg.limit / base_bytes,
        "split": split, "resident_step_s": resident_s,
        "base_bytes_read_per_step": base_read, "base_reads_per_step": base_read / base_bytes if base_read else None,
        "direct_fraction": (sum(r["direct"] for r in io) / max(1, sum(r["read"] + r["written"] for r in io))
                            if io else None),
        "cgroup_cache_per_step": [r["cgroup_cache"] for r in train["step_io"]],
        "step_over_resident_plus_two_reads": (step_s / (resident_s + 2 * read_once)) if resident_s else None,
        "plain_peft": {"exit": plain_code, "killed": plain_killed, "peak_cgroup": plain_peak},
        "plain_peft_mmap": {"exit": mmap_code, "peak_cgroup": mmap_peak,
                            "step_s": statistics.median(mmap_run["step_s"][1:]) if mmap_run.get("step_s") else None,
                            "all_step_s": mmap_run.get("step_s"), "peak_rss": mmap_run.get("peak_rss")},
        "read_gbps": read_gbps, "read_gbps_before_after": [read_before, read_after], "read_tool": tool, "step_s": step_s, "all_step_s": train["step_s"] + resume["step_s"],
        "base_read_once_s": read_once, "step_over_base_read": step_s / read_once,
        "base_load_s": {"train": train["base_load_s"], "resume": resume["base_load_s"]},
        "save_s": train["save_s"], "ckpt_load_s": resume["ckpt_load_s"], "checkpoint_bytes": ckpt_bytes,
        "peak_rss": {"train": train["peak_rss"], "resume": resume["peak_rss"]},
        "peak_cgroup": {"train": train_peak, "resume": resume_peak},
        "frozen_resident": train["frozen_resident"], "frozen_on_nvme": train["frozen_on_nvme"],
        "placement": args.placement, "budget": train["budget"] or None, "placement_text": train["placement"],
        "live_units": train["live_units"],
        "resume_bitwise": train["after_save_losses"] == resume["losses"], "adapter_loads_with_peft": adapter_ok,
        "losses": {"before_save": train["losses"], "after_save": train["after_save_losses"],
                   "resumed": resume["losses"]},
        "memory_report": train["memory_report"],
    }
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    print(f"\nbase {base_bytes / 2**30:.2f} GiB bf16 in a {cg.limit / 2**30:.2f} GiB cgroup; plain PEFT: "
          f"{'not run (--no-peers)' if plain_killed is None else 'killed (OOM)' if plain_killed else 'ran'}\npeak RSS {max(result['peak_rss'].values()) / 2**30:.2f} GiB, "
          f"peak cgroup {max(result['peak_cgroup'].values()) / 2**30:.2f} GiB; {step_s:.1f} s/step = "
          f"{step_s / read_once:.2f}x the {read_once:.2f} s to read the base once at {read_gbps:.2f} GB/s (the faster of "
          f"{read_before:.2f} before and {read_after:.2f} after; floor: the reads a step makes, "
          f"{result['base_reads_per_step']:.2f}x); plain PEFT on the "
          f"memory-mapped base: {result['plain_peft_mmap']['step_s']} s/step\n"
          f"checkpoint {ckpt_bytes / 2**20:.1f} MiB; resumed losses bit-identical: {result['resume_bitwise']}; "
          f"adapter loads with PEFT: {adapter_ok}")
    if resident_s is not None and io_wait is not None:
        print(f"split of a step: compute {resident_s:.2f} s (resident model), I/O wait {io_wait:.2f} s, overhead "
              f"{split['overhead_s']:.2f} s; step / (resident + 2 reads of the base) = "
              f"{result['step_over_resident_plus_two_reads']:.2f} (target <= 1.15); base read per step "
              f"{result['base_reads_per_step']:.2f}x the base (2 = forward + backward); O_DIRECT share "
              f"{result['direct_fraction']:.3f}; cgroup page cache after each step "
              f"{[round(c / 2**20) for c in result['cgroup_cache_per_step']]} MiB")
    if not (result["resume_bitwise"] and (plain_killed or args.no_peers) and adapter_ok):
        sys.exit(1)


def _run(cg: Cgroup | None, mode: str, args: argparse.Namespace) -> tuple[int, dict, int]:
    """Runs child ``mode`` in the cgroup (outside any with ``cg=None``); (exit, JSON, cgroup peak)."""
    import subprocess
    cmd = [sys.executable, os.path.abspath(__file__), "--child", mode, "--dir", args.dir, "--steps", str(args.steps),
           "--resume-steps", str(args.resume_steps), "--layers", str(args.layers), "--placement", args.placement,
           "--budget", str(int(cg.limit * (1 - args.headroom)) if cg is not None else 0)]
    if cg is None:
        p = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
        lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
        return p.returncode, json.loads(lines[-1]) if lines else {}, 0
    cg._write("memory.max_usage_in_bytes", "0")
    procs = os.path.join(cg.path, "cgroup.procs")
    p = subprocess.run(["sh", "-c", f'echo $$ > {procs} && exec "$@"', "sh", *cmd], stdout=subprocess.PIPE, text=True)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    return p.returncode, json.loads(lines[-1]) if lines else {}, int(cg._read("memory.max_usage_in_bytes"))


def _check_adapter(directory: str) -> bool:
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM
    saved = load_file(os.path.join(directory, "adapter", "adapter_model.safetensors"))
    model = LlamaForCausalLM.from_pretrained(os.path.join(directory, "base"), dtype=torch.bfloat16)
    peft_model = PeftModel.from_pretrained(model, os.path.join(directory, "adapter"))
    sd = peft_model.state_dict()
    name = {k.replace(".default", ""): k for k in sd}
    return all(torch.equal(v, sd[name[k]]) for k, v in saved.items() if k in name) and len(saved) > 0


if __name__ == "__main__":
    main()
