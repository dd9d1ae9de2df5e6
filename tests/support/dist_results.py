"""Running a worker on N gloo ranks and reading back each rank's JSON results."""
from __future__ import annotations

import json
import os
from typing import Any, Callable

from zeroshard.testing.launch import spawn

# Note [one thread per test rank]: spawn's default gives a lone rank every core (2 on CI). The
# suite's ranks train models of a few thousand elements, below torch's intra-op grain, so a
# second thread only spins in OpenMP's barrier; on a shared 2-core machine that spinning took
# the world-1 drop-in ranks from 35 s to 347 s (load 6). Each rank computes its reference in
# the same process, at the same thread count, so the compared results do not depend on it.
TEST_RANK_THREADS = 1


def run_ranks(fn: Callable, world: int, directory: str, *args: Any) -> list[dict]:
    """``fn(rank, world, out_path, *args)`` writes ``{out_path}.rank{r}``; returns them in rank order."""
    out = os.path.join(str(directory), "res")
    spawn(fn, world, out, *args, threads=TEST_RANK_THREADS)
    return [json.load(open(f"{out}.rank{r}")) for r in range(world)]
