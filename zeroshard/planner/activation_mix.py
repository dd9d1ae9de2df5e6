"""``plan_mixed``: per block of a model that does not checkpoint its blocks itself, keep / move all
saved tensors / checkpoint / checkpoint + input moved, the least predicted time within the budget
(Note [mixed activation plans]).

Note [mixed activation plans]: a model whose blocks are not checkpointed by the user
(``PlannedActivations(checkpointed=False)``) gets from the offloader whatever place the plan picks
per block: "keep" (its saved tensors stay), "saved-host" / "saved-nvme" (every saved tensor
moves), "checkpoint" (the offloader runs it under ``torch.utils.checkpoint``, its input stays),
"host" / "nvme" (checkpointed, its input moves). The time of a place is the speed model of Note
[planning activations] (a recompute at ``Links.flops``, a move out and back at the link's
bandwidth); every count of kept, saved-moved and checkpointed blocks is tried (the checkpointed
inputs stay while they fit, the moved bytes go to host memory first), and the plan with the least
predicted extra time that fits is kept (ties: the fewest blocks changed). The device memory is
order-aware: the blocks are laid out moved first (saved-moved, then input-moved), then
checkpointed, then kept, so that in backward the kept blocks (the last ones, whose backward runs
first) are freed before any recompute; the peak is the larger of backward's start (what stays:
the embeddings' and logits' activations, the kept blocks, the kept inputs, and the last
``prefetch`` moved records brought back as backward starts), a checkpointed block's recompute (the kept blocks
freed: one block's saved tensors, the kept inputs, those moved records) and a moved block's
backward (the blocks after it freed: one block's saved tensors and the moved records in flight,
the current one and ``prefetch`` ahead), each with the running block's backward transients (the
gradients of its output and input and of the MLP's two hidden tensors). It is an upper bound: it counts the embeddings' and
logits' activations for the whole backward.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from zeroshard.planner.activation_plan import ActivationPlan, Links, _sizes, largest_fitting
from zeroshard.planner.model_shape import ModelShape

MIX_PLACES = ("saved-host", "saved-nvme", "host", "nvme", "checkpoint", "keep")
"""The places of a mixed plan, in the order the blocks are laid out (first block first)."""
RECOMPUTED = frozenset({"checkpoint", "host", "nvme"})
"""The places whose block the offloader runs under ``torch.utils.checkpoint``."""


@dataclass(frozen=True)
class _Mix:
    block: int
    input: int
    fixed: int
    recompute: float
    prefetch: int
    work: int
    """One block's backward transients: its output's gradient, its input's, the MLP's two hidden ones."""
    recomputed: int = -1
    """What a checkpointed block holds while it is recomputed (-1: ``block``; less with checkpoints
    finer than a block: ``recompute_elements``)."""

    @property
    def running(self) -> int:
        return self.block if self.recomputed < 0 else self.recomputed


def mixed_peak(s: _Mix, keep: int, kept_inputs: int, records: list[int], saved: int = 0) -> int:
    """Device bytes at the plan's peak (Note [mixed activation plans]); ``records``: the moved
    records' sizes in forward order, the first ``saved`` of them a block's saved tensors (the rest
    checkpointed inputs)."""
    tail = sum(records[-s.prefetch:]) if records else 0
    start = s.fixed + keep * s.block + kept_inputs * s.input + tail
    checkpointed = s.fixed + kept_inputs * s.input + s.running + tail if kept_inputs else 0
    moved = (s.fixed + (s.block if saved else s.running) + sum(sorted(records, reverse=True)[:s.prefetch + 1])
             if records else 0)
    return max(start, checkpointed, moved) + s.work


def _choose(s: _Mix, n_layers: int, device: int, host: int, nvme: int, links: Links) -> Optional[ActivationPlan]:
    best: Optional[tuple[float, int, ActivationPlan]] = None
    host_s = 2 / links.host_bandwidth
    nvme_s = 2 * (1 / links.nvme_bandwidth + 1 / links.host_bandwidth)
    for keep in range(n_layers, -1, -1):
        for saved in range(0, n_layers - keep + 1):
            ckpt = n_layers - keep - saved
            def fits(kept: int) -> bool:
                return mixed_peak(s, keep, kept, [s.block] * saved + [s.input] * (ckpt - kept), saved) <= device
            if not fits(0):
                continue
            low, high = 0, ckpt + 1  # (the most kept inputs that fit: the peak grows with them)
            while high - low > 1:
                mid = (low + high) // 2
                low, high = (mid, high) if fits(mid) else (low, mid)
            kept_inputs = low
            moved_in = ckpt - kept_inputs
            for saved_first in (True, False):  # (host memory first, filled by blocks or by inputs first)
                if saved_first:
                    sh = min(saved, host // max(1, s.block))
                    ih = min(moved_in, (host - sh * s.block) // max(1, s.input))
                else:
                    ih = min(moved_in, host // max(1, s.input))
                    sh = min(saved, (host - ih * s.input) // max(1, s.block))
                sn, inn = saved - sh, moved_in - ih
                nvme_bytes = sn * s.block + inn * s.input
                if nvme_bytes > nvme:
                    continue
                host_bytes = sh * s.block + ih * s.input
                seconds = ckpt * s.recompute + host_bytes * host_s + nvme_bytes * nvme_s
                places = (("saved-host",) * sh + ("saved-nvme",) * sn + ("host",) * ih + ("nvme",) * inn
                          + ("checkpoint",) * kept_inputs + ("keep",) * keep)
                records = [s.block] * saved + [s.input] * moved_in
                plan = ActivationPlan(places, mixed_peak(s, keep, kept_inputs, records, saved), host_bytes, nvme_bytes,
                                      2 * (host_bytes + nvme_bytes), seconds)
                changed = n_layers - keep
                if best is None or (seconds, changed) < best[:2]:
                    best = (seconds, changed, plan)
    return None if best is None else best[2]


def mix_sizes(shape: ModelShape, micro_batch: int, seq_len: int, act_bytes: int, *, links: Links = Links(),
              block_bytes: Optional[int] = None, prefetch: int = 2) -> _Mix:
    s = _sizes(shape, micro_batch, seq_len, act_bytes, links, False)
    work = micro_batch * seq_len * (2 * shape.d_model + 2 * shape.ffn) * act_bytes
    if block_bytes is None:
        return _Mix(s.block, s.input, s.fixed, s.recompute, prefetch, work, s.running)
    # (a block's saved bytes measured: the recomputed part scaled as the estimate has it, to the measurement)
    running = block_bytes if shape.checkpoint_parts == 1 else -(-block_bytes * s.running // max(1, s.block))
    return _Mix(block_bytes, s.input, s.fixed, s.recompute, prefetch, work, running)


def best_mixed(shape: ModelShape, micro_batch: int, seq_len: int, act_bytes: int, *, device: int, host: int,
               nvme: int = 0, links: Links = Links(), prefetch: int = 2) -> Optional[ActivationPlan]:
    """As ``plan_mixed`` with the estimated block, None where no plan fits (no refusal message)."""
    s = mix_sizes(shape, micro_batch, seq_len, act_bytes, links=links, prefetch=prefetch)
    return _choose(s, shape.n_layers, device, host, nvme, links)


def plan_mixed(shape: ModelShape, micro_batch: int, seq_len: int, act_bytes: int, *, device: int, host: int,
               nvme: int = 0, links: Links = Links(), block_bytes: Optional[int] = None,
               prefetch: int = 2) -> ActivationPlan:
    """The mixed plan (Note [mixed activation plans]) with the least predicted extra time per
    micro-batch of ``micro_batch x seq_len`` within ``device`` / ``host`` / ``nvme`` bytes;
    ``block_bytes`` (one block's saved tensors, measured) replaces the estimate. A ValueError naming
    the longest sequence and the device memory needed when none fits."""
    s = mix_sizes(shape, micro_batch, seq_len, act_bytes, links=links, block_bytes=block_bytes, prefetch=prefetch)
    found = _choose(s, shape.n_layers, device, host, nvme, links)
    if found is not None:
        return found
    least = mixed_peak(s, 0, 0, [s.input] * shape.n_layers)
    per_token = None if block_bytes is None else block_bytes / (micro_batch * seq_len)
    longest = longest_mixed(shape, micro_batch, act_bytes, device=device, host=host, nvme=nvme, links=links,
                            per_token=per_token, prefetch=prefetch, below=seq_len)
    raise ValueError(
        f"activations of a micro-batch of {micro_batch} x {seq_len} tokens do not fit {device / 2**30:.2f} GiB of "
        f"device memory even with every block checkpointed and its input moved (host {host / 2**30:.2f} GiB, NVMe "
        f"{nvme / 2**30:.2f} GiB): the longest sequence that fits is {longest} tokens; at {seq_len} tokens the "
        f"device needs at least {least / 2**30:.2f} GiB for activations")


def longest_mixed(shape: ModelShape, micro_batch: int, act_bytes: int, *, device: int, host: int, nvme: int = 0,
                  links: Links = Links(), per_token: Optional[float] = None, prefetch: int = 2,
                  below: int = 1 << 24) -> int:
    """The longest sequence (< ``below``) with a mixed plan within the budgets; 0 if none.
    ``per_token``: one block's saved bytes per token, measured (None: the estimate)."""
    def fits(seq: int) -> bool:
        block = None if per_token is None else int(per_token * micro_batch * seq + 0.5)
        s = mix_sizes(shape, micro_batch, seq, act_bytes, links=links, block_bytes=block, prefetch=prefetch)
        return _choose(s, shape.n_layers, device, host, nvme, links) is not None
    return largest_fitting(fits, below)


def runs(places: tuple[str, ...]) -> str:
    """Per block, as runs: "blocks 0-22 nvme, 23-30 checkpoint, 31 keep"."""
    out: list[str] = []
    start = 0
    for i in range(1, len(places) + 1):
        if i == len(places) or places[i] != places[start]:
            out.append(f"{start}-{i - 1} {places[start]}" if i - 1 > start else f"{start} {places[start]}")
            start = i
    return "blocks " + ", ".join(out)


def mixed_for_estimate(shape: ModelShape, layers: int, micro_batch: int, seq_len: int, act_bytes: int,
                       left: dict) -> dict:
    """``zeroshard estimate``'s plan for a model that does not checkpoint its blocks itself
    (``PlannedActivations(checkpointed=False)``, Note [mixed activation plans]), in the memory the
    state leaves (``left``: device_left, host_left, nvme_left, as ``for_estimate`` gives them)."""
    staged = replace(shape, n_layers=layers)
    try:
        p = plan_mixed(staged, micro_batch, seq_len, act_bytes, device=left["device_left"],
                       host=left["host_left"], nvme=left["nvme_left"])
    except (ValueError, KeyError) as exc:
        return {"error": str(exc)}
    return {"per_block": list(p.blocks), "blocks": p.counts(), "device_bytes": p.device_bytes,
            "host_bytes": p.host_bytes, "nvme_bytes": p.nvme_bytes, "moved_per_step": p.moved_per_step,
            "summary": f"{runs(p.blocks)}; moved per step {p.moved_per_step / 2**30:.2f} GiB"}
