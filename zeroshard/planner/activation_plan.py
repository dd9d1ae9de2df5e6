"""``ActivationPlan``: per block, where a micro-batch's activations wait for backward, within what
memory the state leaves (Note [planning activations]).

Note [planning activations]: each block can keep its saved tensors on the device ("keep"), be
checkpointed and keep only its input ("checkpoint"), or be checkpointed with its input moved to
host memory ("host") or to NVMe ("nvme"; offload_activations, Note [activation offload] in
zeroshard/offload/activations/offloader.py). What stays on the device whatever the plan: the
embeddings' and logits' activations, and one block's saved tensors while it is recomputed
(once any block is checkpointed). The blocks of a decoder are alike, so a plan is four counts;
every split is tried and the one with the least predicted extra time per step kept: a recompute
costs the block's forward (2 x block parameters x tokens FLOPs at ``flops``), a move the input's
bytes twice (out and back) at the link's bandwidth. A budget that cannot hold even the plan
with every input on NVMe is refused naming the longest sequence, and the smallest device
budget, that fit. Blocks the model does not checkpoint (``plan_saved``) can only keep their
saved tensors or move them all (to host or NVMe): no recompute, so the plan keeps as many as fit
and moves the rest; beside what stays, the block running and the blocks prefetched ahead of its
backward are on the device. A block checkpointed in parts (``ModelShape.checkpoint_parts``) keeps
every part's input and, recomputed, holds the larger part (``recompute_elements``); a chunked loss
(``ModelShape.loss_chunk``) holds one chunk's logits (``logits_bytes``). Like the mixed plan it
also counts the running block's backward transients (its output's and input's gradients, the MLP's
two hidden ones) and, once inputs move, the records brought back ahead of backward (the running
block's and ``prefetch`` more): without them a plan whose inputs all moved predicted less than the
live tensor bytes a TinyGPT reached (tests/offload/test_activation_offload_finer.py).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable, Optional

from zeroshard.planner.activations import (block_activation_elements, checkpoint_input_elements, logits_bytes,
                                           recompute_elements)
from zeroshard.planner.model_shape import ModelShape

if TYPE_CHECKING:
    from zeroshard.planner.estimate import Estimate, Plan

PLACES = ("keep", "checkpoint", "host", "nvme")


@dataclass(frozen=True)
class Links:
    """What a recompute and a move cost (defaults: an H100-class GPU, PCIe 4 x16, one NVMe drive)."""

    flops: float = 300e12
    host_bandwidth: float = 20e9
    nvme_bandwidth: float = 3e9


@dataclass(frozen=True)
class ActivationPlan:
    blocks: tuple[str, ...]
    """Per block, in order: one of ``PLACES``."""
    device_bytes: int
    host_bytes: int
    nvme_bytes: int
    moved_per_step: int
    """Bytes moved off the device and back per micro-batch (2 x the inputs offloaded)."""
    extra_seconds: float
    """Predicted time added per micro-batch: recomputes and moves."""

    def counts(self) -> dict[str, int]:
        return {p: self.blocks.count(p) for p in PLACES if p in self.blocks}

    def summary(self) -> str:
        parts = ", ".join(f"{n} {p}" for p, n in self.counts().items())
        return (f"{parts}; device {self.device_bytes / 2**30:.2f} GiB, host {self.host_bytes / 2**30:.2f} GiB, "
                f"NVMe {self.nvme_bytes / 2**30:.2f} GiB, moved per step {self.moved_per_step / 2**30:.2f} GiB")


@dataclass(frozen=True)
class _Sizes:
    block: int
    """One block's saved tensors (bytes)."""
    input: int
    """One block's checkpointed input (bytes): what its checkpoints keep (one per part)."""
    fixed: int
    """Embeddings' and logits' activations (bytes): on the device whatever the plan."""
    recompute: float
    """Seconds to recompute one block's forward."""
    recomputed: int = -1
    """What one checkpointed block holds while it is recomputed (bytes; -1: ``block``)."""
    work: int = 0
    """One block's backward transients (bytes): its output's gradient, its input's, the MLP's two hidden
    ones (as the mixed plan counts them: Note [mixed activation plans])."""

    @property
    def running(self) -> int:
        return self.block if self.recomputed < 0 else self.recomputed


def _sizes(shape: ModelShape, micro_batch: int, seq_len: int, act_bytes: int, links: Links,
           eager_attention: bool) -> _Sizes:
    tokens = micro_batch * seq_len
    block = block_activation_elements(shape, tokens, seq_len, eager_attention) * act_bytes
    fixed = 2 * tokens * shape.d_model * act_bytes + logits_bytes(shape, tokens, act_bytes)
    return _Sizes(block, checkpoint_input_elements(shape, tokens) * act_bytes, fixed,
                  2 * shape.block_params * tokens / links.flops,
                  recompute_elements(shape, tokens, seq_len, eager_attention) * act_bytes,
                  tokens * (2 * shape.d_model + 2 * shape.ffn) * act_bytes)


def _best(s: _Sizes, n_layers: int, device: int, host: int, nvme: int, links: Links,
          prefetch: int = 2) -> Optional[ActivationPlan]:
    best: Optional[ActivationPlan] = None
    for keep in range(n_layers, -1, -1):
        rest = n_layers - keep
        # (Note [planning activations]: the running block's backward transients, and, once inputs move,
        # the records brought back ahead of backward: the running block's and ``prefetch`` more)
        working = s.fixed + keep * s.block + (s.running if rest else 0) + s.work
        if working > device:
            continue
        room = (device - working) // max(1, s.input)  # (inputs the device can hold beside what stays)
        ckpt = rest if room >= rest else max(0, room - (prefetch + 1))
        moved = rest - ckpt
        working += min(moved, prefetch + 1) * s.input
        if working + ckpt * s.input > device:
            continue
        on_host = min(moved, host // max(1, s.input))
        on_nvme = moved - on_host
        if on_nvme * s.input > nvme:
            continue
        seconds = (rest * s.recompute + on_host * 2 * s.input / links.host_bandwidth
                   + on_nvme * 2 * s.input * (1 / links.nvme_bandwidth + 1 / links.host_bandwidth))
        plan = ActivationPlan(("keep",) * keep + ("checkpoint",) * ckpt + ("host",) * on_host + ("nvme",) * on_nvme,
                              working + ckpt * s.input, on_host * s.input, on_nvme * s.input,
                              2 * moved * s.input, seconds)
        if best is None or plan.extra_seconds < best.extra_seconds:
            best = plan
    return best


def _best_saved(s: _Sizes, n_layers: int, device: int, host: int, nvme: int, links: Links,
                prefetch: int, most_kept: int) -> Optional[ActivationPlan]:
    """Blocks not checkpointed (Note [planning activations]): each keeps its saved tensors ("keep")
    or moves them all ("host", "nvme"); the least moved that fits (no recompute: a move is the only
    cost). Besides what stays, the block running, the ``prefetch`` blocks brought back ahead of its
    backward and one more (forward's staging copy of a block being written, on a CPU-only machine)
    are on the device, and the running block's backward transients."""
    for keep in range(min(n_layers, most_kept), -1, -1):
        moved = n_layers - keep
        # (one more record than the running one and the ``prefetch`` brought back, as the mixed plan counts:
        # on a CPU-only machine the staging copy of a record being written in forward is that block)
        working = s.fixed + keep * s.block + ((2 + prefetch) * s.block if moved else 0) + s.work
        if working > device:
            continue
        on_host = min(moved, host // max(1, s.block))
        on_nvme = moved - on_host
        if on_nvme * s.block > nvme:
            continue
        seconds = (on_host * 2 * s.block / links.host_bandwidth
                   + on_nvme * 2 * s.block * (1 / links.nvme_bandwidth + 1 / links.host_bandwidth))
        return ActivationPlan(("keep",) * keep + ("host",) * on_host + ("nvme",) * on_nvme, working,
                              on_host * s.block, on_nvme * s.block, 2 * moved * s.block, seconds)
    return None


def plan_saved(shape: ModelShape, micro_batch: int, seq_len: int, act_bytes: int, *, device: int, host: int,
               nvme: int = 0, links: Links = Links(), block_bytes: Optional[int] = None,
               prefetch: int = 2, most_kept: int = 1 << 30) -> ActivationPlan:
    """As ``plan_activations`` for blocks the model does not checkpoint: keep, or move all their saved
    tensors; ``block_bytes`` (one block's saved tensors, measured) replaces the estimate, and at most
    ``most_kept`` blocks keep theirs (0: every block moves, before a measurement). A ValueError
    naming the device memory needed when even every block moved does not fit."""
    s = _sizes(shape, micro_batch, seq_len, act_bytes, links, False)
    if block_bytes is not None:
        s = replace(s, block=block_bytes)
    found = _best_saved(s, shape.n_layers, device, host, nvme, links, prefetch, most_kept)
    if found is None:
        raise ValueError(
            f"activations of a micro-batch of {micro_batch} x {seq_len} tokens, blocks not checkpointed, do not fit "
            f"{device / 2**30:.2f} GiB of device memory even with every block's saved tensors moved (host "
            f"{host / 2**30:.2f} GiB, NVMe {nvme / 2**30:.2f} GiB): the device needs at least "
            f"{(s.fixed + (2 + prefetch) * s.block + s.work) / 2**30:.2f} GiB; checkpoint the blocks "
            "(torch.utils.checkpoint, use_reentrant=False, and PlannedActivations(checkpointed=True)) to need less, "
            "or let the plan checkpoint them: PlannedActivations(checkpointed=False, recompute=True)")
    return found


def best_activations(shape: ModelShape, micro_batch: int, seq_len: int, act_bytes: int, *, device: int, host: int,
                     nvme: int = 0, links: Links = Links(), eager_attention: bool = False,
                     prefetch: int = 2) -> Optional[ActivationPlan]:
    """As ``plan_activations``, None where no plan fits (no refusal message: the joint search asks often)."""
    return _best(_sizes(shape, micro_batch, seq_len, act_bytes, links, eager_attention), shape.n_layers, device,
                 host, nvme, links, prefetch)


def plan_activations(shape: ModelShape, micro_batch: int, seq_len: int, act_bytes: int, *, device: int,
                     host: int, nvme: int = 0, links: Links = Links(), eager_attention: bool = False,
                     prefetch: int = 2) -> ActivationPlan:
    """The plan with the least extra time per micro-batch of ``micro_batch x seq_len`` that fits
    ``device`` / ``host`` / ``nvme`` bytes (what the state leaves); a ValueError naming the longest
    sequence and the smallest device budget that fit when none does."""
    for name, value in (("micro_batch", micro_batch), ("seq_len", seq_len), ("act_bytes", act_bytes)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be an int >= 1")
    s = _sizes(shape, micro_batch, seq_len, act_bytes, links, eager_attention)
    found = _best(s, shape.n_layers, device, host, nvme, links, prefetch)
    if found is not None:
        return found
    movable = min(shape.n_layers, (host + nvme) // max(1, s.input))
    smallest = (s.fixed + s.running + s.work + (shape.n_layers - movable) * s.input
                + min(movable, prefetch + 1) * s.input)
    longest = longest_sequence(shape, micro_batch, act_bytes, device=device, host=host, nvme=nvme, links=links,
                               eager_attention=eager_attention, below=seq_len, prefetch=prefetch)
    fits = (f"the longest sequence that fits is {longest} tokens" if longest else
            "no sequence fits (the embeddings and one block's tensors alone are over it)")
    raise ValueError(
        f"activations of a micro-batch of {micro_batch} x {seq_len} tokens do not fit {device / 2**30:.2f} GiB of "
        f"device memory even with every block checkpointed and its input offloaded (host {host / 2**30:.2f} GiB, "
        f"NVMe {nvme / 2**30:.2f} GiB): {fits}; at {seq_len} tokens the device needs at least "
        f"{smallest / 2**30:.2f} GiB for activations")


def longest_sequence(shape: ModelShape, micro_batch: int, act_bytes: int, *, device: int, host: int,
                     nvme: int = 0, links: Links = Links(), eager_attention: bool = False,
                     below: int = 1 << 24, prefetch: int = 2) -> int:
    """The longest sequence (< ``below``) whose activations have a plan within the budgets; 0 if none."""
    def fits(seq: int) -> bool:
        s = _sizes(shape, micro_batch, seq, act_bytes, links, eager_attention)
        return _best(s, shape.n_layers, device, host, nvme, links, prefetch) is not None
    return largest_fitting(fits, below)


def largest_fitting(fits: Callable[[int], bool], below: int) -> int:
    """The largest sequence (< ``below``) that ``fits``; 0 if none."""
    low, high = 0, below
    while high - low > 1:  # (memory grows with the sequence: the largest that fits, by bisection)
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low


def for_estimate(result: "Plan", links: Links = Links()) -> dict:
    """The activation plan beside ``zeroshard estimate``'s table, planned jointly with the state (Note
    [joint state and activation plan] in joint_plan.py): of the choices whose state fits (activations
    left out), the one whose state traffic plus best activation plan in the memory it leaves per rank
    is predicted fastest (ties: the cheapest choice by ``Choice.relative_cost``, the state-first pick).
    A choice's state traffic: what it keeps on NVMe read and written once per step, and what it keeps
    off the device (host or NVMe) crossing the host link once per step (gradients down, weights up)."""
    hw, w, shape = result.hardware, result.workload, result.shape
    states_fit = [e for e in result.estimates
                  if e.gpu_states.model_states + e.gpu_states.buffers <= hw.gpu_memory * hw.usable_fraction
                  and e.cpu_total <= hw.cpu_memory * hw.usable_fraction and e.nvme_total <= hw.nvme]
    if not states_fit:
        return {"config": None, "error": "no choice holds the state itself"}
    states_fit.sort(key=lambda x: (round(x.choice.relative_cost, 6), x.gpu_total))
    per_rank = max(1, hw.n_gpus)
    layers = max(1, shape.n_layers // w.pp)
    staged = replace(shape, n_layers=layers)

    def left(e: "Estimate") -> dict:
        return {"config": e.choice.zero_kwargs(), "micro_batch": w.micro_batch, "seq_len": w.seq_len,
                "device_left": int(hw.gpu_memory * hw.usable_fraction) - e.gpu_states.model_states - e.gpu_states.buffers,
                "host_left": max(0, int(hw.cpu_memory * hw.usable_fraction) - e.cpu_total) // per_rank,
                "nvme_left": max(0, hw.nvme - e.nvme_total) // per_rank}

    def state_bytes(e: "Estimate") -> dict:
        return {"nvme": 2 * e.nvme_per_rank, "host_link": e.cpu_per_rank + e.nvme_per_rank}

    best: Optional[tuple[float, int, dict, ActivationPlan]] = None
    first_error: Optional[tuple[dict, str]] = None
    sequential: Optional[float] = None
    for i, e in enumerate(states_fit):
        out = left(e)
        try:
            p = plan_activations(staged, w.micro_batch, w.seq_len, w.param_bytes, device=out["device_left"],
                                 host=out["host_left"], nvme=out["nvme_left"], eager_attention=w.eager_attention)
        except ValueError as exc:
            first_error = first_error or (out, str(exc))
            continue
        moved = state_bytes(e)
        seconds = moved["nvme"] / links.nvme_bandwidth + moved["host_link"] / links.host_bandwidth + p.extra_seconds
        if i == 0:
            sequential = seconds
        if best is None or seconds < best[0]:
            best = (seconds, i, {**out, "state_bytes_moved": moved}, p)
    if best is None:
        roomiest = max(states_fit, key=lambda e: left(e)["device_left"])
        out = left(roomiest)
        try:
            plan_activations(staged, w.micro_batch, w.seq_len, w.param_bytes, device=out["device_left"],
                             host=out["host_left"], nvme=out["nvme_left"], eager_attention=w.eager_attention)
        except ValueError as exc:
            return {**out, "error": str(exc)}
        return {**first_error[0], "error": first_error[1]} if first_error else {**out, "error": "no plan"}
    seconds, i, out, p = best
    joint = {"candidates": len(states_fit), "chosen": states_fit[i].choice.label, "sequential": i == 0,
             "sequential_config": states_fit[0].choice.label, "predicted_seconds": seconds,
             "sequential_seconds": sequential,
             "bytes_moved_per_step": {"state_nvme": out["state_bytes_moved"]["nvme"],
                                      "state_host_link": out["state_bytes_moved"]["host_link"],
                                      "activations": p.moved_per_step}}
    return {**out, "blocks": p.counts(), "device_bytes": p.device_bytes, "host_bytes": p.host_bytes,
            "nvme_bytes": p.nvme_bytes, "moved_per_step": p.moved_per_step, "joint": joint,
            "summary": (f"{p.summary()}; state and activations planned together: {joint['chosen']} of "
                        f"{len(states_fit)} choices whose state fits, {seconds * 1e3:.1f} ms predicted per step"
                        + ("" if i == 0 else f" (the state-first pick, {joint['sequential_config']}: "
                           + ("its activations do not fit" if sequential is None else f"{sequential * 1e3:.1f} ms")
                           + ")")),
            "offload_activations": ("nvme" if p.nvme_bytes else "cpu") if p.moved_per_step else None}
