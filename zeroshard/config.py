"""Configuration of a ZeroOptimizer: one frozen, validated dataclass.

Every field is checked in ``__post_init__`` so that a typo fails at construction with a
message that names the offending value and the fix, not deep inside the first step.
"""
from __future__ import annotations

import math
import numbers
import os
from dataclasses import dataclass, fields
from typing import Any, Optional, Union

import torch

from zeroshard.comm.codecs.codec_options import CollectiveCodecs
from zeroshard.resilience.redundancy_options import PeerRedundancy, redundancy_options
from zeroshard.units.tier import Tier

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


# Note [one validator]: the rules between options live in ``ZeroConfig`` and the functions it
# calls here; the planner's choices (planner/estimate.py ``Choice``), the fine-tune CLI and the
# DeepSpeed config reader (train/) check their own formats, then build a ZeroConfig or call these
# functions, so no two places can disagree on what runs.
def check_offload(stage: int, offload_optimizer: Optional[str], offload_params: Optional[str]) -> None:
    """The offload kinds and what they need of the stage (ZeroConfig's rules, shared with the planner)."""
    for name, value in (("offload_optimizer", offload_optimizer), ("offload_params", offload_params)):
        if not _member(value, _OFFLOAD):
            raise ValueError(f"{name}={value!r} is not supported; use one of {_OFFLOAD}")
    if offload_optimizer is not None and stage == 0:  # (the planner's rule, and DeepSpeed's)
        raise ValueError(f"offload_optimizer={offload_optimizer!r} needs stage >= 1 (each rank offloads the slice "
                         "of the optimizer state it owns; stage 0 keeps every rank's state whole): use stage=1")
    if offload_params is not None and stage != 3:
        raise ValueError(
            f"offload_params={offload_params!r} needs stage=3 (parameters are only "
            f"partitioned at stage 3), got stage={stage}")
    if offload_params == "nvme" and offload_optimizer != "nvme":
        raise ValueError(
            f"offload_params='nvme' needs offload_optimizer='nvme' too (got {offload_optimizer!r}): "
            "the fp32 master of a swapped parameter shard lives in the same swap file as the "
            "shard, and its optimizer states are streamed beside it")


_TIER_OF = {None: Tier.DEVICE, "cpu": Tier.HOST, "nvme": Tier.NVME}
"""The offload strings' tiers (None: beside the model, on its device)."""


def offload_tier(name: str, value: Union[Tier, str, None]) -> Tier:
    """The tier an offload option names: a ``Tier`` as it is, or one of the strings None, "cpu", "nvme"."""
    if isinstance(value, Tier):
        return value
    if not _member(value, _OFFLOAD):
        raise ValueError(f"{name}={value!r} is not supported; use one of {_OFFLOAD}")
    return _TIER_OF[value]


@dataclass(frozen=True, init=False)
class Placement:
    """Where a unit's pieces live (``offload_optimizer`` / ``offload_params``, or one unit's
    share of ``offload="auto"``'s plan): "cpu" (``Tier.HOST``) puts them in (pinned, when the
    model is on an accelerator) host memory, "nvme" (``Tier.NVME``) in a swap file with host
    memory as the staging place; None (``Tier.DEVICE``) beside the model. On a CPU-only
    machine the model already lives on the host, so "cpu" changes nothing. Given as the
    strings or as tiers, kept as tiers; the offload kinds are read here and in ``ZeroConfig``,
    nowhere else."""

    optimizer: Tier
    params: Tier
    pin: bool

    def __init__(self, optimizer: Union[Tier, str, None] = None, params: Union[Tier, str, None] = None,
                 pin: bool = True) -> None:
        object.__setattr__(self, "optimizer", offload_tier("offload_optimizer", optimizer))
        object.__setattr__(self, "params", offload_tier("offload_params", params))
        object.__setattr__(self, "pin", pin)

    @property
    def state_swapped(self) -> bool:
        """Optimizer moments (and, with parameters swapped, master and gradient) in a swap file."""
        return self.optimizer is Tier.NVME

    @property
    def params_swapped(self) -> bool:
        return self.params is Tier.NVME

    def optimizer_device(self, model_device: torch.device) -> torch.device:
        # NVME: the moments go to the swap file; master and gradients wait in host memory.
        return model_device if self.optimizer is Tier.DEVICE else torch.device("cpu")

    def param_device(self, model_device: torch.device) -> torch.device:
        # NVME: the shard is read into host memory for the gather, then dropped.
        return model_device if self.params is Tier.DEVICE else torch.device("cpu")


# Note [typed offload options]: ``offload=`` takes one of the three classes below (the strings
# ``offload_optimizer="cpu"|"nvme"``, ``offload_params=``, ``nvme_path=``, ``offload="auto"``
# with ``memory_budget=`` stay as sugar for them). ``ZeroConfig`` turns either form into the
# same fields once, here, and ``ZeroConfig.offload_options`` gives the typed form back, so the
# rest of zeroshard reads one vocabulary whichever the user wrote: ``Tier`` (``optimizer_tier``,
# ``params_tier``, ``Placement``'s fields), never the strings.
@dataclass(frozen=True, kw_only=True)
class CPUOffload:
    """fp32 master pieces and optimizer moments in host memory (the strings' ``offload_optimizer="cpu"``);
    ``params=True`` (stage 3) keeps the parameter shards there between gathers too."""

    params: bool = False
    pin_memory: bool = True
    """Pin the host buffers when the model is on an accelerator (faster copies; pinned memory
    cannot be swapped out by the OS). On a CPU-only machine nothing is pinned either way."""

    def __post_init__(self) -> None:
        check_bool("CPUOffload.params", self.params)
        check_bool("CPUOffload.pin_memory", self.pin_memory)


@dataclass(frozen=True, kw_only=True)
class NVMeOffload:
    """Optimizer moments (and with ``params=True``, stage 3's parameter shards with their
    masters and gradients) in swap files under ``path``, streamed each step."""

    path: str
    params: bool = False
    buffer_mb: Optional[float] = None
    """Bound on the staging buffers' host memory in MiB (``offload_buffer_mb``); None: three slots."""

    def __post_init__(self) -> None:
        if not isinstance(self.path, (str, os.PathLike)) or not str(self.path):
            raise TypeError(f"NVMeOffload(path={self.path!r}) must be a directory path for the swap files")
        check_bool("NVMeOffload.params", self.params)


@dataclass(frozen=True, kw_only=True)
class AutoOffload:
    """The planner places each unit's state in memory or on NVMe to fit ``budget`` (the strings'
    ``offload="auto", memory_budget=...``; Note [automatic placement]); ``path``: where its swap
    files go (``nvme_path``; default a temporary directory)."""

    budget: Union[str, int, float, dict[str, Union[str, int, float]]]
    path: Optional[str] = None

    def __post_init__(self) -> None:
        if self.budget is None:
            raise ValueError("AutoOffload(budget=...) needs a budget, e.g. {'device': '20GiB', 'host': '48GiB'}")
        if self.path is not None and not isinstance(self.path, (str, os.PathLike)):
            raise TypeError(f"AutoOffload(path={self.path!r}) must be a directory path (a str)")


OffloadOptions = Union[CPUOffload, NVMeOffload, AutoOffload]


@dataclass(frozen=True, kw_only=True)
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
    offload: Optional[Union[str, CPUOffload, NVMeOffload, AutoOffload]] = None
    """``CPUOffload(...)``, ``NVMeOffload(path=...)`` or ``AutoOffload(budget=...)`` (Note [typed offload
    options]); or the string sugar "auto": the planner places each unit's shard, master, gradient and moments in memory or
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

    weight_codec: str = "none"
    """Quantized collectives (ZeRO++ qwZ/qgZ): the codec of stage-3 parameter gathers, of gradient
    reductions, on which links, elements per scale, error feedback, per-step error log. Checked and
    documented in ``zeroshard.comm.codecs.CollectiveCodecs`` (the ``codecs`` property)."""
    grad_codec: str = "none"
    codec_links: str = "all"
    codec_block: int = 256
    grad_error_feedback: bool = False
    log_codec_error: bool = False

    overlap_step: Optional[bool] = None
    """Stage 3 with the optimizer state streamed from NVMe: ``step()`` returns once what needs
    the whole model is decided, and the units are updated in the background while the next
    forward runs, each gather waiting for its own unit (Note [overlapped step] in
    zeroshard/units/step_in_flight.py; same bits). An error of the background step is
    raised by the next call that needs the state. None: on under offload="auto", off
    otherwise; ignored where nothing streams."""

    pin_memory: bool = True
    """Host buffers of offloaded state are pinned when the model is on an accelerator
    (``CPUOffload(pin_memory=...)``)."""

    offload_activations: object = None
    """None, "cpu", "nvme", ``zeroshard.ActivationOffload(...)`` or (with offload="auto")
    ``zeroshard.PlannedActivations()`` (shape measured at the first forward, or declared): the
    tensors autograd saves in the model's blocks (a checkpointed block's input) wait for backward
    in host memory or NVMe files under ``nvme_path`` (zeroshard/offload/activations/activation_options.py)."""

    placement_policy: Optional[type] = None
    """A placement policy of your own: a subclass of ``zeroshard.offload.placement.StatePlacement``
    (one file; Note [assembly] in zeroshard/optim/assembly.py), built in its place with the same
    arguments. It decides each unit's ``Placement`` (``of_unit``) and may override what follows;
    the rest comes from the placement the offload options name (``ExplicitPlacement`` or
    ``AutoPlacement``, zeroshard/offload/placement_choice.py)."""

    redundancy: Union[None, str, PeerRedundancy] = None
    """None, "peer" or ``PeerRedundancy(path=..., every=...)``: keep each committed step's state
    in node-local shared memory with a replica on a buddy rank, so a lost rank resumes from
    memory (Note [peer memory tier] in zeroshard/resilience/memory_tier.py)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "redundancy", redundancy_options(self.redundancy))
        self._take_typed_offload()
        if self.placement_policy is not None and not isinstance(self.placement_policy, type):
            raise TypeError(f"placement_policy={self.placement_policy!r} must be a class (a subclass of "
                            "zeroshard.offload.placement.StatePlacement), not an instance")
        if isinstance(self.stage, bool) or self.stage not in _STAGES or not isinstance(self.stage, int):
            raise ValueError(f"stage={self.stage!r} is not a ZeRO stage; use one of {_STAGES} (an int)")
        check_offload(self.stage, self.offload_optimizer, self.offload_params)
        self._check_auto()
        from zeroshard.offload.activations.activation_options import activation_options, takes_nvme_path
        uses_nvme = "nvme" in (self.offload_optimizer, self.offload_params) or self.offload == "auto"
        uses_nvme = uses_nvme or takes_nvme_path(self.offload_activations)
        if self.nvme_path is not None and not isinstance(self.nvme_path, (str, os.PathLike)):
            raise TypeError(f"nvme_path={self.nvme_path!r} must be a directory path (a str)")
        if uses_nvme and not self.nvme_path and self.offload != "auto":
            raise ValueError("offload to 'nvme' needs nvme_path=<directory for swap files>")
        if self.nvme_path is not None and not uses_nvme:
            raise ValueError(f"nvme_path={self.nvme_path!r} is only used by NVMe offload; pass "
                             "offload_optimizer='nvme' to use it, or drop nvme_path")
        from zeroshard.offload.activations.workload import PlannedActivations
        if isinstance(self.offload_activations, PlannedActivations):  # (Note [activations under the budget])
            if self.offload != "auto" or self.memory_budget is None:
                raise ValueError(f"offload_activations={self.offload_activations!r} is planned under the budget: "
                                 "pass offload='auto' and memory_budget=..., or offload_activations='cpu'|'nvme'")
        else:
            activation_options(self.offload_activations, self.nvme_path)  # (checked here: fails at construction)
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
        check_bool("pin_memory", self.pin_memory)
        check_real("initial_loss_scale", self.initial_loss_scale, low=0.0, strict=True, high=_MAX_LOSS_SCALE)
        check_int("loss_scale_growth_interval", self.loss_scale_growth_interval, low=1)
        check_bool("hpz", self.hpz)
        if self.overlap_step is not None:
            check_bool("overlap_step", self.overlap_step)
        if self.hpz and self.stage != 3:
            raise ValueError(f"hpz=True partitions stage-3 parameters a second time inside each node; it needs "
                             f"stage=3, got stage={self.stage} (hybrid sharding at stages 0-2 is mesh= alone)")
        self.codecs.check_stage(self.stage)
        if self.hpz and self.offload_params == "nvme":
            raise ValueError("hpz=True keeps a secondary parameter partition in memory; it does not combine "
                             "with offload_params='nvme' (use offload_params='cpu' or None)")

    def _take_typed_offload(self) -> None:
        """``offload=CPUOffload(...) | NVMeOffload(...) | AutoOffload(...)`` becomes the fields the
        strings set (Note [typed offload options]); given with those strings too, it is refused."""
        typed = self.offload
        if not isinstance(typed, (CPUOffload, NVMeOffload, AutoOffload)):
            return
        given = {k: getattr(self, k) for k in ("offload_optimizer", "offload_params", "nvme_path", "memory_budget")
                 if getattr(self, k) is not None}
        if given:
            raise ValueError(f"offload={typed!r} says where the state lives; it cannot be combined with "
                             f"{', '.join(f'{k}={v!r}' for k, v in given.items())}: drop those (or use the strings alone)")
        set_ = object.__setattr__
        if isinstance(typed, AutoOffload):
            set_(self, "offload", "auto")
            set_(self, "memory_budget", typed.budget)
            set_(self, "nvme_path", None if typed.path is None else os.fspath(typed.path))
            return
        set_(self, "offload", None)
        kind = "cpu" if isinstance(typed, CPUOffload) else "nvme"
        set_(self, "offload_optimizer", kind)
        set_(self, "offload_params", kind if typed.params else None)
        if isinstance(typed, CPUOffload):
            set_(self, "pin_memory", typed.pin_memory)
        else:
            set_(self, "nvme_path", os.fspath(typed.path))
            if typed.buffer_mb is not None:
                set_(self, "offload_buffer_mb", typed.buffer_mb)

    @property
    def offload_options(self) -> Optional[OffloadOptions]:
        """Where the state lives, in the typed form whichever form was given (None: on the device)."""
        if self.offload == "auto":
            return AutoOffload(budget=self.memory_budget, path=self.nvme_path)
        if self.offload_optimizer == "nvme":
            return NVMeOffload(path=str(self.nvme_path), params=self.offload_params == "nvme",
                               buffer_mb=self.offload_buffer_mb)
        if self.offload_optimizer == "cpu":
            return CPUOffload(params=self.offload_params == "cpu", pin_memory=self.pin_memory)
        return None

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
    def optimizer_tier(self) -> Tier:
        """Where ``offload_optimizer`` puts every unit's master, gradient and moments (DEVICE under
        ``offload="auto"``, whose plan places each unit: ``AutoPlacement``)."""
        return offload_tier("offload_optimizer", self.offload_optimizer)

    @property
    def params_tier(self) -> Tier:
        """Where ``offload_params`` puts every stage-3 shard between gathers."""
        return offload_tier("offload_params", self.offload_params)

    @property
    def optimizer_swapped(self) -> bool:
        """``offload_optimizer="nvme"``: moments streamed through a swap file each step."""
        return self.optimizer_tier is Tier.NVME

    @property
    def optimizer_on_host(self) -> bool:
        """``offload_optimizer="cpu"``: master and moments in host memory."""
        return self.optimizer_tier is Tier.HOST

    @property
    def params_swapped(self) -> bool:
        """``offload_params="nvme"``: stage-3 shards (with their masters, gradients) in a swap file."""
        return self.params_tier is Tier.NVME

    @property
    def automatic(self) -> bool:
        """``offload="auto"``: the planner places each unit's state against ``memory_budget``."""
        return self.offload == "auto"

    @property
    def codecs(self) -> CollectiveCodecs:
        return CollectiveCodecs(self.weight_codec, self.grad_codec, self.codec_links, self.codec_block,
                                self.grad_error_feedback, self.log_codec_error)

    @property
    def placement(self) -> Placement:
        """The placement every unit gets when it is chosen by hand (``offload="auto"`` gives each
        unit its own, from the plan)."""
        return Placement(self.optimizer_tier, self.params_tier, self.pin_memory)

    @classmethod
    def field_names(cls) -> frozenset[str]:
        return frozenset(f.name for f in fields(cls))
