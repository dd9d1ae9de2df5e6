"""``ForwardPlanner``: ``offload="auto"``'s activation plan, made (again) at a forward whose micro-batch
has more tokens than the plan's (Note [activations under the budget] in planned.py).

Lifecycle: built by the assembly with the model's repeated blocks; ``initial()`` plans a declared
shape at construction; ``at_forward()`` is called by the offloader at each forward's first block,
measures the micro-batch there and, when it holds more tokens than the plan's (or there is no plan
yet), plans it and gives the offloader the blocks to move. At stage 3 ``at_root()`` is called first, as
each forward starts, and plans the first one from the model's input (Note [state re-placed at the first
forward] in zeroshard/offload/placement_replan.py).

Note [one plan on every rank]: each rank measures its own micro-batch, and with variable-length batches
the ranks' shapes differ. Planned apart, a rank whose micro-batch the budget cannot hold raised at its
first block while the others went on into the step's collectives and waited for it (a hang until the
collective timeout, or an unrelated connection error once it exited). With more than one rank
(``ShapeAgreement``) every forward's measured shape is agreed first (the one with the most tokens, one
8-byte all-reduce per forward: a declared shape needs none), every rank plans that shape, a measured
block size is the largest any rank saw, and a refusal on any rank is raised on every rank.
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING, Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from zeroshard.offload.activations.planned import joint_activations, moved_blocks, plan_for_run, plan_report, shape_of
from zeroshard.offload.activations.workload import PlannedActivations
from zeroshard.offload.placement import JointActivations
from zeroshard.planner.auto_placement import MemoryBudget, Plan
from zeroshard.units.tier import Tier

if TYPE_CHECKING:
    from zeroshard.comm.process_group import Comm

Placed = tuple[dict[int, str], frozenset[str], dict]
"""What the offloader applies: the blocks to move (id -> name), those kept in host memory, the report."""


def places_last(places: dict[str, str]) -> str:
    """The last block's name (the plan's places are in the model's order)."""
    return list(places)[-1]


class ShapeAgreement:
    """The ranks of ``groups`` (the shard group, then the replicas') plan one shape and refuse together
    (Note [one plan on every rank]); the collectives' tensors live on ``device``, then on the device of
    the last input measured (the compute device, which a NCCL group needs)."""

    def __init__(self, groups: Sequence["Comm"], device: torch.device) -> None:
        self.groups = [g for g in groups if g.world_size > 1]
        self.device = device

    def _max(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        for g in self.groups:
            g.all_reduce(t, op=dist.ReduceOp.MAX, what="activation_plan")
        return int(t.item())

    def shape(self, micro_batch: int, seq_len: int) -> tuple[int, int]:
        """The (micro-batch, sequence) with the most tokens on any rank (ties: the longer sequence)."""
        key = self._max(micro_batch * seq_len << 24 | min(seq_len, (1 << 24) - 1))
        seq = key & ((1 << 24) - 1)
        return max(1, (key >> 24) // seq), seq

    def largest(self, value: float) -> float:
        """The largest ``value`` (>= 0) on any rank, to a millionth."""
        return self._max(round(value * 1e6)) / 1e6

    def refused_anywhere(self, refused: bool) -> bool:
        return bool(self._max(int(refused)))


class ForwardPlanner:
    def __init__(self, wanted: PlannedActivations, model: nn.Module, candidates: dict[int, str],
                 state: Callable[[], Plan], budget: MemoryBudget, accelerator: bool, nvme_path: Optional[str],
                 act_dtype: torch.dtype, joint: Optional[Callable[[JointActivations, bool], Optional[str]]] = None,
                 measures_input: bool = False, agreement: Optional[ShapeAgreement] = None) -> None:
        self.wanted = wanted
        self._agreement = agreement if agreement is not None and agreement.groups else None
        """More than one rank: one shape planned everywhere (Note [one plan on every rank])."""
        self._own_tokens = 0
        """Tokens of this rank's micro-batch in the forward planned last (what its blocks' bytes measure)."""
        self._joint = joint
        """Places the state again with the activations of the first measured micro-batch (Note [state
        re-placed at the first forward] in zeroshard/offload/placement_replan.py); its flag: measured at
        the model's input."""
        self.measures_input = measures_input
        """Stage 3: the first forward's shape is read from the model's input (``at_root``, called first as
        the forward starts), before the gatherer has gathered anything, and planned there (Note [state
        re-placed at the first forward])."""
        self.candidates = candidates
        """The model's repeated blocks (id -> name), in order: the plan gives each a place."""
        self.shape = shape_of(model, len(candidates))  # (now: under stage 3 a forward's parameters are released)
        self._state, self._budget, self._accelerator = state, budget, accelerator
        self._nvme_path, self._act_dtype = nvme_path, act_dtype
        self.tokens = 0
        """Tokens per micro-batch the plan in force holds (0: none yet)."""
        self.plans = 0
        """Plans made so far (a measured shape: one at the first forward, one per longer micro-batch)."""
        self._per_token: Optional[float] = None
        """Blocks not checkpointed: the largest block's saved bytes per token, measured (None: not yet)."""
        self._shape_now = (0, 0)

    def plan(self, micro_batch: int, seq_len: int, declared: bool, at_root: bool = False) -> Placed:
        """The plan of a ``micro_batch x seq_len`` micro-batch in what the state's plan leaves now
        (``at_root``: measured at the model's input); a ValueError naming the longest sequence and the
        smallest budget that fit."""
        options = replace(self.wanted, micro_batch=micro_batch, seq_len=seq_len)
        state_first = None
        if not declared and not self.plans and self._joint is not None:  # (the first measured micro-batch)
            state_first = self._joint(joint_activations(options, self.shape, list(self.candidates.values()),
                                                        self._budget, self._nvme_path, self._act_dtype), at_root)
        block = None if self._per_token is None else math.ceil(self._per_token * micro_batch * seq_len)
        try:
            plan, places, left = plan_for_run(options, self.shape, list(self.candidates.values()), self._state(),
                                              self._budget, self._accelerator, self._nvme_path, self._act_dtype, block)
        except ValueError as exc:
            if state_first is None:
                raise
            raise ValueError(f"{exc} (the state was not planned with the activations: {state_first})") from None
        self._shape_now = (micro_batch, seq_len)
        tiers = moved_blocks(places)
        cover = {k: n for k, n in self.candidates.items() if n in tiers}
        host = frozenset(n for n, t in tiers.items() if t is Tier.HOST)
        self.tokens, self.plans = micro_batch * seq_len, self.plans + 1
        report = plan_report(plan, places, options, left)
        report["shape"], report["plans"] = "declared" if declared else "measured", self.plans
        if block is None and not self.wanted.checkpointed and self.wanted.recompute:
            report["measure"] = [places_last(places)]  # (its saved bytes: Note [mixed activation plans])
        return cover, host, report

    def _everywhere(self, micro_batch: int, seq_len: int, declared: bool, at_root: bool = False) -> Placed:
        """``plan``, refused on every rank when refused on any (Note [one plan on every rank])."""
        if self._agreement is None:
            return self.plan(micro_batch, seq_len, declared, at_root)
        try:
            placed = self.plan(micro_batch, seq_len, declared, at_root)
        except ValueError:
            self._agreement.refused_anywhere(True)
            raise
        if self._agreement.refused_anywhere(False):
            raise ValueError(
                f"offload='auto': another rank's memory_budget cannot hold the activations of a micro-batch of "
                f"{micro_batch} x {seq_len} tokens (the most tokens any rank has in this forward; that rank's error "
                "names the longest sequence that fits there), so this rank stops too instead of waiting for it in "
                "the step's collectives")
        return placed

    def initial(self) -> Optional[Placed]:
        """The plan of a declared shape (at construction), or None: measured at the first forward."""
        w = self.wanted
        if w.micro_batch is None or w.seq_len is None:
            return None
        return self._everywhere(w.micro_batch, w.seq_len, True)

    def at_root(self, args: tuple, kwargs: dict) -> Optional[Placed]:
        """Stage 3, a forward starts (before stage 3's own root hooks): the first one's plan from the
        model's input when it gives the shape (``root_shape``), else None (the first block measures
        it, the state first). The first block then finds as many tokens and plans nothing more."""
        if not self.measures_input or self.plans or self.tokens:
            return None
        shape = root_shape(args, kwargs)
        if shape is None:
            return None
        self._own_tokens = shape[0] * shape[1]
        if self._agreement is not None:
            self._agreement.device = token_ids(args, kwargs).device  # type: ignore[union-attr]  # (a shape: ids)
            shape = self._agreement.shape(*shape)
        return self._everywhere(*shape, False, at_root=True)

    def at_forward(self, first: Optional[torch.Tensor]) -> Optional[Placed]:
        """A forward reached its first block, whose first tensor input is ``first``: the plan to apply
        before any block runs when this micro-batch has more tokens than the plan in force, else None."""
        d = self.shape.d_model
        if first is None or first.dim() < 2 or first.numel() % d or first.shape[-1] != d:
            if self.tokens:
                return None  # (a declared plan in force; nothing to measure it against)
            raise ValueError(
                f"offload_activations=PlannedActivations(): the micro-batch is measured at the first block's input, "
                f"but {type(first).__name__ if first is None else tuple(first.shape)} is not a (micro-batch, sequence, "
                f"{d}) tensor; declare the shape: PlannedActivations(micro_batch=..., seq_len=...)")
        micro_batch = int(first.shape[0])
        tokens = first.numel() // d
        seq_len = max(1, tokens // micro_batch)
        if self._agreement is not None:  # (every forward: each rank's shape may differ)
            self._agreement.device = first.device
            micro_batch, seq_len = self._agreement.shape(micro_batch, seq_len)
        if micro_batch * seq_len <= self.tokens:
            return None
        self._own_tokens = tokens
        return self._everywhere(micro_batch, seq_len, False)

    def after_forward(self, moved: list[int]) -> Optional[Placed]:
        """A forward ended having moved (or measured) these blocks' saved bytes. Blocks not
        checkpointed, first measurement: the plan with it, for the next forward; else None."""
        if self.wanted.checkpointed or self._per_token is not None or not moved or not self.tokens:
            return None
        micro_batch, seq_len = self._shape_now
        per_token = max(moved) / (self._own_tokens or micro_batch * seq_len)  # (this rank's micro-batch moved them)
        self._per_token = per_token if self._agreement is None else self._agreement.largest(per_token)
        return self._everywhere(micro_batch, seq_len, self.wanted.micro_batch is not None)


def token_ids(args: tuple, kwargs: dict) -> Optional[torch.Tensor]:
    """A forward's first positional tensor, or ``input_ids=`` (what holds the token ids in TinyGPT and
    Hugging Face causal LMs)."""
    found = next((a for a in args if isinstance(a, torch.Tensor)), kwargs.get("input_ids"))
    return found if isinstance(found, torch.Tensor) else None


def root_shape(args: tuple, kwargs: dict) -> Optional[tuple[int, int]]:
    """(micro-batch, sequence) of a forward's token ids (``token_ids``) when they are a 2-D integer
    tensor; else None."""
    ids = token_ids(args, kwargs)
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.is_floating_point() or ids.is_complex() \
            or ids.dtype == torch.bool or ids.numel() == 0:
        return None
    return int(ids.shape[0]), int(ids.shape[1])
