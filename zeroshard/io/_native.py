"""Finds the native I/O engine: installed by setup.py, else built just in time, else None.

Same order, cache directory, crash-safe build lock and JIT builder as the Adam kernels
(``zeroshard/ops/_loader.py``); the extension is small (pybind11 only, no torch headers),
so a JIT build takes seconds. ``ZEROSHARD_DISABLE_KERNELS=1`` or ``ZEROSHARD_NO_JIT=1``
behave as for the kernels.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import threading
from dataclasses import dataclass
from types import ModuleType
from typing import Optional

from zeroshard.ops._build_spec import AIO, csrc_dir
from zeroshard.ops._loader import _jit_build, cache_dir

_MODULE = f"zeroshard.io.{AIO.name}"


@dataclass(frozen=True)
class NativeState:
    module: Optional[ModuleType]
    source: str
    """"installed", "jit" or "none"."""
    reason: str


def _stale_installed() -> Optional[str]:
    """Why the setup.py-built module is older than csrc/aio (editable installs), or None."""
    found = importlib.util.find_spec(_MODULE)
    root = csrc_dir()
    if found is None or not found.origin or root is None:
        return None
    built = os.path.getmtime(found.origin)
    newer = [s for s in AIO.sources if os.path.getmtime(os.path.join(root, s)) > built]
    return f"installed module is older than {', '.join(newer)}" if newer else None


def _find() -> NativeState:
    if os.environ.get("ZEROSHARD_DISABLE_KERNELS", "0") == "1":
        return NativeState(None, "none", "disabled by ZEROSHARD_DISABLE_KERNELS=1")
    installed_error = _stale_installed()
    if installed_error is None:
        try:
            return NativeState(importlib.import_module(_MODULE), "installed", "built by setup.py")
        except ImportError as exc:
            installed_error = str(exc)
    if os.environ.get("ZEROSHARD_NO_JIT", "0") == "1":
        return NativeState(None, "none", f"not installed ({installed_error}) and ZEROSHARD_NO_JIT=1")
    try:
        return NativeState(_jit_build(AIO), "jit",
                           f"built just in time in {cache_dir()} (setup.py module: {installed_error})")
    except Exception as exc:  # no compiler or headers: the Python backend runs instead
        text = str(exc).strip()
        first = text.splitlines()[0] if text else repr(exc)
        return NativeState(None, "none", f"JIT build failed: {type(exc).__name__}: {first}")


_lock = threading.Lock()
_state: Optional[NativeState] = None


def native() -> NativeState:
    """The native engine's state, looked for (and built) at most once per process."""
    global _state
    with _lock:
        if _state is None:
            _state = _find()
        return _state
