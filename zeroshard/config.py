"""Configuration of a ZeroOptimizer: one frozen, validated dataclass.

Every field is checked in ``__post_init__`` so that a typo fails at construction with a
message that names the offending value and the fix, not deep inside the first step.
"""
from __future__ import annotations

import math
import numbers
import os
from dataclasses import dataclass, fields
from typing import Any, Optional

import torch

_STAGES = (0, 1, 2, 3)
_OFFLOAD = (None, "cpu", "nvme")
_PRECISIONS = (None, "bf16", "fp16")
_MAX_LOSS_SCALE = 2.0**64  # beyond it fp16 gradients overflow at any loss: every step would be skipped


def _member(value: Any, allowed: tuple) -> bool:
    """``value in allowed`` without equal-but-different types (True == 1, 2.0 == 2)."""
    return any(value is a or (type(value) is type(a) and value == a) for a in allowed)


def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_real(name: str, value: Any, low: Optional[float] = None, strict: bool = False,
               high: Optional[float] = None, unit: str = "") -> None:
    """``value`` is a finite real number (not a bool or a string) within the bounds; else an
    error naming ``name`` and what to pass."""
    bounds = " and ".join(b for b in ((f"> {low:g}" if strict else f">= {low:g}") if low is not None else "",
                                       f"<= {high:g}" if high is not None else "") if b)
    want = f"a finite number{' ' + bounds if bounds else ''}{' (' + unit + ')' if unit else ''}"
    if not _is_real(value):
        raise TypeError(f"{name}={value!r} must be {want}, not a {type(value).__name__}")
    if not math.isfinite(value) or (low is not None and (value <= low if strict else value < low)) or \
            (high is not None and value > high):
        raise ValueError(f"{name}={value!r} must be {want}")


def check_int(name: str, value: Any, low: Optional[int] = None) -> None:
    """``value`` is an int (a bool is not) >= ``low``."""
    want = f"an int{f' >= {low}' if low is not None else ''}"
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise TypeError(f"{name}={value!r} must be {want}, not a {type(value).__name__}")
    if low is not None and value < low:
        raise ValueError(f"{name}={value!r} must be {want}")


def check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name}={value!r} must be True or False, not a {type(value).__name__}")


@dataclass(frozen=True)
class Placement:
    """Where a unit's pieces live (``offload_optimizer`` / ``offload_params``, or one unit's
    share of ``offload="auto"``'s plan): "cpu" puts them in (pinned, when the model is on an
    accelerator) host memory, "nvme" in a swap file with host memory as the staging place. On
    a CPU-only machine the model already lives on the host, so "cpu" changes nothing. The
    offload kinds are read here and in ``ZeroConfig``, nowhere else."""

    optimizer: Optional[str] = None
    params: Optional[str] = None
    pin: bool = True

    @property
    def state_swapped(self) -> bool:
        """Optimizer moments (and, with parameters swapped, master and gradient) in a swap file."""
        return self.optimizer == "nvme"

    @property
    def params_swapped(self) -> bool:
        return self.params == "nvme"

    def optimizer_device(self, model_device: torch.device) -> torch.device:
        # "nvme": the moments go to the swap file; master and gradients wait in host memory.
        return torch.device("cpu") if self.optimizer in ("cpu", "nvme") else model_device

    def param_device(self, model_device: torch.device) -> torch.device:
        # "nvme": the shard is read into host memory for the gather, then dropped.
        return torch.device("cpu") if self.params in ("cpu", "nvme") else model_device


@dataclass(frozen=True)
class ZeroConfig:
    """How parameters, gradients and optimizer state are partitioned and kept."""

    stage: int = 2
    """0 = plain data parallel, 1 = shard optimizer state, 2 = + gradients, 3 = + parameters."""
    offload_optimizer: Optional[str] = None
    """Where fp32 master pieces and optimizer moments live: None (device), "cpu" or "nvme"."""
    offload_params: Optional[str] = None
    """Stage 3 only: where parameter slices live between gathers: None, "cpu" or "nvme"."""
    nvme_path: Optional[str] = None
    """Directory for the swap files of "nvme" offload."""
    offload: Optional[str] = None
    """"auto": the planner places each unit's shard, master, gradient and moments in memory or
    on NVMe to fit ``memory_budget`` with the least traffic per step (Note [automatic placement]
    in zeroshard/planner/auto_placement.py), instead of offload_optimizer / offload_params."""
    memory_budget: Any = None
    """offload="auto": memory this rank may use, e.g. {"device": "20GiB", "host": "48GiB"} (on a
    CPU-only machine the two are one memory: their sum). The host budget is the process's
    resident memory: what it holds outside the training state is measured as the optimizer is
    built, or given as "reserve" (Note [what the budget covers] in zeroshard/planner/auto_placement.py)."""
    mixed_precision: Optional[str] = None
    """None (fp32 everywhere), "bf16" or "fp16": the model's parameter dtype; the master
    pieces stay fp32. fp16 adds dynamic loss scaling."""
    bucket_size_mb: float = 25.0
    """Size of a flat unit (stages 0-2) in MiB of parameter data: the granularity of
    gradient reduction and of the parameter gather after the step."""
    max_inflight_buckets: int = 2
    """How many gradient buckets may be in flight at once (stage 2 keeps at most this many
    full-size bucket buffers alive; more overlap costs more memory)."""
    reduce_dtype: Optional[str] = None
    """dtype of gradient buffers and reductions: None = fp32 (exact accumulation, the
    default even under bf16/fp16), or "bf16"/"fp16" to halve gradient memory and traffic."""
    max_live_units: Optional[int] = None
    """Stage 3: how many units (besides the root unit) may be gathered or being prefetched
    at once; bounds the gather buffers to about that many units. None: 2, or 3 under
    ``offload="auto"`` when the budget has room for one more beside the state it places
    (Note [prefetch depth] in zeroshard/stages/stage3/gatherer.py)."""
    stage3_unit_classes: Optional[tuple[str, ...]] = None
    """Stage 3: class names of the modules that form units (default: every repeated block,
    e.g. each transformer layer)."""
    stage3_unit_numel: Optional[int] = None
    """Stage 3: instead of classes, the largest subtrees with at most this many parameters."""
    offload_buffer_mb: Optional[float] = None
    """NVMe offload: bound on the host memory of its staging buffers (the moments' pool and
    the units in flight between the swap files and the step), in MiB. Each overlapped stage
    of the read-update-write pipeline takes one slot of about the largest unit's state; None
    allows three slots (full overlap). Too small for one slot fails at construction."""
    fused_adam: bool = True
    """Run torch.optim.Adam/AdamW on zeroshard's fused kernel (same results, one pass over
    memory). Other optimizers, or Adam options the kernel does not implement, always run
    on the class given."""
    initial_loss_scale: float = 2.0**16
    """fp16 only: starting dynamic loss scale."""
    loss_scale_growth_interval: int = 2000
    """fp16 only: overflow-free steps before the loss scale doubles."""
    hpz: bool = False
    """Stage 3 with ``mesh=`` a 2-D (nodes, ranks per node) DeviceMesh: ZeRO++'s hierarchical
    partitioning. State stays sharded over every rank; each rank also keeps a secondary
    partition of the parameters over its node (unit numel / node size per rank, model dtype),
    rebuilt at each step, so forward and backward gathers stay inside the node."""

    overlap_step: Optional[bool] = None
    """Stage 3 with the optimizer state streamed from NVMe: ``step()`` returns once what needs
    the whole model is decided, and the units are updated in the background while the next
    forward runs, each gather waiting for its own unit (Note [overlapped step] in
    zeroshard/optim/step_in_flight.py; same bits). An error of the background step is
    raised by the next call that needs the state. None: on under offload="auto", off
    otherwise; ignored where nothing streams."""

    placement_policy: Optional[type] = None
    """A placement policy of your own: a subclass of ``zeroshard.offload.placement.StatePlacement``
    (one file; Note [assembly] in zeroshard/optim/assembly.py), built in its place with the same
    arguments. It decides each unit's ``Placement`` (``of_unit``) and may override what follows."""

    def __post_init__(self) -> None:
        if self.placement_policy is not None and not isinstance(self.placement_policy, type):
            raise TypeError(f"placement_policy={self.placement_policy!r} must be a class (a subclass of "
                            "zeroshard.offload.placement.StatePlacement), not an instance")
        if isinstance(self.stage, bool) or self.stage not in _STAGES or not isinstance(self.stage, int):
            raise ValueError(f"stage={self.stage!r} is not a ZeRO stage; use one of {_STAGES} (an int)")
        for name in ("offload_optimizer", "offload_params"):
            value = getattr(self, name)
            if not _member(value, _OFFLOAD):
                raise ValueError(f"{name}={value!r} is not supported; use one of {_OFFLOAD}")
        if self.offload_params is not None and self.stage != 3:
            raise ValueError(
                f"offload_params={self.offload_params!r} needs stage=3 (parameters are only "
                f"partitioned at stage 3), got stage={self.stage}")
        if self.offload_params == "nvme" and self.offload_optimizer != "nvme":
            raise ValueError(
                f"offload_params='nvme' needs offload_optimizer='nvme' too (got {self.offload_optimizer!r}): "
                "the fp32 master of a swapped parameter shard lives in the same swap file as the "
                "shard, and its optimizer states are streamed beside it")
        self._check_auto()
        uses_nvme = "nvme" in (self.offload_optimizer, self.offload_params) or self.offload == "auto"
        if self.nvme_path is not None and not isinstance(self.nvme_path, (str, os.PathLike)):
            raise TypeError(f"nvme_path={self.nvme_path!r} must be a directory path (a str)")
        if uses_nvme and not self.nvme_path and self.offload != "auto":
            raise ValueError("offload to 'nvme' needs nvme_path=<directory for swap files>")
        if self.nvme_path is not None and not uses_nvme:
            raise ValueError(f"nvme_path={self.nvme_path!r} is only used by NVMe offload; pass "
                             "offload_optimizer='nvme' to use it, or drop nvme_path")
        if not _member(self.mixed_precision, _PRECISIONS):
            raise ValueError(
                f"mixed_precision={self.mixed_precision!r} is not supported; use one of {_PRECISIONS}")
        if not _member(self.reduce_dtype, (None, "fp32", "bf16", "fp16")):
            raise ValueError(
                f"reduce_dtype={self.reduce_dtype!r} is not supported; use None, 'fp32', 'bf16' or 'fp16'")
        check_real("bucket_size_mb", self.bucket_size_mb, low=0.0, strict=True, unit="MiB")
        check_int("max_inflight_buckets", self.max_inflight_buckets, low=1)
        if self.max_live_units is not None:
            check_int("max_live_units", self.max_live_units, low=1)
        if self.stage3_unit_numel is not None:
            check_int("stage3_unit_numel", self.stage3_unit_numel, low=1)
        classes = self.stage3_unit_classes
        if classes is not None and (isinstance(classes, str) or not isinstance(classes, (list, tuple, set, frozenset))
                                    or not all(isinstance(c, str) and c for c in classes)):
            raise TypeError(f"stage3_unit_classes={classes!r} must be a list of "
                            "class names, e.g. ['GPT2Block']")
        if self.offload_buffer_mb is not None:
            check_real("offload_buffer_mb", self.offload_buffer_mb, low=0.0, strict=True, unit="MiB, or None")
        check_bool("fused_adam", self.fused_adam)
        check_real("initial_loss_scale", self.initial_loss_scale, low=0.0, strict=True, high=_MAX_LOSS_SCALE)
        check_int("loss_scale_growth_interval", self.loss_scale_growth_interval, low=1)
        check_bool("hpz", self.hpz)
        if self.overlap_step is not None:
            check_bool("overlap_step", self.overlap_step)
        if self.hpz and self.stage != 3:
            raise ValueError(f"hpz=True partitions stage-3 parameters a second time inside each node; it needs "
                             f"stage=3, got stage={self.stage} (hybrid sharding at stages 0-2 is mesh= alone)")
        if self.hpz and self.offload_params == "nvme":
            raise ValueError("hpz=True keeps a secondary parameter partition in memory; it does not combine "
                             "with offload_params='nvme' (use offload_params='cpu' or None)")

    def _check_auto(self) -> None:
        if not _member(self.offload, (None, "auto")):
            raise ValueError(f"offload={self.offload!r} is not supported; use 'auto' (with memory_budget) or None")
        if self.offload is None:
            if self.memory_budget is not None:
                raise ValueError(f"memory_budget={self.memory_budget!r} is only used by offload='auto'; pass "
                                 "offload='auto' too, or drop memory_budget")
            return
        explicit = {k: v for k, v in (("offload_optimizer", self.offload_optimizer),
                                      ("offload_params", self.offload_params)) if v is not None}
        if explicit:
            raise ValueError(f"offload='auto' places the state itself, so it cannot be combined with "
                             f"{', '.join(f'{k}={v!r}' for k, v in explicit.items())}; drop those, or drop "
                             "offload='auto' to choose by hand")
        if self.stage == 0:
            raise ValueError("offload='auto' needs stage >= 1 (each rank places the state it owns)")
        if self.memory_budget is None:
            raise ValueError("offload='auto' needs memory_budget, e.g. memory_budget={'device': '20GiB', "
                             "'host': '48GiB'} (per rank)")
        from zeroshard.planner.auto_placement import MemoryBudget
        MemoryBudget.parse(self.memory_budget)

    @property
    def optimizer_swapped(self) -> bool:
        """``offload_optimizer="nvme"``: moments streamed through a swap file each step."""
        return self.offload_optimizer == "nvme"

    @property
    def optimizer_on_host(self) -> bool:
        """``offload_optimizer="cpu"``: master and moments in host memory."""
        return self.offload_optimizer == "cpu"

    @property
    def params_swapped(self) -> bool:
        """``offload_params="nvme"``: stage-3 shards (with their masters, gradients) in a swap file."""
        return self.offload_params == "nvme"

    @property
    def automatic(self) -> bool:
        """``offload="auto"``: the planner places each unit's state against ``memory_budget``."""
        return self.offload == "auto"

    @property
    def placement(self) -> Placement:
        """The placement every unit gets when it is chosen by hand (``offload="auto"`` gives each
        unit its own, from the plan)."""
        return Placement(self.offload_optimizer, self.offload_params)

    @classmethod
    def field_names(cls) -> frozenset[str]:
        return frozenset(f.name for f in fields(cls))
