"""Per-rank random number generator states (python, numpy, torch CPU, CUDA) as JSON."""
from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from zeroshard.checkpoint import jsontree
from zeroshard.checkpoint.checkpoint_errors import CheckpointCorruptError


def capture() -> dict[str, Any]:
    state: dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state(),
                             "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return jsontree.encode(state, "rng")


def check(encoded: Any, path: str) -> dict[str, Any]:
    """The decoded RNG state of one rank, each part tried on a throwaway generator first, so a
    malformed file (``{"python": 5}``) is refused before any global generator is touched."""
    state = jsontree.decode(encoded, path)
    if not isinstance(state, dict) or not {"python", "numpy", "torch"} <= set(state):
        raise CheckpointCorruptError(f"{path}: not an RNG state (needs python, numpy and torch states)")
    try:
        py = state["python"]
        if not (isinstance(py, (list, tuple)) and len(py) == 3 and isinstance(py[1], (list, tuple))):
            raise TypeError("the python state is not (version, internal state, gauss)")
        py = (py[0], tuple(py[1]), py[2])
        random.Random().setstate(py)
        np.random.RandomState().set_state(state["numpy"])
        if not isinstance(state["torch"], torch.Tensor) or state["torch"].dtype != torch.uint8:
            raise TypeError("the torch state is not a uint8 tensor")
        torch.Generator().set_state(state["torch"])
        cuda = state.get("cuda", [])
        if not isinstance(cuda, list) or not all(isinstance(t, torch.Tensor) and t.dtype == torch.uint8 for t in cuda):
            raise TypeError("the cuda states are not a list of uint8 tensors")
    except (TypeError, ValueError, OverflowError, IndexError, KeyError, RuntimeError) as exc:
        raise CheckpointCorruptError(f"{path}: malformed RNG state ({exc})") from None
    state["python"] = py
    return state


def restore(state: dict[str, Any]) -> None:
    """Sets every generator from a state ``check`` returned."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        cuda = state["cuda"]
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)
