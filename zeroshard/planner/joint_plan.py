"""``plan_joint``: ``offload="auto"``'s state placement and activation plan chosen together, the
pair with the least predicted step time (Note [joint state and activation plan]).

Note [joint state and activation plan]: the state planner (Note [automatic placement] in
auto_placement.py) keeps in memory what moves the most bytes per byte held, and the activation
planner (Note [planning activations], Note [mixed activation plans]) fits a micro-batch's
activations into what the state leaves. Run one after the other, the state takes the memory
first: a budget the state fills forces activations to NVMe (or refuses the sequence) even where
streaming a little optimizer state instead would cost less, or let the sequence fit at all. So
with a declared micro-batch shape (``PlannedActivations(micro_batch=, seq_len=)``) the two are
planned together. The candidates are the state placements the greedy itself goes through as
memory shrinks (``state_candidates``): the plan under the budget (the sequential one, first), then
the plans under the budget less the items the greedy gives up first (its order reversed: the
lowest bytes moved per byte held first), one more each time, on the tier the activations use
(the device with an accelerator: its shards, the optimizer side then going to host memory; the
one memory on a CPU: every kind). For each, the best activation plan in what that placement
leaves of the *real* budget is found, and the pair with the least predicted time per step is
kept: the state's traffic (NVMe bytes read and written at ``Links.nvme_bandwidth``; with an
accelerator and anything offloaded, the gradients down, the parameters back up and the shards
read from host memory at ``Links.host_bandwidth``) plus the activation plan's recomputes and
moves (``ActivationPlan.extra_seconds``). Ties keep the earlier candidate, so a budget where the
sequential plan is as fast keeps it. If no candidate's activations fit, the refusal is the one
of the candidate that leaves the activations the most memory: the longest sequence it names is
the longest that fits under the joint search. Cost: at most ``most`` (48) state plans (each a sort
of the units' items) and as many activation plans (the checkpointed planner is O(blocks^2), the
mixed one O(blocks^3 log blocks)), each first a quick fit test without a refusal message (whose
bisections for the longest sequence and the smallest budget run once, for the refusal only):
milliseconds for a TinyGPT, about a second for 32 blocks mixed, once at construction. Without a declared shape the
same search runs at the first forward, with the micro-batch measured there, and the state is moved to the chosen
placement before the first block (Note [state re-placed at the first forward] in zeroshard/offload/placement_replan.py).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Optional

from zeroshard.planner.activation_plan import ActivationPlan, Links
from zeroshard.planner.auto_placement import (KINDS, Fixed, MemoryBudget, Plan, PlacementError, UnitSpec, _order,
                                              _spread, plan_auto)
from zeroshard.planner.sizes import fmt_bytes
from zeroshard.units.tier import Tier


def state_seconds(plan: Plan, links: Links, micro_batches: int = 1) -> float:
    """Predicted seconds per step of the state's traffic under ``plan`` (Note [joint state and
    activation plan])."""
    io = plan.step_io(micro_batches)
    seconds = (io["read"] + io["written"]) / links.nvme_bandwidth
    if plan.accelerator and plan.offloads:
        link = 0
        for u, tiers in zip(plan.units, plan.tiers):
            link += u.grad * micro_batches + (0 if u.frozen else u.shard)
            if tiers[KINDS.index("shard")] != Tier.DEVICE:
                link += u.shard * u.shard_reads * micro_batches
        seconds += link / links.host_bandwidth
    return seconds


def state_candidates(units: list[UnitSpec], budget: MemoryBudget, fixed: Fixed, *, accelerator: bool, nvme: bool,
                     micro_batches: int = 1, deeper: int = 0, most: int = 48) -> list[Plan]:
    """The sequential plan (``plan_auto`` under ``budget``: its PlacementError when the state alone
    does not fit), then up to ``most`` - 1 plans that leave the activations' tier more memory
    (Note [joint state and activation plan]), each with ``budget`` as its budget."""
    first = plan_auto(units, budget, fixed, accelerator=accelerator, nvme=nvme, micro_batches=micro_batches,
                      deeper=deeper)
    spread = _spread(len(units))
    movable = [(u, k) for u in units for k in (("shard",) if accelerator else KINDS) if u.size(k)]
    movable.sort(key=lambda uk: (-_order(uk[1], uk[0], micro_batches), spread[uk[0].index], KINDS.index(uk[1])))
    state = sum(u.size(k) for u in units for k in KINDS)
    held = [0]
    for u, k in movable:
        held.append(held[-1] + u.size(k))
    n = len(movable)
    counts = sorted(set(range(min(n, most // 2) + 1)) | {n * i // (most // 2) for i in range(most // 2 + 1)})
    plans, seen = [first], {(first.tiers, first.cached)}
    for given_up in counts[1:]:
        kept = held[n - given_up]
        if accelerator:
            trial = MemoryBudget(device=fixed.device + kept, host=budget.host, reserve=budget.reserve)
        else:
            staging = fixed.staging + fixed.pool + int(state * fixed.samples_per_byte) if nvme else 0
            trial = MemoryBudget(host=fixed.device + fixed.host + staging + kept, reserve=budget.reserve)
        try:
            plan = plan_auto(units, trial, fixed, accelerator=accelerator, nvme=nvme, micro_batches=micro_batches,
                             deeper=deeper)
        except PlacementError:
            continue  # (this much given up needs NVMe, or the fixed costs alone are over it)
        if (plan.tiers, plan.cached) not in seen:
            seen.add((plan.tiers, plan.cached))
            plans.append(replace(plan, budget=budget))
    return plans


@dataclass(frozen=True)
class JointChoice:
    state: Plan
    activations: ActivationPlan
    state_seconds: float
    activation_seconds: float
    sequential: Optional[tuple[float, float]]
    """(state, activation) seconds of the state-first plan; None where its activations do not fit."""
    candidates: int
    chosen: int
    """The index of the chosen candidate (0: the sequential plan)."""

    @property
    def seconds(self) -> float:
        return self.state_seconds + self.activation_seconds

    def report(self, micro_batches: int = 1) -> dict:
        io = self.state.step_io(micro_batches)
        moved = self.activations.moved_per_step * micro_batches
        seq = None if self.sequential is None else sum(self.sequential)
        return {"candidates": self.candidates, "chosen": self.chosen, "sequential": self.chosen == 0,
                "predicted_seconds": self.seconds, "state_seconds": self.state_seconds,
                "activation_seconds": self.activation_seconds, "sequential_seconds": seq,
                "bytes_moved_per_step": {"state_nvme_read": io["read"], "state_nvme_written": io["written"],
                                         "activations": moved, "total": io["read"] + io["written"] + moved}}

    def reason(self) -> str:
        io = self.state.step_io()
        seq = ("its activations did not fit" if self.sequential is None else
               f"{sum(self.sequential) * 1e3:.3f} ms predicted")
        return (f"joint plan: {self.candidates} state placement(s) tried with the best activation plan in what each "
                f"leaves; chosen #{self.chosen} ({'the state-first plan' if self.chosen == 0 else 'not state-first'})"
                f": {self.seconds * 1e3:.3f} ms predicted per step (state {self.state_seconds * 1e3:.3f}, "
                f"activations {self.activation_seconds * 1e3:.3f}); state-first: {seq}; moved per step: state "
                f"{fmt_bytes(io['read'] + io['written'])} (NVMe), activations "
                f"{fmt_bytes(self.activations.moved_per_step)}")


def plan_joint(candidates: list[Plan], activations: Callable[[Plan, bool], Optional[ActivationPlan]], *,
               links: Links = Links(), micro_batches: int = 1) -> JointChoice:
    """The candidate and its activation plan (``activations(state, explain)``: the best in what a state
    plan leaves, None where none fits, or with ``explain`` the refusal, a ValueError) with the least
    predicted step time; when none fits, the refusal of the candidate that holds the least on the
    activations' tier."""
    best: Optional[tuple[float, int, ActivationPlan, float]] = None
    sequential: Optional[tuple[float, float]] = None
    for i, state in enumerate(candidates):
        acts = activations(state, False)
        if acts is None:
            continue
        ss, sa = state_seconds(state, links, micro_batches), acts.extra_seconds * micro_batches
        if i == 0:
            sequential = (ss, sa)
        if best is None or ss + sa < best[0]:
            best = (ss + sa, i, acts, ss)
    if best is None:
        tier = "device" if candidates[0].accelerator else "host"
        roomiest = min(candidates, key=lambda p: p.memory()[tier])
        activations(roomiest, True)  # (raises: the longest sequence that fits in the most room any candidate leaves)
        raise RuntimeError("the activation planner fitted a plan it had refused for the same state")
    _, i, acts, ss = best
    chosen = candidates[i]
    if i:
        chosen = replace(chosen, reasons=chosen.reasons + (
            "state and activations planned together: this placement gives up state memory for activations "
            "(Note [joint state and activation plan])",))
    return JointChoice(chosen, acts, ss, best[0] - ss, sequential, len(candidates), i)
