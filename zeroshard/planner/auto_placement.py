"""``offload="auto"``: which state of each unit stays in memory and which streams from NVMe.

A pure planner (no tensors): the optimizer describes each flat unit (``UnitSpec``, its bytes
per kind of state on this rank), the budget and its fixed costs, and gets a ``Plan``: a tier
per unit and kind, the units whose stage-3 shards the parameter cache keeps between forward
and backward, and the bytes each step reads and writes. See Note [automatic placement].

Note [automatic placement]: the kinds of state of a unit are its stage-3 parameter shard,
its separate fp32 master (mixed precision), its fp32 gradient and its Adam moments. Each
one, kept on NVMe, costs a known number of bytes of disk traffic per step (``traffic``):

    kind     | held (bytes)       | moved per step on NVMe
    shard    | p·n                | read at each gather (2, the root unit 1) + written after the
             |                    | step (+ read by the step when the shard is the fp32 master);
             |                    | a frozen unit's (a LoRA base) is only read
    master   | 4·n                | read + written by the step
    grad     | 4·n (stages 0-1: the whole unit) | written per micro-batch, read back per
             |                    | micro-batch after the first and by the step (2k per k)
    moments  | 2·align(4·n_run)   | read + written by the step

Placing to move the least under a budget is a knapsack; the planner is greedy by bytes saved
per byte held (shards 3-4, the others 2) and fills what is left with any smaller item that
fits: every item kept saves at least as much per byte as any streamed item that would have
fit in its place, so it is within one item's traffic of the optimum. Among items of one
ratio, units are taken in bit-reversed order, so resident units alternate with streamed
ones and a streamed unit's reads overlap a resident unit's compute. What stays free after
that, one more gathered group may be read ahead where it fits (``deeper``: Note [prefetch
depth] in zeroshard/stages/stage3/gatherer.py), then comes the parameter cache: swapped shards
of the last units of forward (the first that backward gathers again) stay in memory from their
forward gather to their backward gather, saving one read each (1 byte saved per byte, so it
comes last). Frozen units (a LoRA base) are described after the trainable ones, a shard each,
so the cache, which prefers the highest indices, keeps frozen shards first.

Tiers: with an accelerator, "device" holds stage-3 shards (and, fixed, the model copy of
stages 0-2 and the gather buffers), "host" the optimizer side (masters, gradients, moments:
the fused CPU step, as ``offload_optimizer="nvme"``) and shards that do not fit the device,
"nvme" the rest. When everything fits the device budget nothing is offloaded. On a CPU-only
machine the model already lives in host memory: "device" and "host" are one memory whose
budget is their sum, and the split is memory vs NVMe. Budgets are per rank.

Note [what the budget covers]: the host budget is the process's resident memory, not only
the state's, since that is what a memory limit (a cgroup, a scheduler's) kills for. So the
fixed costs include ``Fixed.process``, the memory outside the training state: the budget's
``reserve`` when given, else what the process held when the optimizer was built (the
interpreter, torch, data) less the model's parameters (they become the state the plan
places), plus what the first backward initialises and 2% of the budget;
``Fixed.working``, backward's unsharded gradients of two units; and, on a CPU-only machine,
the released buffers the host pool keeps for reuse (``max_buffers`` of the largest unit
buffers: Note [reused host buffers] in zeroshard/io/host_pool.py). What neither sees (the
batch's activations) shows in the first step: its resident peak from the first backward
on is measured (VmHWM after a reset), and the parameter cache, the one placement that can
change at no cost, starts empty and is then given what that peak left of the budget
(zeroshard/offload/peak_memory.py). A step over the budget is a warning naming its peak and
the reserve that would fit. Glibc's retention of freed memory is switched off under a budget
(Note [freed memory goes back] there).
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from zeroshard.units.tier import Tier
from zeroshard.planner.sizes import fmt_bytes, parse_bytes

KINDS = ("shard", "master", "grad", "moments")


TIERS = tuple(t.value for t in Tier)
"""The tiers' names, as reports and ``Plan.bytes_by`` key them."""


def _budget_bytes(name: str, value: Any) -> int:
    """A size of ``memory_budget`` in bytes: a string such as "20GiB", or a finite number >= 0;
    anything else is refused naming ``name`` (never an OverflowError from int(inf))."""
    if isinstance(value, bool) or not isinstance(value, (str, numbers.Real)):
        raise TypeError(f"{name}={value!r} must be a size such as '20GiB' or a number of bytes")
    if isinstance(value, str) and value.strip().startswith("-"):
        raise ValueError(f"{name}={value!r} must be a size >= 0, e.g. '20GiB'")
    if isinstance(value, str):
        try:
            size = parse_bytes(value)
        except ValueError as exc:
            raise ValueError(f"{name}={value!r}: {exc}") from None
        except OverflowError:  # ("1e400GB" reads as a float infinity)
            raise ValueError(f"{name}={value!r} is too large to be a size; write e.g. '20GiB'") from None
    else:
        if not math.isfinite(value):
            raise ValueError(f"{name}={value!r} must be a finite number of bytes >= 0, e.g. 20 * 2**30 or '20GiB'")
        size = int(value) if isinstance(value, numbers.Integral) else int(float(value))  # (finite: checked above)
    if size < 0:
        raise ValueError(f"{name}={value!r} must be >= 0 bytes, e.g. '20GiB'")
    return size


@dataclass(frozen=True)
class MemoryBudget:
    """Bytes of memory this rank may use, per tier: the whole process's resident memory on
    the host (Note [what the budget covers]), the training state's on the device."""

    device: int = 0
    host: int = 0
    reserve: Optional[int] = None
    """Host memory outside the training state (interpreter, libraries, data, activations).
    None: measured as the optimizer is built, and corrected by the first steps' peak."""

    @classmethod
    def parse(cls, value: Any) -> "MemoryBudget":
        """``{"device": "20GiB", "host": "48GiB"}`` (either key may be left out, and
        ``"reserve"`` may be given), or one size (str or a number of bytes: int, float or a
        numpy scalar) for host memory."""
        if isinstance(value, MemoryBudget):
            return value
        if isinstance(value, (str, numbers.Real)) and not isinstance(value, bool):
            return cls(host=_budget_bytes("memory_budget", value))
        if not isinstance(value, Mapping) or not set(value) & {"device", "host"} or \
                set(value) - {"device", "host", "reserve"}:
            raise ValueError(f"memory_budget={value!r} must be a dict with 'device' and/or 'host' sizes (and "
                             "optionally 'reserve'), e.g. {'device': '20GiB', 'host': '48GiB'}")
        return cls(**{k: _budget_bytes(f"memory_budget[{k!r}]", v) for k, v in value.items()})

    def __str__(self) -> str:
        return f"device {fmt_bytes(self.device)}, host {fmt_bytes(self.host)}"


@dataclass(frozen=True)
class UnitSpec:
    """One unit's state on this rank, in bytes (0: the kind does not exist or cannot move)."""

    index: int
    shard: int
    master: int
    grad: int
    moments: int
    shard_reads: int = 2
    """Gathers per step that read the shard (the root unit stays gathered: 1)."""
    master_in_shard: bool = False
    """The shard is the fp32 master (stage 3 in fp32): the step reads it too."""
    root: bool = False
    frozen: bool = False
    """A frozen unit (Note [frozen units] in zeroshard/stages/stage3/frozen.py): a shard only,
    read by its gathers and never written."""

    def size(self, kind: str) -> int:
        return getattr(self, kind)

    def traffic(self, kind: str, cached: bool = False, micro_batches: int = 1) -> tuple[int, int]:
        """(read, written) bytes per step when ``kind`` is on NVMe."""
        n = self.size(kind)
        if kind == "shard":
            return (n * ((self.shard_reads - int(cached)) * micro_batches + int(self.master_in_shard)),
                    0 if self.frozen else n)
        if kind == "grad":
            return n * micro_batches, n * micro_batches
        return n, n


@dataclass(frozen=True)
class Fixed:
    """Memory the plan cannot move: per tier, and the NVMe pipeline's staging if anything streams."""

    device: int = 0
    host: int = 0
    staging: int = 0
    """Host memory of the NVMe pipeline's units in flight (gradients written behind backward, the
    step's read-ahead) when anything streams."""
    pool: int = 0
    """Host memory of the moments' pool slots: held during the step only, so the parameter cache
    (held from forward to backward) may use it."""
    samples_per_byte: float = 1 / 512
    """Host memory of a swap file's page samples per byte of it (Note [zero-fill detection])."""
    process: int = 0
    """Of ``host``: the process's memory outside the training state (the budget's reserve, or
    what was resident when the optimizer was built, less the model's parameters)."""
    working: int = 0
    """Of ``device`` (one memory: ``host``): backward's unsharded gradients, which autograd
    makes for a unit before the reducer takes them (two units at once)."""
    group: int = 0
    """Stage 3: bytes of the widest group of units gathered together (a block's trainable and
    frozen units), of which ``device`` counts ``max_live_units`` (and the root's)."""
    budget_share: int = 0
    """0, or n: ``host`` (one memory: ``host``) includes 1/n of the host budget itself (the
    margin a measured reserve adds: Note [what the budget covers]), so the smallest budget
    that fits must count 1/n of *itself*, not of the budget that was refused (and 1% more for
    the measurement, which moves from one attempt to the next)."""
    share_bytes: int = 0
    """The bytes of that share in ``host``, for the budget being planned."""


@dataclass(frozen=True)
class Plan:
    units: tuple[UnitSpec, ...]
    tiers: tuple[tuple[Tier, ...], ...]
    """Per unit, the tier of each kind (``KINDS`` order)."""
    cached: frozenset[int]
    """Units whose swapped shard stays in memory from forward to backward."""
    budget: Optional[MemoryBudget]
    fixed: Fixed
    accelerator: bool
    mode: str
    """"auto", or "explicit" for offload_optimizer / offload_params given by hand."""
    reasons: tuple[str, ...] = field(default=())
    deeper: int = 0
    """Bytes of the one group more that stage 3 may gather or read ahead (``offload="auto"``
    with ``max_live_units`` unset, when streamed shards leave room for it: Note [prefetch
    depth] in zeroshard/stages/stage3/gatherer.py); 0: the usual two groups."""

    def tier(self, index: int, kind: str) -> Tier:
        return self.tiers[index][KINDS.index(kind)]

    def swapped(self, index: int) -> tuple[str, ...]:
        """What ``NvmeUnitStore`` keeps of the unit (moments live in ``NvmeOptimizerState``)."""
        return tuple(k for k in ("shard", "master", "grad") if self.tier(index, k) == Tier.NVME
                     and self.units[index].size(k))

    @property
    def streams(self) -> bool:
        return any(t == Tier.NVME for ts in self.tiers for t in ts)

    @property
    def offloads(self) -> bool:
        """State streams, or (with an accelerator) lives in host memory: the host-side step of
        ``NvmeOptimizerState`` then runs, as with ``offload_optimizer="nvme"``."""
        return self.streams or (self.accelerator and any(t == Tier.HOST for ts in self.tiers for t in ts))

    def bytes_by(self) -> dict[str, dict[str, int]]:
        out = {k: {t: 0 for t in TIERS} for k in KINDS}
        for u, ts in zip(self.units, self.tiers):
            for k, t in zip(KINDS, ts):
                out[k][t] += u.size(k)
        return out

    def step_io(self, micro_batches: int = 1) -> dict[str, int]:
        """Bytes the swap files read and write per training step (after the first, whose
        moments start at zero), with ``micro_batches`` backward passes per step."""
        read = written = 0
        for u, ts in zip(self.units, self.tiers):
            for k, t in zip(KINDS, ts):
                if t == Tier.NVME and u.size(k):
                    r, w = u.traffic(k, u.index in self.cached, micro_batches)
                    read, written = read + r, written + w
        return {"read": read, "written": written}

    def memory(self) -> dict[str, int]:
        """Predicted peak bytes per memory tier: resident state, fixed costs, cache, staging."""
        by = self.bytes_by()
        out = {t: sum(by[k][t] for k in KINDS) for t in ("device", "host")}
        out["device"] += self.fixed.device
        nvme = sum(by[k]["nvme"] for k in KINDS)
        out["host"] += self.fixed.host + self.deeper + (self.fixed.staging + int(nvme * self.fixed.samples_per_byte)
                                          + max(self.fixed.pool, sum(self.units[i].shard for i in self.cached))
                                          if self.streams else 0)
        if not self.accelerator:
            return {"device": 0, "host": out["device"] + out["host"]}
        return out


class PlacementError(ValueError):
    """No placement fits the budget; the message gives the smallest budget that does
    (``minimum``: bytes per tier; ``state``: bytes of all the state to place)."""

    def __init__(self, message: str, minimum: dict[str, int], state: int) -> None:
        super().__init__(message)
        self.minimum = minimum
        self.state = state


def _order(kind: str, spec: UnitSpec, micro_batches: int) -> float:
    r, w = spec.traffic(kind, micro_batches=micro_batches)
    return (r + w) / max(1, spec.size(kind))


def plan_auto(units: list[UnitSpec], budget: MemoryBudget, fixed: Fixed, *, accelerator: bool,
              nvme: bool, micro_batches: int = 1, deeper: int = 0) -> Plan:
    """The placement that moves the fewest bytes per step within ``budget`` (Note [automatic
    placement]); ``PlacementError`` with the smallest feasible budget when none fits.
    ``deeper``: the bytes of one more gathered group, taken from what the state leaves when
    shards stream (``Plan.deeper``), before the parameter cache."""
    state = sum(u.size(k) for u in units for k in KINDS)
    if accelerator:
        caps = {"device": budget.device - fixed.device, "host": budget.host - fixed.host}
    else:  # one memory: its budget is the sum, its fixed costs all of them
        caps = {"device": 0, "host": budget.device + budget.host - fixed.device - fixed.host}
    resident = Tier.DEVICE if accelerator else Tier.HOST
    if 0 <= state <= caps[resident] and caps["host"] >= 0:
        return Plan(tuple(units), tuple(tuple(resident for _ in KINDS) for _ in units), frozenset(), budget,
                    fixed, accelerator, "auto",
                    (f"all {fmt_bytes(state)} of state fits the budget ({budget}) beside "
                     f"{fmt_bytes(fixed.device + fixed.host)} of fixed memory: nothing is offloaded",))
    need = _minimum(units, fixed, accelerator, nvme, state)
    minimum = _fmt_min(need, accelerator)
    if nvme:
        caps["host"] -= fixed.staging + fixed.pool + int(state * fixed.samples_per_byte)
    if caps["host"] < 0 or caps["device"] < 0:
        raise PlacementError(
            f"memory_budget ({budget}) is below what this rank needs with everything it can stream on "
            f"NVMe (the model's working copy, gather buffers, NVMe staging buffers{_outside(fixed)}): the "
            f"smallest budget "
            f"that fits is {minimum}; raise memory_budget, or lower offload_buffer_mb / make units smaller "
            "(stage3_unit_numel, bucket_size_mb)" if nvme else
            f"memory_budget ({budget}) cannot hold this rank's {fmt_bytes(state)} of training state beside "
            f"{fmt_bytes(fixed.device + fixed.host)} of fixed memory, and without nvme_path nothing can "
            f"stream from disk: the smallest budget that fits is {minimum}; raise memory_budget or pass "
            "nvme_path=<directory on an NVMe drive>", need, state)
    spread = _spread(len(units))
    items = sorted(((u, k) for u in units for k in KINDS if u.size(k)),
                   key=lambda uk: (-_order(uk[1], uk[0], micro_batches), spread[uk[0].index], KINDS.index(uk[1])))
    chosen: dict[tuple[int, str], Tier] = {}
    for u, k in items:  # greedy by bytes moved per byte held, then whatever still fits
        for t in ((Tier.DEVICE, Tier.HOST) if k == "shard" and accelerator else (Tier.HOST,)):
            if u.size(k) <= caps[t]:
                caps[t] -= u.size(k)
                chosen[(u.index, k)] = t
                break
        else:
            chosen[(u.index, k)] = Tier.NVME
    streamed = sum(u.size(k) for u in units for k in KINDS if chosen.get((u.index, k)) == Tier.NVME)
    if streamed and not nvme:
        raise PlacementError(
            f"memory_budget ({budget}) cannot hold this rank's {fmt_bytes(state)} of training state, and "
            f"without nvme_path nothing can stream from disk: the smallest budget that fits is {minimum}; "
            "raise memory_budget or pass nvme_path=<directory on an NVMe drive>", need, state)
    tiers = tuple(tuple(chosen.get((u.index, k), resident) for k in KINDS) for u in units)
    streams_shards = any(chosen.get((u.index, "shard")) == Tier.NVME for u in units)
    deeper = deeper if 0 < deeper <= caps["host"] and streams_shards else 0
    caps["host"] -= deeper
    cached: set[int] = set()
    room = caps["host"] + fixed.pool  # what is left, and the pool (idle from forward to backward)
    for u in sorted(units, key=lambda u: -u.index):  # last of forward first: backward wants them first
        if not u.root and chosen.get((u.index, "shard")) == Tier.NVME and u.shard <= room:
            room -= u.shard
            cached.add(u.index)
    reasons = [f"{fmt_bytes(state)} of state does not fit the budget ({budget}) beside "
               f"{fmt_bytes(fixed.device + fixed.host)} of fixed memory{_outside(fixed)}"
               + (f" and {fmt_bytes(fixed.staging + fixed.pool)} of NVMe staging buffers" if streamed else ""),
               "kept in memory by bytes moved per byte held: shards first (3-4), then masters, "
               f"gradients, moments and frozen shards (2); {fmt_bytes(streamed)} streams from NVMe"]
    if deeper:
        reasons.append(f"prefetch: one more unit group ({fmt_bytes(deeper)}) may be read ahead, so stage 3 "
                       "reads two groups ahead of the one in use")
    if cached:
        reasons.append(f"parameter cache: the shards of {len(cached)} unit(s) "
                       f"({fmt_bytes(sum(units[i].shard for i in cached))}) stay in memory from forward to "
                       "backward (in memory the step's pool frees), one read less each per step")
    return Plan(tuple(units), tiers, frozenset(cached), budget, fixed, accelerator, "auto", tuple(reasons),
                deeper=deeper)


def _outside(fixed: Fixed) -> str:
    if not (fixed.process or fixed.working):
        return ""
    return (f"; of it {fmt_bytes(fixed.process)} outside the training state (interpreter, libraries, data: "
            f"Note [what the budget covers]) and {fmt_bytes(fixed.working)} of backward's gradients")


def _spread(n: int) -> list[int]:
    """A rank per unit index such that the first m ranks are spread evenly over the units (bit
    reversal): resident units then alternate with streamed ones, so reads of the next unit
    overlap the compute of a resident one in forward, backward and the step."""
    bits = max(1, (n - 1).bit_length())
    order = [r for r in (int(f"{i:0{bits}b}"[::-1], 2) for i in range(1 << bits)) if r < n]
    rank = [0] * n
    for pos, i in enumerate(order):
        rank[i] = pos
    return rank


def _minimum(units: list[UnitSpec], fixed: Fixed, accelerator: bool, nvme: bool, state: int) -> dict[str, int]:
    if not nvme:  # everything resident
        if accelerator:
            shards = sum(u.shard for u in units)
            need = {"device": fixed.device + shards, "host": fixed.host + state - shards}
        else:
            need = {"device": 0, "host": fixed.device + fixed.host + state}
    else:
        staging = fixed.staging + fixed.pool + int(state * fixed.samples_per_byte)
        if accelerator:
            need = {"device": fixed.device, "host": fixed.host + staging}
        else:
            need = {"device": 0, "host": fixed.device + fixed.host + staging}
    if fixed.budget_share > 1:  # the smallest M with M >= rest + M // n: the named budget fits itself
        n, rest = fixed.budget_share, need["host"] - fixed.share_bytes
        need["host"] = -(-rest * n // (n - 1))
        # ... plus 1%: the reserve is measured, and a process that retries (or a fresh one) holds a
        # little more or less than this one did (a refused attempt's model, allocator state)
        need["host"] += need["host"] // 100
    return need


def _fmt_min(m: dict[str, int], accelerator: bool) -> str:
    """The minimum as a budget to pass, rounded *up* (a value rounded down would not fit)."""
    if accelerator:
        up = {k: math.ceil(m[k] / 2**20 * 10) / 10 for k in ("device", "host")}
        return f"{{'device': '{up['device']:.1f}MiB', 'host': '{up['host']:.1f}MiB'}}"
    return f"{{'host': '{-(-m['host'] // 2**20)}MiB'}} (device and host are one memory here)"


def plan_explicit(units: list[UnitSpec], fixed: Fixed, *, accelerator: bool, optimizer: Tier, params: Tier,
                  options: str) -> Plan:
    """The placement ``offload_optimizer`` / ``offload_params`` (``options``, as the user gave
    them) give every unit, as a ``Plan`` (for ``placement_report``)."""
    def where(tier: Tier) -> Tier:  # (on a CPU-only machine the model's device is host memory)
        return Tier.HOST if tier is Tier.DEVICE and not accelerator else tier
    tiers = tuple((where(params), where(optimizer), where(optimizer), where(optimizer)) for _ in units)
    return Plan(tuple(units), tiers, frozenset(), None, fixed, accelerator, "explicit",
                (f"explicit: {options} for every unit",))


def report_text(plan: Plan, measured: Optional[dict[str, float]] = None) -> str:
    """A person's view of a plan: bytes per kind and tier, the step's predicted traffic, why."""
    by = plan.bytes_by()
    tiers = [t for t in TIERS if any(by[k][t] for k in KINDS)] or ["host"]
    lines = [f"placement ({plan.mode}" + (f", budget {plan.budget}" if plan.budget else "") + ")",
             "  kind     " + "".join(f"{t:>12}" for t in tiers)]
    for k in KINDS:
        lines.append(f"  {k:<9}" + "".join(f"{fmt_bytes(by[k][t]):>12}" for t in tiers))
    io = plan.step_io()
    lines.append(f"  per step from NVMe: read {fmt_bytes(io['read'])}, written {fmt_bytes(io['written'])}"
                 + (f" (measured so far: read {fmt_bytes(measured['read'])}, written "
                    f"{fmt_bytes(measured['written'])})" if measured else ""))
    lines += [f"  - {r}" for r in plan.reasons]
    return "\n".join(lines)
