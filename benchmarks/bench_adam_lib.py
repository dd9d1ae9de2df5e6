"""Interleaved CPU Adam measurements shared by ``bench_adam.py`` (pytest-benchmark and CLI).

Every candidate runs once per round, in rotating order, on the same buffers; times are
medians over rounds, and each ratio is the median over rounds of the ratio within a round,
so machine noise (other processes on the 2 cores, whose load drifts during a run) hits the
candidates it compares alike. Nothing here asserts on absolute time.

Two stages are measured:

* ``fp32``: a plain fp32 AdamW step (28 bytes/param: read p, g, m, v; write p, m, v).
  Peers: ``torch._fused_adamw_`` (what ``AdamW(fused=True)`` runs), DeepSpeedCPUAdam when
  ``deepspeed`` imports, and the *same-bytes sweep* - a C loop that reads the same 4 fp32
  arrays and writes the same 3 with no arithmetic, i.e. the memory ceiling of this machine.
* ``mixed``: the optimizer stage of a bf16 mixed-precision step - global grad norm of the
  bf16 gradients, unscale by the loss scale and clip, AdamW on fp32 master weights, bf16 copy
  of the updated params. Ours: a norm pass + one fused pass. Torch: every composition we know
  (see ``torch_mixed_*``); the best one per workload is the peer.
"""
from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from zeroshard.ops import adam_step_multi_
from zeroshard.ops._loader import REGISTRY

LR, BETA1, BETA2, EPS, WD = 1e-3, 0.9, 0.999, 1e-8, 0.01
LOSS_SCALE, MAX_NORM = 1024.0, 1.0

# Bytes moved per parameter, not counting write-allocate reads of written lines.
BYTES_FP32 = 28
BYTES_MIXED = {
    "zeroshard": 2 + (2 + 24 + 2),  # norm reads g (bf16); fused: g, p/m/v read+write, out (bf16)
    "torch_upcast_gradscale": 2 + (2 + 4) + (8 + 24) + (4 + 2),  # norm; upcast; fused (g r+w); copy_
    "torch_clip_then_step": 2 + (2 + 4) + 8 + (4 + 24) + (4 + 2),  # norm; upcast; scale g; fused; copy_
    "inductor": 2 + (2 + 24 + 2),  # one generated loop, like ours
}


@dataclass(frozen=True)
class Workload:
    """A parameter count split into one tensor or into ``pieces`` tensors of mixed sizes."""

    numel: int
    pieces: int

    @property
    def label(self) -> str:
        return f"{self.numel // 1_000_000}M x {self.pieces} tensor{'s' if self.pieces > 1 else ''}"

    def sizes(self) -> list[int]:
        if self.pieces == 1:
            return [self.numel]
        # Transformer-like mix: many large matrices, some mid-size, a tail of small vectors.
        gen = torch.Generator().manual_seed(0)
        weights = torch.rand(self.pieces, generator=gen) ** 3 + 1e-4
        sizes = (weights / weights.sum() * self.numel).long().clamp(min=1)
        sizes[0] += self.numel - int(sizes.sum())
        return [int(s) for s in sizes]


@dataclass
class Buffers:
    """Flat fp32 p, g, m, v (+ bf16 g, bf16 out) and per-tensor views into them."""

    workload: Workload
    flat: dict[str, torch.Tensor] = field(default_factory=dict)
    views: dict[str, list[torch.Tensor]] = field(default_factory=dict)

    @classmethod
    def allocate(cls, workload: Workload, mixed: bool) -> Buffers:
        n = workload.numel
        flat = {"p": torch.empty(n).uniform_(-1, 1), "g": torch.empty(n).uniform_(-1e-2, 1e-2),
                "m": torch.zeros(n), "v": torch.zeros(n)}
        if mixed:
            flat["g16"] = flat["g"].bfloat16()
            flat["out"] = torch.empty(n, dtype=torch.bfloat16)
        sizes = workload.sizes()
        views = {k: list(torch.split(t, sizes)) for k, t in flat.items()}
        return cls(workload, flat, views)


def measure(candidates: dict[str, Callable[[], None]], rounds: int, warmup: int = 1) -> dict[str, list[float]]:
    """Seconds per candidate and round, every candidate once per round (rotating order)."""
    names = list(candidates)
    for _ in range(warmup):
        for name in names:
            candidates[name]()
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            start = time.perf_counter()
            candidates[name]()
            samples[name].append(time.perf_counter() - start)
    return samples


def _steps(n: int) -> list[torch.Tensor]:
    return [torch.tensor(1.0) for _ in range(n)]


def fp32_candidates(buf: Buffers) -> dict[str, Callable[[], None]]:
    """Plain fp32 AdamW: ours, torch fused, DeepSpeedCPUAdam (if importable), the sweep."""
    v = buf.views
    steps = _steps(len(v["p"]))
    module = REGISTRY.cpu().module
    if module is None:
        raise RuntimeError(f"CPU kernel unavailable: {REGISTRY.cpu().reason}")
    cands: dict[str, Callable[[], None]] = {
        "zeroshard": lambda: adam_step_multi_(v["p"], v["g"], v["m"], v["v"], step=1, lr=LR, beta1=BETA1,
                                              beta2=BETA2, eps=EPS, weight_decay=WD, adamw_mode=True),
        "torch_fused": lambda: torch._fused_adamw_(v["p"], v["g"], v["m"], v["v"], [], steps, lr=LR, beta1=BETA1,
                                                   beta2=BETA2, weight_decay=WD, eps=EPS, amsgrad=False,
                                                   maximize=False),
        "sweep": lambda: module.copy_sweep(buf.flat["p"], buf.flat["g"], buf.flat["m"], buf.flat["v"]),
    }
    ds = deepspeed_step(buf)
    if ds is not None:
        cands["deepspeed"] = ds
    return cands


def deepspeed_step(buf: Buffers) -> Callable[[], None] | None:
    """DeepSpeedCPUAdam over the same buffers (its state pre-seeded with ours), or None."""
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except Exception:  # not installed, or its JIT build failed: no peer to compare with
        return None
    params = []
    for p, g in zip(buf.views["p"], buf.views["g"]):
        param = torch.nn.Parameter(p, requires_grad=True)
        param.grad = g
        params.append(param)
    opt = DeepSpeedCPUAdam(params, lr=LR, betas=(BETA1, BETA2), eps=EPS, weight_decay=WD, adamw_mode=True)
    for param, m, v in zip(params, buf.views["m"], buf.views["v"]):
        opt.state[param] = {"step": 0, "exp_avg": m, "exp_avg_sq": v}
    return opt.step


def _global_grad_norm(grads: list[torch.Tensor]) -> float:
    # One read of each bf16 gradient, the same pass for both sides. _foreach_norm accumulates
    # in fp32 internally; asking for an fp32 result (dtype=) or upcasting first is ~20x slower
    # on CPU in torch 2.13 (a non-vectorised conversion path), so neither side does that.
    norms = torch._foreach_norm(grads)
    return float(torch.linalg.vector_norm(torch.stack(norms).float())) / LOSS_SCALE


def _clip_coef(grads: list[torch.Tensor]) -> float:
    return min(1.0, MAX_NORM / (_global_grad_norm(grads) + 1e-6))


def mixed_candidates(buf: Buffers) -> dict[str, Callable[[], None]]:
    """The mixed-precision optimizer stage: ours and the torch compositions."""
    v = buf.views
    steps = _steps(len(v["p"]))

    def ours() -> None:
        scale = _clip_coef(v["g16"]) / LOSS_SCALE
        adam_step_multi_(v["p"], v["g16"], v["m"], v["v"], step=1, lr=LR, beta1=BETA1, beta2=BETA2, eps=EPS,
                         weight_decay=WD, adamw_mode=True, grad_scale=scale, out_lowps=v["out"])

    def torch_mixed_upcast_gradscale() -> None:
        # Upcast into a preallocated fp32 buffer, fold unscale+clip into the fused kernel's
        # grad_scale (it divides, and writes the unscaled gradient back), then copy out.
        inv = torch.tensor(LOSS_SCALE / _clip_coef(v["g16"]))
        torch._foreach_copy_(v["g"], v["g16"])
        torch._fused_adamw_(v["p"], v["g"], v["m"], v["v"], [], steps, lr=LR, beta1=BETA1, beta2=BETA2,
                            weight_decay=WD, eps=EPS, amsgrad=False, maximize=False, grad_scale=inv,
                            found_inf=torch.tensor(0.0))
        torch._foreach_copy_(v["out"], v["p"])

    def torch_mixed_clip_then_step() -> None:
        # What clip_grad_norm_ + a plain fused step does: scale the fp32 gradient in place.
        coef = _clip_coef(v["g16"]) / LOSS_SCALE
        torch._foreach_copy_(v["g"], v["g16"])
        torch._foreach_mul_(v["g"], coef)
        torch._fused_adamw_(v["p"], v["g"], v["m"], v["v"], [], steps, lr=LR, beta1=BETA1, beta2=BETA2,
                            weight_decay=WD, eps=EPS, amsgrad=False, maximize=False)
        torch._foreach_copy_(v["out"], v["p"])

    cands = {"zeroshard": ours, "torch_upcast_gradscale": torch_mixed_upcast_gradscale,
             "torch_clip_then_step": torch_mixed_clip_then_step}
    if len(v["p"]) == 1 and INDUCTOR:
        cands["inductor"] = inductor_stage(buf)
    return cands


# torch.compile of the whole stage is reported for information, not as "torch's composition":
# Inductor generates the same single fused loop (same bytes), so it lands at parity with ours.
# Single-tensor workloads only: over 200 tensors its compile time dominates a benchmark run.
INDUCTOR = True


def _stage_eager(p: torch.Tensor, g16: torch.Tensor, m: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 scale: torch.Tensor, step_size: float, bc2_sqrt: float) -> None:
    g = g16.float() * scale
    p.mul_(1 - LR * WD)
    m.lerp_(g, 1 - BETA1)
    v.mul_(BETA2).addcmul_(g, g, value=1 - BETA2)
    p.addcdiv_(m, (v.sqrt() / bc2_sqrt).add_(EPS), value=-step_size)
    out.copy_(p)


def inductor_stage(buf: Buffers) -> Callable[[], None]:
    compiled = torch.compile(_stage_eager, fullgraph=True, dynamic=False)
    v = buf.views

    def run() -> None:
        scale = torch.tensor(_clip_coef(v["g16"]) / LOSS_SCALE)
        compiled(v["p"][0], v["g16"][0], v["m"][0], v["v"][0], v["out"][0], scale, LR / (1 - BETA1),
                 (1 - BETA2) ** 0.5)

    run()  # compile outside the measurement
    return run


@dataclass(frozen=True)
class Result:
    """The per-round timings of one workload and one stage, and what derives from them."""

    stage: str
    workload: Workload
    samples: dict[str, list[float]]

    @property
    def seconds(self) -> dict[str, float]:
        """Median seconds per candidate."""
        return {name: statistics.median(s) for name, s in self.samples.items()}

    def ratio(self, peer: str) -> float:
        """Speed of ours relative to ``peer`` (> 1: ours is faster): the median over rounds of
        the ratio within each round, so a load change between rounds cancels out."""
        mine = self.samples["zeroshard"]
        return statistics.median(p / o for p, o in zip(self.samples[peer], mine))

    def best_torch(self) -> str:
        torch_names = [k for k in self.seconds if k.startswith("torch")]
        return min(torch_names, key=self.seconds.__getitem__)

    def gbps(self, name: str, bytes_per_param: int) -> float:
        return bytes_per_param * self.workload.numel / self.seconds[name] / 1e9


def run_stage(stage: str, workload: Workload, rounds: int) -> Result:
    buf = Buffers.allocate(workload, mixed=stage == "mixed")
    try:
        cands = fp32_candidates(buf) if stage == "fp32" else mixed_candidates(buf)
        return Result(stage, workload, measure(cands, rounds))
    finally:
        del buf
        gc.collect()


def format_result(res: Result) -> list[str]:
    lines = []
    if res.stage == "fp32":
        line = (f"fp32 AdamW   {res.workload.label:18s} ours {res.seconds['zeroshard'] * 1e3:7.1f} ms "
                f"({res.gbps('zeroshard', BYTES_FP32):5.1f} GB/s)  vs torch fused {res.ratio('torch_fused'):.3f}x")
        if "deepspeed" in res.seconds:
            line += f"  vs DeepSpeedCPUAdam {res.ratio('deepspeed'):.3f}x"
        line += f"  of sweep ceiling {res.ratio('sweep') * 100:5.1f}%"
        lines.append(line)
    else:
        best = res.best_torch()
        line = (f"mixed stage  {res.workload.label:18s} ours {res.seconds['zeroshard'] * 1e3:7.1f} ms "
                f"({BYTES_MIXED['zeroshard']} B/param)  best torch [{best}] {res.seconds[best] * 1e3:7.1f} ms "
                f"({BYTES_MIXED[best]} B/param)  speedup {res.ratio(best):.3f}x")
        if "inductor" in res.seconds:
            line += f"  (torch.compile of the stage: {res.ratio('inductor'):.3f}x)"
        lines.append(line)
    return lines
