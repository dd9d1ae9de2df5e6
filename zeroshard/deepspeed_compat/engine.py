"""``DeepSpeedEngine``: the object ``deepspeed.initialize`` returns, over a ZeroOptimizer.

The engine owns the loop steps DeepSpeed's engine owns, with DeepSpeed's semantics
(``deepspeed/runtime/engine.py``, 0.19):

- ``backward(loss)`` divides the loss by ``gradient_accumulation_steps`` (``scale_wrt_gas``)
  and runs backward through the optimizer (fp16: the loss scale);
- ``step()`` counts micro-steps; at the accumulation boundary (every
  ``gradient_accumulation_steps``-th call) it measures the global gradient norm, clips to
  ``gradient_clipping``, steps the optimizer, then the schedule (not after an fp16 overflow),
  and zeroes the gradients; in between it does nothing else;
- ``save_checkpoint(dir, tag)`` writes ``dir/tag`` and a ``dir/latest`` file naming the tag;
  ``load_checkpoint(dir)`` follows ``latest`` and returns ``(path, client_state)``.

Underneath, checkpoints are zeroshard's (``dir/tag/step-NNNNNNNN``: sharded, no pickle,
loadable at any world size); the engine's counters and ``client_state`` travel in ``extra``.
Unlike DeepSpeed, loading also restores the RNG states (zeroshard's resume is bit-exact).
"""
from __future__ import annotations

import os
import warnings
from typing import Any, Optional

import torch
from torch import nn
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import DataLoader

from zeroshard.checkpoint import load_checkpoint, locate, save_checkpoint
from zeroshard.checkpoint.safe_fs import read_small
from zeroshard.checkpoint.checkpoint_errors import CheckpointCorruptError
from zeroshard.optim.zero_optimizer import ZeroOptimizer
from zeroshard.train.deepspeed_config import DeepSpeedPlan

LATEST = "latest"
"""DeepSpeed's pointer file: ``save_dir/latest`` holds the tag of the newest checkpoint."""
MAX_TAG = 255

_EXTRA_ENGINE = "deepspeed_engine"
_EXTRA_CLIENT = "client_state"

# DeepSpeed engine methods the front does not provide, and what to use instead.
_NOT_PROVIDED = {
    "save_16bit_model": "zeroshard.full_state_dict(engine.module) or zeroshard.export_hf(step_dir, out)",
    "save_fp16_model": "zeroshard.full_state_dict(engine.module) or zeroshard.export_hf(step_dir, out)",
    "no_sync": "accumulate with gradient_accumulation_steps in the config (zeroshard reduces every micro-step)",
    "set_train_batch_size": "set train_batch_size / gradient_accumulation_steps in the config",
    "set_gradient_accumulation_boundary": "let step() count micro-steps (gradient_accumulation_steps)",
    "eval_batch": "pipeline parallelism is not supported",
    "train_batch": "pipeline parallelism is not supported",
}


def check_tag(tag: object, where: str) -> str:
    """A checkpoint tag is one directory name: never a path (``latest`` is read from disk)."""
    if not isinstance(tag, str) or not tag or len(tag) > MAX_TAG or tag in (".", "..") or \
            any(c in tag for c in ("/", "\\", "\0", "\n")):
        raise ValueError(f"{where}: tag {tag!r} must be one directory name (no '/', not '..'), "
                         "e.g. 'global_step100'")
    return tag


def read_latest_tag(load_dir: str) -> Optional[str]:
    """The tag ``load_dir/latest`` names, or None when there is no such file."""
    path = os.path.join(load_dir, LATEST)
    if not os.path.lexists(path):
        return None
    try:
        raw = read_small(path, MAX_TAG + 2)
    except CheckpointCorruptError as exc:
        raise ValueError(f"{path} cannot be read as DeepSpeed's 'latest' file: {exc}") from None
    try:
        text = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not text; DeepSpeed's 'latest' file holds a tag such as 'global_step100'") \
            from None
    return check_tag(text, path)


def _write_latest(save_dir: str, tag: str) -> None:
    tmp = os.path.join(save_dir, f".{LATEST}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(tag)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(save_dir, LATEST))


def _converted(root: str) -> bool:
    """The newest step under ``root`` came from ``convert_deepspeed``: its RNG states are the
    converting process's, not the training run's, so they are not restored (DeepSpeed's own
    resume leaves the RNG alone too)."""
    try:
        found = [root] if locate.is_step_dir(root) else locate.candidates(root)
        extra = locate.check_step(found[0])["trainer"]["extra"] if found else None
    except (CheckpointCorruptError, KeyError, TypeError):
        return False  # (load_checkpoint reports what is wrong with it)
    return isinstance(extra, dict) and "converted_from" in extra


class DeepSpeedEngine(nn.Module):
    """Wraps ``module`` as DeepSpeed's engine does; attributes it lacks are the module's."""

    def __init__(self, module: nn.Module, optimizer: ZeroOptimizer, lr_scheduler: Optional[LRScheduler], plan: DeepSpeedPlan,
                 config: dict, training_dataloader: Optional[DataLoader] = None, device: Optional[torch.device] = None) -> None:
        super().__init__()
        self.module = module
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.training_dataloader = training_dataloader
        self.plan = plan
        self.config = config
        self._device = device if device is not None else torch.device("cpu")
        self.global_steps = 0
        """Optimizer steps taken (boundaries passed), as DeepSpeed counts them."""
        self.global_samples = 0
        self.micro_steps = 0
        self.skipped_steps = 0
        """Boundaries whose step an fp16 overflow skipped."""
        self._global_grad_norm: Optional[float] = None
        self._step_applied = False

    # -- attributes ---------------------------------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            pass
        if name in _NOT_PROVIDED:
            raise AttributeError(f"DeepSpeedEngine.{name} is not supported by zeroshard's DeepSpeed front; "
                                 f"use {_NOT_PROVIDED[name]}")
        module = self._modules.get("module")
        if module is not None and not name.startswith("__"):
            return getattr(module, name)  # (DeepSpeed's engine passes unknown attributes to the model too)
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", "0"))

    @property
    def global_rank(self) -> int:
        return self.optimizer.engine.comm.rank

    @property
    def world_size(self) -> int:
        return self.optimizer.data_parallel_size

    @property
    def dp_world_size(self) -> int:
        return self.optimizer.data_parallel_size

    def gradient_accumulation_steps(self) -> int:
        return self.plan.gradient_accumulation_steps

    def train_micro_batch_size_per_gpu(self) -> Optional[int]:
        return self.plan.micro_batch_size

    def train_batch_size(self) -> Optional[int]:
        return self.plan.train_batch_size

    def gradient_clipping(self) -> float:
        return self.plan.gradient_clipping or 0.0

    def zero_optimization_stage(self) -> int:
        return self.optimizer.stage

    def get_lr(self) -> list:
        return [g["lr"] for g in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> Optional[float]:
        """The global gradient norm (before clipping) of the last boundary; None before one."""
        return self._global_grad_norm

    def was_step_applied(self) -> bool:
        """The last boundary stepped the optimizer (False after an fp16 overflow)."""
        return self._step_applied

    def is_gradient_accumulation_boundary(self) -> bool:
        """The current micro-step (the one the next ``step()`` ends) completes an accumulation."""
        return (self.micro_steps + 1) % self.plan.gradient_accumulation_steps == 0

    # -- the loop -----------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        """Backward of ``loss`` divided by the accumulation steps (``scale_wrt_gas``); returns
        the loss so divided, as DeepSpeed does."""
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"engine.backward(loss): loss must be a tensor, got {type(loss).__name__}")
        if scale_wrt_gas and self.plan.gradient_accumulation_steps > 1:
            loss = loss / self.plan.gradient_accumulation_steps
        self.optimizer.backward(loss, retain_graph=retain_graph)
        return loss

    def step(self) -> None:
        """At the accumulation boundary: clip, optimizer step, schedule step, zero the
        gradients; otherwise only counts the micro-step."""
        if self.is_gradient_accumulation_boundary():
            self._take_model_step()
        self.micro_steps += 1

    def _take_model_step(self) -> None:
        opt = self.optimizer
        clip = self.plan.gradient_clipping
        # (an infinite bound measures the norm without changing a gradient)
        norm = opt.clip_grad_norm_(clip if clip else float("inf"))
        self._global_grad_norm = float(norm)
        skipped_before = opt.engine.scaler.skipped_steps if opt.engine.scaler is not None else 0
        opt.step()
        overflow = opt.engine.scaler is not None and opt.engine.scaler.skipped_steps != skipped_before
        self._step_applied = not overflow
        if overflow:
            self.skipped_steps += 1
        elif self.lr_scheduler is not None:
            self.lr_scheduler.step()
        opt.zero_grad()
        self.global_steps += 1
        self.global_samples += self.plan.train_batch_size or 0

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    # -- checkpoints --------------------------------------------------------------------------
    def save_checkpoint(self, save_dir: str, tag: Optional[str] = None, client_state: Optional[dict] = None,
                        save_latest: bool = True, exclude_frozen_parameters: bool = False) -> bool:
        """Saves to ``save_dir/tag`` (default ``global_step<N>``) and, with ``save_latest``,
        points ``save_dir/latest`` at it. A collective: every rank calls it. ``client_state``:
        numbers, strings, lists, dicts and tensors (stored as JSON, never pickle)."""
        if not isinstance(save_dir, (str, os.PathLike)):
            raise TypeError(f"save_checkpoint: save_dir={save_dir!r} must be a path")
        if client_state is not None and not isinstance(client_state, dict):
            raise TypeError(f"save_checkpoint: client_state must be a dict, got {type(client_state).__name__}")
        if exclude_frozen_parameters:
            raise ValueError("save_checkpoint(exclude_frozen_parameters=True) is not supported: zeroshard "
                             "never writes frozen weights (it records their digest); drop the argument")
        save_dir = os.fspath(save_dir)
        tag = check_tag(f"global_step{self.global_steps}" if tag is None else tag, "save_checkpoint")
        extra = {_EXTRA_ENGINE: {"global_steps": self.global_steps, "global_samples": self.global_samples,
                                 "skipped_steps": self.skipped_steps},
                 _EXTRA_CLIENT: dict(client_state or {})}
        os.makedirs(save_dir, exist_ok=True)
        save_checkpoint(os.path.join(save_dir, tag), self.global_steps, model=self.module,
                        optimizer=self.optimizer, scheduler=self.lr_scheduler, extra=extra)
        comm = self.optimizer.engine.comm
        if save_latest and comm.rank == 0:
            _write_latest(save_dir, tag)
        comm.barrier()  # (every rank then sees the new 'latest', as DeepSpeed's barrier ensures)
        return True

    def load_checkpoint(self, load_dir: str, tag: Optional[str] = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, custom_load_fn: object = None, *,
                        load_rng: bool = True) -> tuple:
        """Loads ``load_dir/tag`` (default: the tag ``load_dir/latest`` names) at any world
        size; returns ``(path, client_state)``, or ``(None, None)`` with a warning when there is
        nothing to load (DeepSpeed's behaviour).

        Unlike DeepSpeed it also restores each rank's Python, numpy and torch (CPU, CUDA) random
        states as they were at the save, so a resumed run draws what the uninterrupted one
        would. ``load_rng=False`` keeps DeepSpeed's behaviour: the generators are left as the
        script seeded them."""
        if not isinstance(load_rng, bool):
            raise TypeError(f"load_checkpoint(load_rng={load_rng!r}) must be True or False")
        refused = [name for name, value, default in (
            ("load_module_strict", load_module_strict, True), ("load_optimizer_states", load_optimizer_states, True),
            ("load_lr_scheduler_states", load_lr_scheduler_states, True),
            ("load_module_only", load_module_only, False), ("custom_load_fn", custom_load_fn, None))
            if value != default]
        if refused:
            raise ValueError(f"load_checkpoint({', '.join(refused)}=...) is not supported by zeroshard's DeepSpeed "
                             "front: it restores the whole training state; for weights alone use "
                             "zeroshard.load_checkpoint(path, model=model)")
        if not isinstance(load_dir, (str, os.PathLike)):
            raise TypeError(f"load_checkpoint: load_dir={load_dir!r} must be a path")
        load_dir = os.fspath(load_dir)
        if tag is None:
            tag = read_latest_tag(load_dir)
            if tag is None:
                warnings.warn(f"Unable to find latest file at {os.path.join(load_dir, LATEST)}: nothing loaded. "
                              "Pass tag=... to load a given checkpoint", stacklevel=2)
                return None, None
        tag = check_tag(tag, "load_checkpoint")
        root = os.path.join(load_dir, tag)
        if not os.path.isdir(root):
            warnings.warn(f"checkpoint {root} does not exist: nothing loaded", stacklevel=2)
            return None, None
        if any(n.endswith("_model_states.pt") for n in os.listdir(root)):
            raise ValueError(f"{root} is a DeepSpeed checkpoint; convert it first: zeroshard convert-deepspeed "
                             f"{root} OUT, then engine.load_checkpoint(OUT)")
        info = load_checkpoint(root, model=self.module, optimizer=self.optimizer, scheduler=self.lr_scheduler,
                               load_rng=load_rng and not _converted(root))
        extra = info["extra"] if isinstance(info["extra"], dict) else {}
        engine = extra.get(_EXTRA_ENGINE) or {}
        self.global_steps = int(engine.get("global_steps", info["step"]))
        self.global_samples = int(engine.get("global_samples",
                                             self.global_steps * (self.plan.train_batch_size or 0)))
        self.skipped_steps = int(engine.get("skipped_steps", 0))
        return info["path"], extra.get(_EXTRA_CLIENT, {})
