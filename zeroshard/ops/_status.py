"""``kernel_status()``: which kernels are active, the instruction set dispatched, and why not."""
from __future__ import annotations

from typing import Any

from ._loader import REGISTRY, cache_dir


def kernel_status() -> dict[str, Any]:
    """Loads (or JIT-builds) the kernels if not done yet and describes the outcome.

    Keys: ``cpu_adam`` and ``cuda_adam``, each with ``active``, ``source`` ("installed",
    "jit" or "none") and ``reason``; ``cpu_adam`` adds ``isa`` (dispatched instruction set),
    ``supported_isas`` and ``threads``; plus ``cache_dir`` and ``fallback``.
    """
    cpu = REGISTRY.cpu()
    cuda = REGISTRY.cuda()
    cpu_info: dict[str, Any] = {"active": cpu.module is not None, "source": cpu.source, "reason": cpu.reason}
    if cpu.module is not None:
        cpu_info.update(isa=cpu.module.isa(), supported_isas=list(cpu.module.supported_isas()),
                        threads=cpu.module.max_threads())
    cuda_info: dict[str, Any] = {"active": cuda.module is not None, "source": cuda.source, "reason": cuda.reason}
    inactive = [name for name, state in (("cpu_adam", cpu), ("cuda_adam", cuda)) if state.module is None]
    return {
        "cpu_adam": cpu_info,
        "cuda_adam": cuda_info,
        "cache_dir": cache_dir(),
        "fallback": ("pure-PyTorch reference step for " + ", ".join(inactive)) if inactive else "none needed",
    }
