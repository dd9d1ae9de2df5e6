"""Per-rank random number generator states (python, numpy, torch CPU, CUDA) as JSON."""
from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from zeroshard.checkpoint import jsontree


def capture() -> dict[str, Any]:
    state: dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state(),
                             "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return jsontree.encode(state, "rng")


def restore(encoded: dict[str, Any]) -> None:
    state = jsontree.decode(encoded)
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        cuda = state["cuda"]
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)
