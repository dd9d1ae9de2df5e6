"""Translating the common subset of a DeepSpeed JSON config into zeroshard settings.

Every key of the config ends in exactly one of three places:
- *translated*: it becomes a ZeroOptimizer / optimizer / scheduler / training-loop setting;
- *noted*: a tuning knob whose job zeroshard does another way (``overlap_comm``: zeroshard
  always overlaps); it changes nothing here, and it is reported by name in one warning;
- *unsupported*: anything else. Those are reported together, by dotted path, in a
  ``ValueError`` (or a warning with ``strict=False``): a key that would change training must
  never be dropped silently.

``"auto"`` (a placeholder the Hugging Face Trainer fills in) is resolved from the matching
override given to ``zeroshard.initialize`` (``lr=``, ``micro_batch_size=`` ...), else from its
``auto=`` values (the same names; unlike overrides they never replace a value the config
gives: the command line passes its defaults this way); bucket sizes
fall back to zeroshard's default, ``fp16/bf16.enabled: "auto"`` means "off unless
``mixed_precision=`` is passed", ``train_batch_size: "auto"`` is derived. Any other
``"auto"`` without an override is an error that names the override to pass.
"""
from __future__ import annotations

import inspect
import json
import os
import stat
import warnings
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Union

import torch

from zeroshard.config import Placement, ZeroConfig, check_int, check_real
from zeroshard.optim.hyperparams import check_hyperparameters
from zeroshard.train.deepspeed_zeropp import zeropp_options
from zeroshard.optim.muon_recipe import ADAM_KEYS
from zeroshard.train.deepspeed_activations import SECTION, read_section
from zeroshard.train.schedules import check_schedule_params

# Keys accepted without effect, and why (what zeroshard does instead).
NOTED: dict[str, str] = {
    "zero_optimization.overlap_comm": "zeroshard always overlaps gradient reduction with backward",
    "zero_optimization.contiguous_gradients": "gradients always land in contiguous flat buffers",
    "zero_optimization.reduce_scatter": "stages 2-3 always reduce-scatter (or its gloo equivalent)",
    "zero_optimization.allgather_partitions": "updated slices are always all-gathered",
    "zero_optimization.round_robin_gradients": "partitioning is by element, balanced by construction",
    "zero_optimization.load_from_fp32_weights": "checkpoints always restore fp32 master pieces",
    "zero_optimization.elastic_checkpoint": "zeroshard checkpoints load at any world size",
    "zero_optimization.ignore_unused_parameters": "unused parameters get zero gradients, as in DDP",
    "zero_optimization.stage3_prefetch_bucket_size": "stage 3 prefetches the next module unit",
    "zero_optimization.stage3_param_persistence_threshold": "stage 3 units follow module boundaries",
    "zero_optimization.stage3_max_live_parameters": "bounded by ZeroConfig.max_live_units (units, not elements)",
    "zero_optimization.stage3_max_reuse_distance": "bounded by ZeroConfig.max_live_units",
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": "use zeroshard.full_state_dict / export_hf",
    "zero_optimization.stage3_gather_fp16_weights_on_model_save": "use zeroshard.full_state_dict / export_hf",
    "zero_optimization.sub_group_size": "the optimizer steps per flat unit",
    "zero_optimization.offload_optimizer.pin_memory": "CPU offload buffers are pinned when a GPU is present",
    "zero_optimization.offload_optimizer.buffer_count": "offload pipelining is sized by zeroshard",
    "zero_optimization.offload_optimizer.fast_init": "offload initialisation is sized by zeroshard",
    "zero_optimization.offload_param.pin_memory": "CPU offload buffers are pinned when a GPU is present",
    "zero_optimization.offload_param.buffer_count": "offload pipelining is sized by zeroshard",
    "zero_optimization.offload_param.buffer_size": "offload pipelining is sized by zeroshard",
    "zero_optimization.offload_param.max_in_cpu": "offload pipelining is sized by zeroshard",
    "optimizer.params.torch_adam": "Adam/AdamW run on zeroshard's fused kernel or torch.optim",
    "optimizer.params.fused": "Adam/AdamW run on zeroshard's fused kernel when it applies",
    "zero_allow_untested_optimizer": "zeroshard accepts every elementwise optimizer and refuses the rest",
    "zero_force_ds_cpu_optimizer": "zeroshard picks its CPU kernel itself",
    "wall_clock_breakdown": "use the progress log (tokens/s, step time)",
    "memory_breakdown": "use ZeroOptimizer.memory_report()",
    "dump_state": "print the ZeroOptimizer instead",
    "fp16.consecutive_hysteresis": "zeroshard lowers the loss scale at every overflow (no hysteresis)",
    "fp16.hysteresis": "zeroshard lowers the loss scale at every overflow (no hysteresis)",
}
NOTED_SECTIONS = ("aio",)  # async-I/O tuning of DeepSpeed's NVMe engine; zeroshard sizes its own

# DeepSpeed optimizer names (lower case) -> torch class name; "adam" depends on adam_w_mode.
_OPTIMIZERS = {"adam": "Adam", "adamw": "AdamW", "sgd": "SGD", "adagrad": "Adagrad"}
_REFUSED_OPTIMIZERS = ("lamb", "onebitadam", "onebitlamb", "zerooneadam", "lion", "muadam", "muadamw", "musgd")
_SCHEDULERS = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR")

OVERRIDES = ("stage", "offload_optimizer", "offload_params", "nvme_path", "mixed_precision", "bucket_size_mb",
             "reduce_dtype", "optimizer", "lr", "weight_decay", "betas", "eps", "momentum",
             "gradient_clipping", "gradient_accumulation_steps", "micro_batch_size", "train_batch_size",
             "total_num_steps", "warmup_num_steps", "warmup_min_lr", "scheduler", "redundancy")
"""Keyword overrides of ``zeroshard.initialize``: they win over the config and fill its "auto"s."""
PLACEHOLDER = "auto"
"""A config value the Hugging Face Trainer fills in (resolved by ``_Reader.get``); not an offload kind."""


@dataclass(frozen=True)
class DeepSpeedPlan:
    """What a DeepSpeed config means for zeroshard."""

    zero: dict = field(default_factory=dict)
    """ZeroOptimizer keyword arguments (stage, offload, precision, bucket size, loss scaling)."""
    optimizer_class: Optional[type] = None
    optimizer_kwargs: dict = field(default_factory=dict)
    scheduler: Optional[str] = None
    """WarmupLR | WarmupDecayLR | WarmupCosineLR, or None."""
    scheduler_params: dict = field(default_factory=dict)
    gradient_clipping: Optional[float] = None
    """Max global gradient norm for ``opt.clip_grad_norm_`` (None or 0: no clipping)."""
    gradient_accumulation_steps: int = 1
    micro_batch_size: Optional[int] = None
    """Samples per rank per micro-batch (``train_micro_batch_size_per_gpu``)."""
    train_batch_size: Optional[int] = None
    steps_per_print: Optional[int] = None
    noted: dict = field(default_factory=dict)
    """Dotted path -> why it has no effect."""
    hpz_partition_size: Optional[int] = None
    """``zero_hpz_partition_size`` (> 1): the optimizer is built on ``hpz_mesh(...)`` (deepspeed_zeropp.py)."""


MAX_CONFIG_BYTES = 16 << 20
"""A DeepSpeed config is a few KiB; anything this large is the wrong file."""
MAX_DEPTH = 32
"""Sections nest three or four deep; deeper is the wrong file (and would recurse without end)."""


def _depth(node: Any, limit: int = MAX_DEPTH) -> int:
    """Nesting depth of a JSON value, without recursion (a hostile file may nest 100k deep)."""
    deepest, todo = 0, [(node, 1)]
    while todo:
        n, d = todo.pop()
        deepest = max(deepest, d)
        if d > limit:
            return d
        if isinstance(n, Mapping):
            todo.extend((v, d + 1) for v in n.values())
        elif isinstance(n, (list, tuple)):
            todo.extend((v, d + 1) for v in n)
    return deepest


def _read_json_file(path: str) -> Any:
    """A regular file of at most MAX_CONFIG_BYTES of UTF-8 JSON; errors name the file."""
    try:  # O_NONBLOCK: a FIFO must not hang start-up; it is refused below as not a regular file
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise ValueError(f"cannot open the DeepSpeed config {path!r}: {exc.strerror}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"the DeepSpeed config {path!r} is not a regular file; pass a .json file")
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(MAX_CONFIG_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > MAX_CONFIG_BYTES:
        raise ValueError(f"the DeepSpeed config {path!r} is over {MAX_CONFIG_BYTES >> 20} MiB: not a config file")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"the DeepSpeed config {path!r} is not UTF-8 text (byte {exc.start}); pass a JSON file") \
            from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from None
    except RecursionError:
        raise ValueError(f"the DeepSpeed config {path!r} nests deeper than a config does; pass a DeepSpeed "
                         "JSON file") from None


def load_config(config: Union[None, str, os.PathLike, Mapping]) -> dict:
    if config is None:
        return {}
    if isinstance(config, Mapping):
        if _depth(config) > MAX_DEPTH:
            raise ValueError(f"the config dict nests more than {MAX_DEPTH} levels deep; a DeepSpeed config does not")
        try:
            return json.loads(json.dumps(config))  # a private deep copy; refuses non-JSON values early
        except (TypeError, ValueError) as exc:
            raise TypeError(f"the config dict holds a value JSON cannot hold ({exc}); use numbers, strings, "
                            "booleans, lists and dicts") from None
    if not isinstance(config, (str, os.PathLike)):
        raise TypeError(f"config={config!r}: pass a path to a DeepSpeed JSON file or a dict")
    path = os.fspath(config)
    raw = _read_json_file(path)
    if not isinstance(raw, dict):
        raise ValueError(f"{path} holds a {type(raw).__name__}; a DeepSpeed config is a JSON object")
    if _depth(raw) > MAX_DEPTH:
        raise ValueError(f"the DeepSpeed config {path!r} nests more than {MAX_DEPTH} levels deep; a config does not")
    return raw


def _leaves(node: Any, prefix: str = "") -> list[str]:
    """Dotted paths of the non-dict values under ``node`` (an empty section has none)."""
    if isinstance(node, dict):
        return [leaf for k, v in node.items() for leaf in _leaves(v, f"{prefix}{k}.")]
    return [prefix[:-1]]


class _Reader:
    """Reads dotted paths of the raw config, remembering which keys were consumed."""

    def __init__(self, raw: dict, overrides: Mapping[str, Any], auto: Mapping[str, Any]) -> None:
        self.raw, self.overrides, self.auto = raw, overrides, auto
        self.used: set[str] = set()

    def has(self, path: str) -> bool:
        node: Any = self.raw
        for part in path.split("."):
            if not isinstance(node, dict) or part not in node:
                return False
            node = node[part]
        return True

    def get(self, path: str, default: Any = None, override: Optional[str] = None, auto: Any = "error") -> Any:
        """The value at ``path`` (``default`` if absent); an override wins; "auto" resolves to
        the override, else to ``auto`` unless that is "error"."""
        node: Any = self.raw
        for part in path.split("."):
            node = node.get(part, None) if isinstance(node, dict) else None
        present = self.has(path)
        if present:
            self.used.update(_leaves(node, path + ".") if isinstance(node, dict) else [path])
        if override is not None and self.overrides.get(override) is not None:
            return self.overrides[override]
        if node == PLACEHOLDER:
            if override is not None and self.auto.get(override) is not None:
                return self.auto[override]
            if auto != "error":
                return auto
            hint = f"pass {override}=... to zeroshard.initialize" if override else "give a value"
            raise ValueError(f"{path} is 'auto' (a placeholder the Hugging Face Trainer fills in); {hint}")
        return node if present else default

    def mark(self, path: str) -> None:
        if self.has(path):
            node: Any = self.raw
            for part in path.split("."):
                node = node[part]
            self.used.update(_leaves(node, path + "."))


def _named(r: _Reader, path: str, override: Optional[str]) -> str:
    """How to name a setting in an error: the override if one was given, else the config key."""
    return override if override is not None and r.overrides.get(override) is not None else path


def _offload(r: _Reader, section: str) -> tuple[Optional[str], Optional[str]]:
    device = r.get(f"zero_optimization.{section}.device", "none")
    if not isinstance(device, (str, type(None))) or device not in ("none", "cpu", "nvme", None):
        raise ValueError(f"zero_optimization.{section}.device={device!r}: use 'none', 'cpu' or 'nvme'")
    path = r.get(f"zero_optimization.{section}.nvme_path")
    if path is not None and (not isinstance(path, str) or not path):
        raise ValueError(f"zero_optimization.{section}.nvme_path={path!r} must be a directory path (a string)")
    ratio = r.get(f"zero_optimization.{section}.ratio", 1.0)
    if ratio != 1.0:
        r.used.discard(f"zero_optimization.{section}.ratio")  # partial offload: left as unsupported
    return (None if device in ("none", None) else device), path


def _zero(r: _Reader, precision: Optional[str]) -> dict:
    stage = r.get("zero_optimization.stage", 0, override="stage")
    if isinstance(stage, bool) or not isinstance(stage, int) or stage not in (0, 1, 2, 3):
        raise ValueError(f"{_named(r, 'zero_optimization.stage', 'stage')}={stage!r}: use 0, 1, 2 or 3 (an int)")
    out: dict[str, Any] = {"stage": stage}
    legacy_cpu = r.get("zero_optimization.cpu_offload", False)
    if not isinstance(legacy_cpu, bool):
        raise ValueError(f"zero_optimization.cpu_offload={legacy_cpu!r} must be true or false")
    opt_dev, opt_path = _offload(r, "offload_optimizer")
    par_dev, par_path = _offload(r, "offload_param")
    out["offload_optimizer"] = r.overrides.get("offload_optimizer") or opt_dev or ("cpu" if legacy_cpu else None)
    out["offload_params"] = r.overrides.get("offload_params") or par_dev
    paths = {p for p in (opt_path, par_path) if p}
    if len(paths) > 1 and not r.overrides.get("nvme_path"):
        raise ValueError(f"offload_optimizer.nvme_path and offload_param.nvme_path differ ({sorted(paths)}); "
                         "zeroshard uses one swap directory: make them equal or pass nvme_path=...")
    out["nvme_path"] = r.overrides.get("nvme_path") or (paths.pop() if paths else None)
    placement = Placement(out["offload_optimizer"], out["offload_params"])
    if not (placement.state_swapped or placement.params_swapped) and not r.overrides.get("nvme_path"):
        out["nvme_path"] = None  # (DeepSpeed ignores an nvme_path beside device "cpu" or "none" too)
    # DeepSpeed sizes buckets in elements; zeroshard in MiB of parameter data.
    elements = r.get("zero_optimization.reduce_bucket_size", None, auto=None)
    gather = r.get("zero_optimization.allgather_bucket_size", None, auto=None)
    elements = elements if elements is not None else gather
    if r.overrides.get("bucket_size_mb") is not None:
        out["bucket_size_mb"] = float(r.overrides["bucket_size_mb"])
    elif elements is not None:
        if isinstance(elements, bool) or not isinstance(elements, (int, float)) or not 0 < elements < 2**62:
            key = "reduce_bucket_size" if r.has("zero_optimization.reduce_bucket_size") else "allgather_bucket_size"
            raise ValueError(f"zero_optimization.{key}={elements!r} must be a positive element count, e.g. 5e8")
        itemsize = 4 if precision is None else 2
        out["bucket_size_mb"] = float(elements) * itemsize / 2**20
    return out


def _precision(r: _Reader) -> tuple[Optional[str], dict]:
    forced = r.overrides.get("mixed_precision")
    # "enabled": "auto" reads as None: on only when mixed_precision= asks for that dtype.
    fp16_flag = r.get("fp16.enabled", False, auto=None)
    bf16_flag = r.get("bf16.enabled", r.get("bfloat16.enabled", False, auto=None), auto=None)
    for key, flag in (("fp16.enabled", fp16_flag), ("bf16.enabled" if r.has("bf16") else "bfloat16.enabled", bf16_flag)):
        if flag is not None and not isinstance(flag, bool):
            raise ValueError(f"{key}={flag!r} must be true, false or \"auto\"")
    for section in ("fp16", "bf16", "bfloat16"):
        if r.has(section) and not isinstance(r.raw[section], dict):
            raise ValueError(f"{section}={r.raw[section]!r} must be an object, e.g. {{\"enabled\": true}}")
    wanted = forced if forced is not None else r.auto.get("mixed_precision")
    fp16 = fp16_flag is True or (fp16_flag is None and wanted == "fp16")
    bf16 = bf16_flag is True or (bf16_flag is None and wanted == "bf16")
    scaler: dict[str, Any] = {}
    if not (fp16 or forced == "fp16"):
        r.mark("fp16")  # a disabled section's other keys do not matter
    else:
        if r.get("fp16.loss_scale", 0) != 0:
            r.used.discard("fp16.loss_scale")  # static loss scale: unsupported (dynamic only)
        power = r.get("fp16.initial_scale_power", 16)
        if isinstance(power, bool) or not isinstance(power, int) or not 0 <= power <= 64:
            raise ValueError(f"fp16.initial_scale_power={power!r} must be an int in [0, 64] (the scale is 2**power)")
        window = r.get("fp16.loss_scale_window", 1000)
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"fp16.loss_scale_window={window!r} must be a positive int (steps)")
        scaler["initial_loss_scale"] = 2.0 ** power
        scaler["loss_scale_growth_interval"] = window
        if r.get("fp16.min_loss_scale", 1) != 1:
            r.used.discard("fp16.min_loss_scale")
        if r.get("fp16.auto_cast", False):
            r.used.discard("fp16.auto_cast")
    if not bf16:
        r.mark("bf16")
        r.mark("bfloat16")
    if fp16 and bf16 and forced is None:
        raise ValueError("fp16.enabled and bf16.enabled are both true; enable one")
    precision = forced if forced is not None else ("fp16" if fp16 else "bf16" if bf16 else None)
    return precision, scaler if precision == "fp16" else {}


_SUPPORTED_TYPES = (f"{sorted(_OPTIMIZERS.values())} (DeepSpeed's names, any case), \"Muon\" (Muon's recipe) or "
                    "another torch.optim optimizer class by name, e.g. \"RMSprop\", \"Adafactor\"")


def _is_torch_optimizer(name: str) -> bool:
    """A concrete optimizer class of torch.optim (not the base class, a module or a function)."""
    cls = getattr(torch.optim, name, None)
    return isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer) and cls is not torch.optim.Optimizer


def _optimizer(r: _Reader, unsupported: list[str]) -> tuple[Optional[type], dict]:
    cls = r.overrides.get("optimizer")
    name = r.get("optimizer.type")
    kwargs: dict[str, Any] = {}
    if r.has("optimizer") and not isinstance(r.raw["optimizer"], dict):
        raise ValueError(f"optimizer={r.raw['optimizer']!r} must be an object with \"type\" and \"params\"")
    params = r.raw.get("optimizer", {}).get("params", {})
    if not isinstance(params, dict):
        raise ValueError(f"optimizer.params={params!r} must be an object, e.g. {{\"lr\": 1e-4}}")
    if cls is None and name is None:
        if r.has("optimizer") and r.raw["optimizer"]:  # params without a type: nothing would read them
            raise ValueError(f"the optimizer section has no optimizer.type; set it to one of {_SUPPORTED_TYPES}")
        return None, {}
    if cls is None and not isinstance(name, str):
        raise ValueError(f"optimizer.type={name!r} must be a name, one of {_SUPPORTED_TYPES}")
    if cls is None:
        key = str(name).lower()
        if key in _REFUSED_OPTIMIZERS or (key not in _OPTIMIZERS and not _is_torch_optimizer(str(name))):
            raise ValueError(f"optimizer.type={name!r} is not supported; use one of {_SUPPORTED_TYPES}")
        if key == "adam":  # DeepSpeed's "Adam" is AdamW unless adam_w_mode is false
            mode = r.get("optimizer.params.adam_w_mode", True)
            if not isinstance(mode, bool):
                raise ValueError(f"optimizer.params.adam_w_mode={mode!r} must be true or false")
            cls = torch.optim.AdamW if mode else torch.optim.Adam
        elif key == "muon":  # (the recipe: Note [Muon from a config] in zeroshard/optim/muon_recipe.py)
            cls = torch.optim.Muon
        else:
            cls = getattr(torch.optim, _OPTIMIZERS.get(key, str(name)))
        if key in ("adam", "adamw") and params.get("torch_adam") is not True:
            # DeepSpeed's FusedAdam default; with torch_adam DeepSpeed builds torch's class, whose
            # default (AdamW: 0.01) then applies.
            kwargs["weight_decay"] = 0.0
    if str(name).lower() in ("adam", "adamw"):
        r.get("optimizer.params.adam_w_mode")
    accepted = set(inspect.signature(cls.__init__).parameters) - {"self", "params"}
    if cls is torch.optim.Muon:
        accepted |= set(ADAM_KEYS)
    for key in params:
        path = f"optimizer.params.{key}"
        if path in NOTED or (key == "adam_w_mode" and path in r.used):
            continue
        if key == "bias_correction" and params[key] is True:
            r.get(path)
            continue
        if key not in accepted:
            unsupported.append(path)
            continue
        value = r.get(path, override=key if key in OVERRIDES else None)
        kwargs[key] = tuple(value) if key in ("betas", "adam_betas") and isinstance(value, list) else value
    for key in ("lr", "weight_decay", "betas", "eps", "momentum"):
        if r.overrides.get(key) is not None:
            kwargs[key] = r.overrides[key]
    check_hyperparameters({k: v for k, v in kwargs.items() if k not in r.overrides}, where="optimizer.params.")
    check_hyperparameters({k: v for k, v in kwargs.items() if k in r.overrides})
    return cls, kwargs


def _scheduler(r: _Reader) -> tuple[Optional[str], dict]:
    name = r.overrides.get("scheduler") or r.get("scheduler.type")
    if name is None:
        return None, {}
    if not isinstance(name, str) or name not in _SCHEDULERS:
        raise ValueError(f"scheduler.type={name!r} is not supported; use one of {list(_SCHEDULERS)}")
    raw = r.raw.get("scheduler", {}).get("params", {}) if isinstance(r.raw.get("scheduler"), dict) else {}
    if not isinstance(raw, dict):
        raise ValueError(f"scheduler.params={raw!r} must be an object, e.g. {{\"warmup_num_steps\": 100}}")
    params: dict[str, Any] = {}
    for key in raw:
        path = f"scheduler.params.{key}"
        if key == "warmup_max_lr":  # "auto": the optimizer's lr (the schedule's None)
            params[key] = r.get(path, auto=None)
        elif key == "warmup_min_lr":  # "auto": 0, the value the Hugging Face Trainer fills in
            params[key] = r.get(path, override=key, auto=0.0)
        else:
            params[key] = r.get(path, override=key if key in OVERRIDES else None)
    for key in ("total_num_steps", "warmup_num_steps", "warmup_min_lr"):
        if r.overrides.get(key) is not None:
            params[key] = r.overrides[key]
    if name == "WarmupLR":
        params.pop("total_num_steps", None)  # WarmupLR has no end: a total is meaningless here
    check_schedule_params(name, {k: v for k, v in params.items() if k != "last_batch_iteration"})
    return name, params


def _batch(r: _Reader, world_size: int) -> tuple[Optional[int], int, Optional[int]]:
    micro = r.get("train_micro_batch_size_per_gpu", None, override="micro_batch_size")
    accum = r.get("gradient_accumulation_steps", None, override="gradient_accumulation_steps")
    total = r.get("train_batch_size", None, override="train_batch_size", auto=None)
    for name, override, v in (("train_micro_batch_size_per_gpu", "micro_batch_size", micro),
                              ("gradient_accumulation_steps", "gradient_accumulation_steps", accum),
                              ("train_batch_size", "train_batch_size", total)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"{_named(r, name, override)}={v!r} must be a positive int"
                             + (" (a bool is not one)" if isinstance(v, bool) else ""))
    # DeepSpeed's rule: train_batch_size = micro * accumulation * world size; derive the missing one.
    if total is not None and micro is not None and accum is not None:
        if total != micro * accum * world_size:
            raise ValueError(f"train_batch_size={total} != train_micro_batch_size_per_gpu={micro} x "
                             f"gradient_accumulation_steps={accum} x world size {world_size}; fix one of them")
    elif total is not None and micro is not None:
        accum, rem = divmod(total, micro * world_size)
        if rem or accum < 1:
            raise ValueError(f"train_batch_size={total} is not a multiple of micro batch {micro} x world {world_size}")
    elif total is not None:
        accum = accum or 1
        micro, rem = divmod(total, accum * world_size)
        if rem or micro < 1:
            raise ValueError(f"train_batch_size={total} is not a multiple of accumulation {accum} x world {world_size}")
    accum = accum or 1
    if micro is not None:
        total = micro * accum * world_size
    return micro, accum, total


def translate(config: Union[None, str, os.PathLike, Mapping], world_size: int = 1,
              overrides: Optional[Mapping[str, Any]] = None, strict: bool = True,
              auto: Optional[Mapping[str, Any]] = None) -> DeepSpeedPlan:
    """The zeroshard meaning of a DeepSpeed config (path or dict). Unsupported keys raise a
    ValueError naming each one (``strict=False``: a warning); noted keys warn once."""
    overrides, auto = dict(overrides or {}), dict(auto or {})
    unknown = sorted((set(overrides) | set(auto)) - set(OVERRIDES))
    if unknown:
        raise TypeError(f"unknown override(s) {unknown}; accepted: {list(OVERRIDES)}")
    r = _Reader(load_config(config), overrides, auto)
    unsupported: list[str] = []
    precision, scaler = _precision(r)
    zero = {**_zero(r, precision), "mixed_precision": precision, **scaler}
    zeropp, hpz_size = zeropp_options(r.get, r.used.discard, world_size, zero["stage"])
    zero.update(zeropp)
    if overrides.get("redundancy") is not None:  # (no DeepSpeed key: zeroshard's own, checked by ZeroConfig)
        zero["redundancy"] = overrides["redundancy"]
    comm_dtype = r.get("communication_data_type", None, override="reduce_dtype")
    if comm_dtype is not None:
        names = {"fp32": None, "float32": None, "fp16": "fp16", "float16": "fp16", "bf16": "bf16", "bfloat16": "bf16"}
        if not isinstance(comm_dtype, str) or comm_dtype not in names:
            raise ValueError(f"communication_data_type={comm_dtype!r}: use one of {sorted(names)}")
        zero["reduce_dtype"] = names[comm_dtype]
    opt_cls, opt_kwargs = _optimizer(r, unsupported)
    sched, sched_params = _scheduler(r)
    micro, accum, total = _batch(r, world_size)
    clip = r.get("gradient_clipping", None, override="gradient_clipping")
    if clip is not None:
        # A negative max norm would flip every gradient (ascent); 0 means no clipping.
        check_real("gradient_clipping", clip, low=0.0, unit="the max global gradient norm; 0 disables clipping")
    for path, neutral in (("prescale_gradients", False), ("gradient_predivide_factor", 1.0)):
        if r.get(path, neutral) != neutral:
            r.used.discard(path)
    steps_per_print = r.get("steps_per_print")
    if steps_per_print is not None:
        check_int("steps_per_print", steps_per_print, low=1)
    noted = {p: NOTED[p] for p in NOTED if r.has(p)}
    noted.update({p: "DeepSpeed async-I/O tuning; zeroshard sizes its own I/O" for s in NOTED_SECTIONS
                  if r.has(s) for p in _leaves(r.raw[s], s + ".")})
    activations = read_section(r.raw.get(SECTION))  # (zeroshard/train/deepspeed_activations.py)
    noted.update(activations.noted)
    r.used.update(activations.used)
    if activations.offload_activations is not None:
        zero["offload_activations"] = activations.offload_activations
    for p in noted:
        r.used.add(p)
    unsupported += [p for p in _leaves(r.raw) if p and p not in r.used]
    unsupported = sorted(set(unsupported))
    if unsupported:
        msg = (f"DeepSpeed config keys zeroshard does not support: {unsupported}. Remove them, or pass "
               "strict=False to train without them (see zeroshard/train/deepspeed_config.py for what is read)")
        if strict:
            raise ValueError(msg)
        warnings.warn(msg, stacklevel=3)
    if noted:
        warnings.warn("DeepSpeed config keys without effect in zeroshard: " +
                      "; ".join(f"{p} ({why})" for p, why in noted.items()), stacklevel=3)
    try:  # (one validator: the options the config maps to are ZeroConfig's, checked by it: Note [one validator])
        ZeroConfig(**zero)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"DeepSpeed config: {exc}") from None
    return DeepSpeedPlan(zero=zero, optimizer_class=opt_cls, optimizer_kwargs=opt_kwargs, scheduler=sched,
                         scheduler_params=sched_params, gradient_clipping=float(clip) if clip else None,
                         gradient_accumulation_steps=accum, micro_batch_size=micro, train_batch_size=total,
                         steps_per_print=steps_per_print, noted=noted, hpz_partition_size=hpz_size)
