"""``deepspeed.accelerator.get_accelerator()``: the device questions DeepSpeed scripts ask.

    from zeroshard.accelerator import get_accelerator      # `import zeroshard as deepspeed`:
    device = get_accelerator().device_name(local_rank)     # deepspeed.accelerator.get_accelerator()

Most DeepSpeedExamples scripts ask DeepSpeed's accelerator, not torch, which device to use,
which backend to start, how to seed and how to pin. ``Accelerator`` answers the common surface
of DeepSpeed's ``DeepSpeedAccelerator`` for the two devices zeroshard runs on: CUDA when
``torch.cuda.is_available()``, else the CPU (answered as DeepSpeed's CPU accelerator answers:
device name "cpu", backend "gloo", pinning a no-op). Names outside that surface (op builders,
graphs, Triton) raise an AttributeError that says so, rather than returning a guess.
"""
from __future__ import annotations

import os
import contextlib
from types import ModuleType
from typing import Callable, ContextManager, NoReturn, Optional, Union

import torch

# DeepSpeed accelerator names this front does not provide (DeepSpeed's op builders compile its
# own kernels; zeroshard's are loaded by zeroshard.ops).
_NOT_PROVIDED = ("op_builder_dir", "create_op_builder", "get_op_builder", "build_extension", "create_graph",
                 "capture_to_graph", "replay_graph", "is_triton_supported", "get_compile_backend",
                 "set_compile_backend", "register_host_memory", "unregister_host_memory")


class Accelerator:
    """DeepSpeed's accelerator interface over torch's CUDA or the CPU (``cuda``: which)."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self._name = "cuda" if cuda else "cpu"
        self._communication_backend_name = "nccl" if cuda else "gloo"

    def __repr__(self) -> str:
        return f"zeroshard Accelerator({self._name!r}, backend {self._communication_backend_name!r})"

    def __getattr__(self, name: str) -> NoReturn:
        if name in _NOT_PROVIDED:
            raise AttributeError(f"get_accelerator().{name} is not provided by zeroshard's DeepSpeed front "
                                 "(zeroshard builds its own kernels: python -m zeroshard.ops)")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    # -- which device ----------------------------------------------------------------------------
    def device_name(self, device_index: Optional[int] = None) -> str:
        if device_index is None or not self.cuda:
            return self._name
        return f"cuda:{int(device_index)}"

    def device(self, device_index: Optional[int] = None) -> Optional[torch.device]:
        return torch.device("cuda", device_index) if self.cuda and device_index is not None else None

    def set_device(self, device_index: int) -> None:
        if self.cuda:
            torch.cuda.set_device(device_index)

    def current_device(self) -> int:
        # (DeepSpeed's CPU accelerator answers LOCAL_RANK: one "device" per local process)
        return torch.cuda.current_device() if self.cuda else int(os.environ.get("LOCAL_RANK", 0))

    def current_device_name(self) -> str:
        return f"cuda:{torch.cuda.current_device()}" if self.cuda else "cpu"

    def device_count(self) -> int:
        return torch.cuda.device_count() if self.cuda else int(os.environ.get("LOCAL_WORLD_SIZE", 1))

    def is_available(self) -> bool:
        return torch.cuda.is_available() if self.cuda else True

    def is_synchronized_device(self) -> bool:
        return not self.cuda

    def use_host_timers(self) -> bool:
        return self.is_synchronized_device()

    def resolves_data_dependency(self) -> bool:
        return self.is_synchronized_device()

    def handles_memory_backpressure(self) -> bool:
        return self.is_synchronized_device()

    def synchronize(self, device_index: Optional[int] = None) -> None:
        if self.cuda:
            torch.cuda.synchronize(device_index)

    def communication_backend_name(self) -> str:
        return self._communication_backend_name

    def visible_devices_envs(self) -> list[str]:
        return ["CUDA_VISIBLE_DEVICES"] if self.cuda else []

    # -- random numbers --------------------------------------------------------------------------
    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)  # (seeds CUDA's generators too)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def initial_seed(self) -> int:
        return torch.cuda.initial_seed() if self.cuda else torch.initial_seed()

    def random(self) -> ModuleType:
        return torch.random

    def get_rng_state(self, device_index: Optional[int] = None) -> torch.Tensor:
        if self.cuda:
            return torch.cuda.get_rng_state("cuda" if device_index is None else device_index)
        return torch.get_rng_state()

    def set_rng_state(self, new_state: torch.Tensor, device_index: Optional[int] = None) -> None:
        if self.cuda:
            torch.cuda.set_rng_state(new_state, "cuda" if device_index is None else device_index)
        else:
            torch.set_rng_state(new_state)

    def default_generator(self, device_index: int) -> torch.Generator:
        return torch.cuda.default_generators[device_index] if self.cuda else torch.default_generator

    # -- streams and events (CPU: none, as DeepSpeed's CPU accelerator) ----------------------------
    @property
    def Stream(self) -> Optional[type]:  # noqa: N802 (DeepSpeed's name)
        return torch.cuda.Stream if self.cuda else None

    @property
    def Event(self) -> Optional[type]:  # noqa: N802 (DeepSpeed's name)
        return torch.cuda.Event if self.cuda else None

    def stream(self, stream: Optional[torch.cuda.Stream]) -> ContextManager[object]:
        return torch.cuda.stream(stream) if self.cuda else contextlib.nullcontext()

    def current_stream(self, device_index: Optional[int] = None) -> Optional[torch.cuda.Stream]:
        return torch.cuda.current_stream(device_index) if self.cuda else None

    def default_stream(self, device_index: Optional[int] = None) -> Optional[torch.cuda.Stream]:
        return torch.cuda.default_stream(device_index) if self.cuda else None

    def range_push(self, msg: str) -> None:
        if self.cuda:
            torch.cuda.nvtx.range_push(msg)

    def range_pop(self) -> None:
        if self.cuda:
            torch.cuda.nvtx.range_pop()

    def lazy_call(self, callback: Callable[[], object]) -> None:
        if self.cuda:
            torch.cuda._lazy_call(callback)
        else:
            callback()

    def amp(self) -> Optional[ModuleType]:
        return torch.amp if self.cuda else None

    # -- memory ------------------------------------------------------------------------------------
    def empty_cache(self) -> None:
        if self.cuda:
            torch.cuda.empty_cache()

    def memory_allocated(self, device_index: Optional[int] = None) -> int:
        return torch.cuda.memory_allocated(device_index) if self.cuda else _rss()

    def max_memory_allocated(self, device_index: Optional[int] = None) -> int:
        return torch.cuda.max_memory_allocated(device_index) if self.cuda else _rss()

    def reset_max_memory_allocated(self, device_index: Optional[int] = None) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(device_index)

    def memory_reserved(self, device_index: Optional[int] = None) -> int:
        return torch.cuda.memory_reserved(device_index) if self.cuda else _rss()

    def max_memory_reserved(self, device_index: Optional[int] = None) -> int:
        return torch.cuda.max_memory_reserved(device_index) if self.cuda else _rss()

    memory_cached = memory_reserved
    max_memory_cached = max_memory_reserved

    def reset_max_memory_cached(self, device_index: Optional[int] = None) -> None:
        self.reset_max_memory_allocated(device_index)

    def reset_peak_memory_stats(self, device_index: Optional[int] = None) -> None:
        self.reset_max_memory_allocated(device_index)

    def memory_stats(self, device_index: Optional[int] = None) -> dict:
        return torch.cuda.memory_stats(device_index) if self.cuda else {}

    def total_memory(self, device_index: Optional[int] = None) -> int:
        if self.cuda:
            return torch.cuda.get_device_properties(device_index or 0).total_memory
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def available_memory(self, device_index: Optional[int] = None) -> int:
        if self.cuda:
            return torch.cuda.mem_get_info(device_index)[0]
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")

    # -- dtypes ------------------------------------------------------------------------------------
    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_bf16_supported() if self.cuda else True

    def is_fp16_supported(self) -> bool:
        return self.cuda

    def is_fp64_supported(self) -> bool:
        return True

    def supported_dtypes(self) -> list[torch.dtype]:
        out = [torch.float, torch.bfloat16] if self.is_bf16_supported() else [torch.float]
        return out + ([torch.half] if self.is_fp16_supported() else [])

    # -- host memory ---------------------------------------------------------------------------
    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        # (DeepSpeed's CPU accelerator returns the tensor: there is no device to pin for)
        return tensor.pin_memory() if self.cuda else tensor

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned() if self.cuda else False

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self._name

    def export_envs(self) -> list[str]:
        return ["NCCL"] if self.cuda else []


def _rss() -> int:
    """This process's resident memory in bytes (the CPU's "allocated")."""
    with open("/proc/self/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


_ACCELERATOR: Optional[Accelerator] = None
_NAMES = {"cuda": True, "cpu": False}  # (set_accelerator's names: whether CUDA)


def get_accelerator() -> Accelerator:
    """The process's accelerator: CUDA when torch sees a GPU, else the CPU (decided once)."""
    global _ACCELERATOR
    if _ACCELERATOR is None:
        _ACCELERATOR = Accelerator(torch.cuda.is_available())
    return _ACCELERATOR


def set_accelerator(accel: Union[Accelerator, str]) -> None:
    """DeepSpeed's ``set_accelerator``: ``"cuda"``, ``"cpu"`` or an ``Accelerator``."""
    global _ACCELERATOR
    if isinstance(accel, str):
        if accel not in _NAMES:
            raise ValueError(f"set_accelerator({accel!r}): zeroshard's front knows {sorted(_NAMES)}")
        accel = Accelerator(_NAMES[accel])
    if not isinstance(accel, Accelerator):
        raise TypeError(f"set_accelerator: expected 'cuda', 'cpu' or an Accelerator, got {type(accel).__name__}")
    _ACCELERATOR = accel


__all__ = ["Accelerator", "get_accelerator", "set_accelerator"]
