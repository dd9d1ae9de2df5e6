"""Activation offload on the CPU, in a memory-limited cgroup (issue 41), and a prepared GPU check.

    sudo python benchmarks/bench_activation_offload.py --dir /nvme/scratch [--limit-mib 700]

1. Bytes moved per step: a checkpointed TinyGPT with ``offload_activations="nvme"`` measured
   (``placement_report()["activations"]``) against ``plan_activations``' prediction, same run.
2. In a cgroup v1 memory limit (root needed; it says so if not), a TinyGPT whose activations
   without checkpointing are >= 3x the limit trains ``--steps`` steps with checkpointing and its
   inputs on NVMe: exit status, peak RSS, the cgroup's peak (page cache included) and OOM kills;
   the same model checkpointed without offload, and without checkpointing, in the same limit.
3. The longest sequence one fixed device budget holds, checkpointing alone vs with the inputs
   offloaded (planner prediction: ``longest_sequence``).
4. ``floor``: the offloaded step's time ÷ its floor, max(the same step checkpointed without offload,
   the I/O floor of the bytes it moved: those bytes written then read back, as files of the same
   sizes, through the offloader's own async I/O engine, in the same run). 1.0 = the traffic fully
   hidden behind compute or the step as fast as the storage allows (goal <= 1.2x).
5. ``--gpu``: the GPU check (a 1-2B-class shape at a sequence that does not fit without offload,
   step time ÷ the in-memory step at the longest sequence that fits, per token). Not measured in
   the session that wrote it (no GPU was lent): docs/results.md marks it so.
6. ``mix`` (``--parts mix``): the longest sequence a TinyGPT not checkpointed by the model trains
   (bisection over real runs of ``--steps`` steps) under one fixed ``--budget-mib`` with offload="auto" and
   ``PlannedActivations(checkpointed=False)``: keep / move only (``recompute=False``, the old plan)
   vs the mixed plan that also checkpoints blocks (Note [mixed activation plans]).
7. ``joint`` (``--parts joint``): the same bisection for a TinyGPT that checkpoints its blocks, the state
   competing for the budget: the shape measured at the first forward (``PlannedActivations()``: the state
   placed again there with the activations, Note [state re-placed at the first forward]; before that
   change, state first) vs declared (planned together at construction: Note [joint state and activation
   plan]); ``--shapes`` picks which of the two run, ``--stage`` the ZeRO stage (2 by default; at 3 the
   measured shape is read from the model's input, before any gather).
8. ``finer`` (``--parts finer``): issue 41's before / after in real runs with the options that shrink what
   stays (``--loss-chunk``, checkpoints in halves): the longest sequence whose step's peak of live tensor
   bytes is within ``--budget-mib``, checkpointing alone vs every half's input on NVMe, and the planner's.
Prints one JSON line per part.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import zeroshard  # noqa: E402
from zeroshard.planner.activation_plan import longest_sequence, plan_activations  # noqa: E402
from zeroshard.planner.model_shape import ModelShape  # noqa: E402
from zeroshard.testing.toy import GPTConfig, TinyGPT, synthetic_batch  # noqa: E402

CGROUP_ROOT = "/sys/fs/cgroup/memory"


def _config(args: argparse.Namespace, checkpointing: bool) -> GPTConfig:
    return GPTConfig(vocab=256, d_model=args.d_model, n_layers=args.layers, n_heads=4, seq_len=args.seq_len,
                     activation_checkpointing=checkpointing, checkpoint_granularity=args.granularity,
                     loss_chunk=args.loss_chunk)


def _shape(cfg: GPTConfig, model: torch.nn.Module) -> ModelShape:
    return ModelShape.from_gpt(cfg, sum(p.numel() for p in model.parameters()))


def child(args: argparse.Namespace) -> None:
    """One training run (in the cgroup when the parent made one): its figures as a JSON line."""
    cfg = _config(args, args.child != "plain")
    torch.manual_seed(0)
    model = TinyGPT(cfg)
    options = {}
    if args.child == "offload":
        options = dict(nvme_path=args.dir, offload_activations=zeroshard.ActivationOffload(where="nvme"))
    opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-3, stage=2, **options)
    times = []
    for step in range(args.steps):
        t = time.perf_counter()
        model(*synthetic_batch(step, args.batch, cfg)).backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t)
    from zeroshard.offload.process_rss import peak_rss
    report = opt.placement_report().get("activations") or {}
    print(json.dumps({"mode": args.child, "peak_rss": peak_rss(), "step_s": sorted(times)[len(times) // 2],
                      "moved_per_step": report.get("bytes_moved_last_step", 0)}), flush=True)
    opt.close()


def _in_cgroup(args: argparse.Namespace, mode: str, limit: int) -> dict:
    path = os.path.join(CGROUP_ROOT, f"zeroshard-act-{os.getpid()}")
    os.makedirs(path, exist_ok=True)

    def write(name: str, value: str) -> None:
        with open(os.path.join(path, name), "w") as f:
            f.write(value)

    def read(name: str) -> str:
        with open(os.path.join(path, name)) as f:
            return f.read().strip()
    try:
        write("memory.limit_in_bytes", str(limit))
        if os.path.exists(os.path.join(path, "memory.memsw.limit_in_bytes")):
            write("memory.memsw.limit_in_bytes", str(limit))  # (no escape into swap)
        cmd = [sys.executable, os.path.abspath(__file__), "--child", mode, "--dir", args.dir, "--steps",
               str(args.steps), "--layers", str(args.layers), "--d-model", str(args.d_model), "--seq-len",
               str(args.seq_len), "--batch", str(args.batch)]
        shell = f'echo $$ > {os.path.join(path, "cgroup.procs")} && exec "$@"'
        p = subprocess.run(["sh", "-c", shell, "sh", *cmd], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
        kills = [ln for ln in read("memory.oom_control").splitlines() if ln.startswith("oom_kill ")]
        return {"mode": mode, "exit": p.returncode, **(json.loads(lines[-1]) if lines else {}),
                "cgroup_peak": int(read("memory.max_usage_in_bytes")),
                "oom_kills": int(kills[0].split()[1]) if kills else None,
                "error": p.stderr.strip().splitlines()[-1] if p.returncode and p.stderr.strip() else ""}
    finally:
        try:
            os.rmdir(path)
        except OSError:
            pass


def part_bytes(args: argparse.Namespace) -> dict:
    cfg = _config(args, True)
    torch.manual_seed(0)
    model = TinyGPT(cfg)
    shape = _shape(cfg, model)
    # (the fully offloaded plan: the device holds only what no plan moves)
    full = plan_activations(shape, args.batch, cfg.seq_len, 4, device=_least(shape, args.batch, cfg.seq_len),
                            host=0, nvme=1 << 40)
    opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-3, stage=2, nvme_path=args.dir,
                                  offload_activations=zeroshard.ActivationOffload(where="nvme", min_bytes=0))
    for step in range(2):
        model(*synthetic_batch(step, args.batch, cfg)).backward()
        opt.step()
        opt.zero_grad()
    measured = opt.placement_report()["activations"]["bytes_moved_last_step"]
    opt.close()
    return {"part": "bytes per step", "measured": measured, "predicted": full.moved_per_step,
            "ratio": measured / max(1, full.moved_per_step), "plan": full.counts()}


def _least(shape: ModelShape, batch: int, seq: int) -> int:
    """The device bytes of the fully offloaded plan (embeddings, logits, one block recomputed, its backward's
    transients, and the running block's input with the 2 prefetched: Note [planning activations])."""
    from zeroshard.planner.activations import block_activation_elements
    tokens = batch * seq
    return (block_activation_elements(shape, tokens, seq, False) * 4 + 2 * tokens * shape.d_model * 4
            + tokens * shape.vocab * 12 + tokens * (2 * shape.d_model + 2 * shape.ffn) * 4
            + 3 * tokens * shape.d_model * 4)


def _per_token(shape: ModelShape, seq: int, act_bytes: int, prefetch: int = 2) -> dict:
    """Bytes per token of a micro-batch of one ``seq`` sequence: what checkpointing keeps (the
    blocks' inputs, one per checkpoint), and what stays on the device whatever the plan (what one
    recomputed block holds and its backward's transients; embeddings and logits, as the planner counts
    them: with a chunked loss the chunk's logits spread over the ``seq`` tokens), and, once the inputs
    move, the records brought back ahead of backward (the running block's and ``prefetch`` more: Note
    [planning activations]); ``bound``: the ratio offload can give at most at this granularity,
    (inputs + what stays) / (what stays + the records back)."""
    from zeroshard.planner.activations import checkpoint_input_elements, logits_bytes, recompute_elements
    one_input = checkpoint_input_elements(shape, seq) * act_bytes / seq
    inputs = shape.n_layers * one_input
    block = recompute_elements(shape, seq, seq, False) * act_bytes / seq
    work = (2 * shape.d_model + 2 * shape.ffn) * act_bytes
    fixed = 2 * shape.d_model * act_bytes + logits_bytes(shape, seq, act_bytes) / seq
    back = min(shape.n_layers, prefetch + 1) * one_input
    return {"inputs": inputs, "one_block": block, "backward_transients": work, "embeddings_and_logits": round(fixed, 1),
            "records_back": back, "bound": (inputs + block + work + fixed) / (block + work + fixed + back)}


def _finer(shape: ModelShape, budget: int, batch: int, act_bytes: int, chunk: int) -> dict:
    """Issue 41's ratio with the model options that shrink what stays (Note [chunked cross-entropy],
    Note [checkpoints finer than a block]): the longest sequence ``budget`` holds. Before: the same
    model (the loss chunked) without activation offload, checkpointed at the granularity that is best
    without offload (both tried: a block keeps one input, halves keep two but recompute less); after:
    offload="auto"'s plan (inputs offloaded) with the halves. Each option alone beside it."""
    from dataclasses import replace
    chunked = replace(shape, loss_chunk=chunk)
    longest = {}
    for name, s, nvme in (("before_block", chunked, 0), ("before_half", replace(chunked, checkpoint_parts=2), 0),
                          ("after_block_chunked", chunked, 1 << 50),
                          ("after_half_full_logits", replace(shape, checkpoint_parts=2), 1 << 50),
                          ("after_half_chunked", replace(chunked, checkpoint_parts=2), 1 << 50)):
        longest[name] = longest_sequence(s, batch, act_bytes, device=budget, host=0, nvme=nvme)
    before = max(longest["before_block"], longest["before_half"])
    after = longest["after_half_chunked"]
    kept, stays = _per_token(chunked, before, act_bytes), _per_token(replace(chunked, checkpoint_parts=2), after, act_bytes)
    return {"loss_chunk": chunk, "longest": longest, "before": before,
            "before_granularity": "block" if longest["before_block"] >= longest["before_half"] else "half",
            "after": after, "ratio": after / max(1, before),
            "per_token_bytes": {"before_block": kept, "after_half": stays},
            # (all checkpointing alone holds per token at its length ÷ what stays with every input offloaded at
            # the after's: equal to the ratio when both fill the budget, i.e. the plan moves all that can move)
            "bound": (kept["inputs"] + kept["one_block"] + kept["backward_transients"] + kept["embeddings_and_logits"])
            / (stays["one_block"] + stays["backward_transients"] + stays["embeddings_and_logits"]
               + stays["records_back"]),
            "mixed_planner": _finer_mixed(chunked, budget, batch, act_bytes)}


def _finer_mixed(chunked: ModelShape, budget: int, batch: int, act_bytes: int) -> dict:
    """The same before / after as the mixed plan counts them (Note [mixed activation plans]: the offloader
    checkpointing the blocks; an upper bound of the peak, like the checkpointed plan above, which counts
    backward's transients and the records brought back the same way since the seventh session)."""
    from dataclasses import replace
    from zeroshard.planner.activation_mix import longest_mixed
    half = replace(chunked, checkpoint_parts=2)
    out = {"before_block": longest_mixed(chunked, batch, act_bytes, device=budget, host=0, nvme=0),
           "before_half": longest_mixed(half, batch, act_bytes, device=budget, host=0, nvme=0),
           "after_half": longest_mixed(half, batch, act_bytes, device=budget, host=0, nvme=1 << 50)}
    return {**out, "ratio": out["after_half"] / max(1, out["before_block"], out["before_half"])}


def part_longest(args: argparse.Namespace) -> dict:
    from dataclasses import replace
    cfg = _config(args, True)
    model = TinyGPT(cfg)
    shape = replace(_shape(cfg, model), loss_chunk=0, checkpoint_parts=1)
    budget = int(args.budget_mib * 2**20)
    before = longest_sequence(shape, args.batch, 4, device=budget, host=0, nvme=0)
    after = longest_sequence(shape, args.batch, 4, device=budget, host=0, nvme=1 << 40)
    # (beside it, not instead: a 7B-class decoder in bf16 under a budget of the same proportion to its
    # per-token bytes, micro-batch 1; what bounds the ratio is the same there)
    big = ModelShape(n_params=6_740_000_000, n_layers=32, d_model=4096, n_heads=32, vocab=32000, d_ff=11008,
                     name="7B-class (Llama-2 shape)")
    big_budget = 16 * 2**30
    big_before = longest_sequence(big, 1, 2, device=big_budget, host=0, nvme=0)
    big_after = longest_sequence(big, 1, 2, device=big_budget, host=0, nvme=1 << 44)
    shape = replace(shape, loss_chunk=0, checkpoint_parts=1)  # (the rows above: the full logits, one checkpoint a block)
    return {"part": "longest sequence (planner)", "budget": budget, "checkpointing_alone": before,
            "with_offload": after, "ratio": after / max(1, before),
            "per_token_bytes": _per_token(shape, after, 4),
            "finer": _finer(shape, budget, args.batch, 4, args.loss_chunk or 1024),
            "7b_class_bf16": {"budget": big_budget, "checkpointing_alone": big_before, "with_offload": big_after,
                              "ratio": big_after / max(1, big_before), "per_token_bytes": _per_token(big, big_after, 2),
                              "finer": _finer(big, big_budget, 1, 2, args.loss_chunk or 1024)}}


def _trains(args: argparse.Namespace, seq: int, recompute: bool, joint: Optional[bool] = None) -> bool:
    """A TinyGPT not checkpointed by the model trains ``args.steps`` steps at ``seq`` tokens under
    offload="auto" with ``--budget-mib`` (the state and the activations in it), the activations planned
    (``PlannedActivations(checkpointed=False, recompute=...)``); False: the plan refused the sequence.
    ``joint`` not None: the model checkpoints its blocks, and the shape is declared (True: state and
    activations planned together at construction) or measured at the first forward (False: planned
    together there, the state placed again: Note [state re-placed at the first forward])."""
    cfg = GPTConfig(**{**_config(args, joint is not None).__dict__, "seq_len": seq})
    torch.manual_seed(0)
    model = TinyGPT(cfg)
    planned = (zeroshard.PlannedActivations(checkpointed=False, recompute=recompute) if joint is None else
               zeroshard.PlannedActivations(micro_batch=args.batch, seq_len=seq) if joint else
               zeroshard.PlannedActivations())
    try:
        opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-3, stage=args.stage, offload="auto",
                                      memory_budget={"host": int(args.budget_mib * 2**20), "reserve": 0},
                                      nvme_path=args.dir, offload_activations=planned,
                                      **({"bucket_size_mb": args.bucket_mb} if args.bucket_mb else {}))
    except ValueError:
        return False
    try:
        for step in range(args.steps):
            model(*synthetic_batch(step, args.batch, cfg)).backward()
            opt.step()
            opt.zero_grad()
        return True
    except ValueError:  # (the plan's refusal: no plan of this kind holds the sequence in the budget)
        return False
    finally:
        opt.close()


def _longest_trained(args: argparse.Namespace, recompute: bool, joint: Optional[bool] = None) -> tuple[int, list]:
    """The longest sequence (a multiple of ``--seq-step``) that trains, by bisection over real runs."""
    step, tried = args.seq_step, []
    low, high = 0, args.seq_max // step + 1  # (low trains or is 0, high does not)
    while high - low > 1:
        mid = (low + high) // 2
        ok = _trains(args, mid * step, recompute, joint)
        tried.append((mid * step, ok))
        low, high = (mid, high) if ok else (low, mid)
    return low * step, tried


def part_mix(args: argparse.Namespace) -> dict:
    """The longest sequence a model not checkpointed by the user trains under one fixed ``--budget-mib``
    (Note [mixed activation plans]): before, the plan keeps or moves each block's saved tensors
    (``recompute=False``); after, it also checkpoints blocks, keeping or moving their inputs."""
    import warnings
    warnings.filterwarnings("ignore", message="offload='auto'")
    before, tried_before = _longest_trained(args, False)
    after, tried_after = _longest_trained(args, True)
    return {"part": "longest sequence, blocks not checkpointed by the model (trained)", "budget": args.budget_mib,
            "keep_or_move": before, "mixed_plan": after, "ratio": after / max(1, before),
            "tried": {"keep_or_move": tried_before, "mixed_plan": tried_after}}


def _step_peak(args: argparse.Namespace, seq: int, granularity: str, offload: bool) -> int:
    """The peak of live tensor bytes (tests/support/live_bytes.py) of the second step's forward and
    backward of a TinyGPT checkpointed at ``granularity``, its loss chunked by ``--loss-chunk`` (0: the full
    logits), at ``seq`` tokens, stage 2; ``offload``: every block's checkpointed inputs to NVMe (the fully
    offloaded plan, which the planner picks at the longest sequence)."""
    from tests.support.live_bytes import LiveBytes
    cfg = GPTConfig(**{**_config(args, True).__dict__, "seq_len": seq, "checkpoint_granularity": granularity})
    torch.manual_seed(0)
    model = TinyGPT(cfg)
    extra = dict(nvme_path=args.dir, offload_activations=zeroshard.ActivationOffload(
        where="nvme", min_bytes=0, prefetch=args.prefetch)) if offload else {}
    opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-3, stage=2, **extra)
    try:
        for step in range(2):
            with LiveBytes() as live:
                model(*synthetic_batch(step, args.batch, cfg)).backward()
            opt.step()
            opt.zero_grad()
        return live.peak
    finally:
        opt.close()


def part_finer_runs(args: argparse.Namespace) -> dict:
    """Real runs of issue 41's before / after with the model options that shrink what stays: the longest
    sequence (a multiple of ``--seq-step``, by bisection) whose step's peak of live tensor bytes is within
    ``--budget-mib`` (activations, gradients and backward's transients; the parameters and optimizer state
    outside it). Before: checkpointing alone at block and at half granularity (no activation offload);
    after: ``--after-granularity`` (halves by default), every input on NVMe. Beside it, the planner's
    longest for the same budget."""
    from dataclasses import replace
    budget = int(args.budget_mib * 2**20)
    after = f"after_{args.after_granularity}"
    out: dict = {"part": "longest sequence, live bytes within the budget (trained)", "budget": budget,
                 "loss_chunk": args.loss_chunk, "prefetch": args.prefetch, "tried": {}}
    for name, granularity, offload in (("before_block", "block", False), ("before_half", "half", False),
                                       (after, args.after_granularity, True)):
        step, tried = args.seq_step, []
        low, high = 0, args.seq_max // step + 1
        while high - low > 1:
            mid = (low + high) // 2
            peak = _step_peak(args, mid * step, granularity, offload)
            tried.append((mid * step, peak))
            low, high = (mid, high) if peak <= budget else (low, mid)
        out[name], out["tried"][name] = low * step, tried
    before = max(out["before_block"], out["before_half"])
    out["ratio"] = out[after] / max(1, before)
    cfg = _config(args, True)
    shape = replace(_shape(cfg, TinyGPT(cfg)), checkpoint_parts=1)
    out["planner"] = {"before_block": longest_sequence(shape, args.batch, 4, device=budget, host=0, nvme=0),
                      after: longest_sequence(replace(shape, checkpoint_parts=1 if args.after_granularity == "block"
                                                      else 2), args.batch, 4, device=budget, host=0, nvme=1 << 50)}
    return out


def _io_floor(directory: str, sizes: list[int], rounds: int) -> float:
    """Seconds to write ``sizes`` bytes as one file each and read them back through the offloader's
    engine (``AsyncIO()``: O_DIRECT where the file system takes it), median of ``rounds``."""
    from zeroshard.io.aio_engine import AsyncIO
    io = AsyncIO()
    bufs = [torch.randint(0, 255, (n,), dtype=torch.uint8) for n in sizes]
    times = []
    try:
        for r in range(rounds):
            paths = [os.path.join(directory, f"floor-{r}-{i}.bin") for i in range(len(sizes))]
            t = time.perf_counter()
            for h in [io.pwrite(b, path) for b, path in zip(bufs, paths)]:
                h.wait()
            for h in [io.pread(b, path) for b, path in zip(bufs, paths)]:
                h.wait()
            times.append(time.perf_counter() - t)
            for path in paths:
                os.remove(path)
    finally:
        io.close()
    return sorted(times)[len(times) // 2]


def _run_child(args: argparse.Namespace, mode: str) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", mode, "--dir", args.dir, "--steps", str(args.steps),
           "--layers", str(args.layers), "--d-model", str(args.d_model), "--seq-len", str(args.seq_len),
           "--batch", str(args.batch)]
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, check=True)
    return json.loads([ln for ln in p.stdout.splitlines() if ln.startswith("{")][-1])


def part_floor(args: argparse.Namespace) -> dict:
    """Alternating runs (checkpointed, offloaded, then the floor of the bytes the offloaded run
    moved), ``--rounds`` times; the ratios are medians of each round's own ratio."""
    rounds = []
    for _ in range(args.rounds):
        plain = _run_child(args, "checkpoint")
        off = _run_child(args, "offload")
        moved = off["moved_per_step"]
        per_block = moved // 2 // args.layers  # (out and back; one file per checkpointed block call)
        io_s = _io_floor(args.dir, [per_block] * args.layers, 3)
        rounds.append({"checkpointed_step_s": plain["step_s"], "offloaded_step_s": off["step_s"],
                       "bytes_moved_per_step": moved, "io_floor_s": io_s,
                       "step_over_floor": off["step_s"] / max(plain["step_s"], io_s),
                       "exposed_io_over_floor": (off["step_s"] - plain["step_s"]) / io_s})
    med = lambda k: sorted(r[k] for r in rounds)[len(rounds) // 2]  # noqa: E731
    return {"part": "floor", "rounds": rounds, "step_over_floor": med("step_over_floor"),
            "exposed_io_over_floor": med("exposed_io_over_floor"), "goal": "step_over_floor <= 1.2"}


def part_cgroup(args: argparse.Namespace) -> dict:
    if os.geteuid() != 0 or not os.path.isdir(CGROUP_ROOT):
        return {"part": "cgroup", "skipped": f"needs root and cgroup v1 memory control at {CGROUP_ROOT}"}
    limit = int(args.limit_mib * 2**20)
    cfg = _config(args, False)
    shape = _shape(cfg, TinyGPT(cfg))
    from zeroshard.planner.activations import activation_bytes
    acts = activation_bytes(shape, args.batch, args.seq_len, 4, checkpointing=False)
    runs = [_in_cgroup(args, mode, limit) for mode in ("offload", "checkpoint", "plain")]
    return {"part": "cgroup", "limit": limit, "activations_without_checkpointing": acts,
            "activations_over_limit": acts / limit, "runs": runs}


def gpu_check(args: argparse.Namespace) -> dict:  # pragma: no cover - needs a GPU
    """Prepared for a GPU session: per-token step time with inputs on the host vs in memory."""
    if not torch.cuda.is_available():
        return {"part": "gpu", "skipped": "no CUDA device: not measured"}
    cfg = GPTConfig(vocab=32000, d_model=2048, n_layers=24, n_heads=16, seq_len=args.gpu_seq_len,
                    activation_checkpointing=True)
    out = {}
    for name, seq, offload in (("in memory", args.gpu_fit_seq_len, None), ("offloaded", args.gpu_seq_len, "cpu")):
        c = GPTConfig(**{**cfg.__dict__, "seq_len": seq})
        torch.manual_seed(0)
        model = TinyGPT(c).cuda().bfloat16()
        opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-4, stage=2,
                                      **({"offload_activations": offload} if offload else {}))
        times = []
        for step in range(6):
            x, y = synthetic_batch(step, 1, c)
            torch.cuda.synchronize()
            t = time.perf_counter()
            model(x.cuda(), y.cuda()).backward()
            opt.step()
            opt.zero_grad()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        out[name] = {"seq_len": seq, "step_s": sorted(times[2:])[len(times[2:]) // 2],
                     "per_token_s": sorted(times[2:])[len(times[2:]) // 2] / seq}
        opt.close()
        del model, opt
        torch.cuda.empty_cache()
    out["per_token_ratio"] = out["offloaded"]["per_token_s"] / out["in memory"]["per_token_s"]
    return {"part": "gpu", **out}


def part_joint(args: argparse.Namespace) -> dict:
    """The longest sequence a checkpointed TinyGPT trains under one fixed ``--budget-mib`` with the state
    competing for it (Note [joint state and activation plan]), the shape measured at the first forward
    and declared (``--shapes``)."""
    import warnings
    warnings.filterwarnings("ignore", message="offload='auto'")
    out: dict = {"part": "longest sequence, state and activations under one budget (trained)",
                 "budget": args.budget_mib, "tried": {}}
    for shape in args.shapes.split(","):
        out[shape], out["tried"][shape] = _longest_trained(args, True, shape == "declared")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--child", choices=("offload", "checkpoint", "plain"))
    p.add_argument("--dir", default=None, help="directory for the activation files (an NVMe drive)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--limit-mib", type=float, default=900)
    p.add_argument("--budget-mib", type=float, default=512, help="device budget of part 3")
    p.add_argument("--parts", default="bytes,longest,cgroup",
                   help="which of bytes, longest, cgroup, floor, mix, joint, finer to run")
    p.add_argument("--bucket-mb", type=float, default=0, help="part joint: bucket_size_mb (small: finer units)")
    p.add_argument("--stage", type=int, default=2, choices=(1, 2, 3), help="parts mix and joint: the ZeRO stage")
    p.add_argument("--shapes", default="measured,declared",
                   help="part joint: the micro-batch's shape measured at the first forward, declared, or both")
    p.add_argument("--seq-step", type=int, default=64, help="part mix: sequences tried are multiples of this")
    p.add_argument("--seq-max", type=int, default=16384, help="part mix: the longest sequence tried")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds of part floor")
    p.add_argument("--granularity", choices=("block", "half"), default="block",
                   help="TinyGPT's checkpoint_granularity in the parts that train (mix, joint, bytes, ...)")
    p.add_argument("--loss-chunk", type=int, default=0,
                   help="TinyGPT's loss_chunk in the parts that train (0: the full logits); part longest's "
                        "'finer' rows: the chunk (0 there: 1024 tokens)")
    p.add_argument("--after-granularity", choices=("block", "half"), default="half",
                   help="part finer: the offloaded run's checkpoint_granularity")
    p.add_argument("--prefetch", type=int, default=2, help="part finer: the offloaded run's records brought back ahead")
    p.add_argument("--gpu", action="store_true")
    p.add_argument("--gpu-seq-len", type=int, default=32768)
    p.add_argument("--gpu-fit-seq-len", type=int, default=8192)
    args = p.parse_args()
    if args.child:
        return child(args)
    args.dir = args.dir or tempfile.mkdtemp(prefix="zs-act-")
    if args.gpu:
        print(json.dumps(gpu_check(args)), flush=True)
        return
    parts = {"bytes": part_bytes, "longest": part_longest, "cgroup": part_cgroup, "floor": part_floor,
             "mix": part_mix, "joint": part_joint, "finer": part_finer_runs}
    for name in args.parts.split(","):
        print(json.dumps(parts[name](args)), flush=True)


if __name__ == "__main__":
    main()
