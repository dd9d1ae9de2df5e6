"""Running a worker on N gloo ranks and reading back each rank's JSON results."""
from __future__ import annotations

import json
import os
from typing import Any, Callable

from zeroshard.testing.launch import spawn


def run_ranks(fn: Callable, world: int, directory: str, *args: Any) -> list[dict]:
    """``fn(rank, world, out_path, *args)`` writes ``{out_path}.rank{r}``; returns them in rank order."""
    out = os.path.join(str(directory), "res")
    spawn(fn, world, out, *args)
    return [json.load(open(f"{out}.rank{r}")) for r in range(world)]
