"""Running a worker on N gloo ranks and reading back each rank's JSON results."""
from __future__ import annotations

import json
import os
import threading
from typing import TYPE_CHECKING, Any, Callable, Hashable, Mapping, TypeVar

from zeroshard.testing.launch import spawn

# Note [one thread per test rank]: spawn's default gives a lone rank every core (2 on CI). The
# suite's ranks train models of a few thousand elements, below torch's intra-op grain, so a
# second thread only spins in OpenMP's barrier; on a shared 2-core machine that spinning took
# the world-1 drop-in ranks from 35 s to 347 s (load 6). Each rank computes its reference in
# the same process, at the same thread count, so the compared results do not depend on it.
TEST_RANK_THREADS = 1

if TYPE_CHECKING:
    import pytest

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


def run_ranks(fn: Callable, world: int, directory: str, *args: Any) -> list[dict]:
    """``fn(rank, world, out_path, *args)`` writes ``{out_path}.rank{r}``; returns them in rank order."""
    out = os.path.join(str(directory), "res")
    spawn(fn, world, out, *args, threads=TEST_RANK_THREADS)
    return [json.load(open(f"{out}.rank{r}")) for r in range(world)]


# Note [launches side by side]: a module that checks one worker at world 1 and world 2 used to
# launch them one after the other; the world-1 rank is one single-threaded process (Note [one
# thread per test rank]), so one of CI's 2 cores idled for its whole run (44 s of the drop-in
# module's 93 s). ``together`` starts the launches at once: each is the same launch, in its own
# directory, with the same results (no check compares times), only the cores are busy sooner.
def together(calls: Mapping[K, Callable[[], V]]) -> dict[K, V]:
    """Runs each call in its own thread and returns ``{key: result}``; a call's exception is
    raised here (the first one by key order) once every call has ended."""
    results: dict[K, V] = {}
    errors: dict[K, BaseException] = {}

    def run(key: K, call: Callable[[], V]) -> None:
        try:
            results[key] = call()
        except BaseException as exc:  # (re-raised in the caller's thread below)
            errors[key] = exc

    threads = [threading.Thread(target=run, args=(k, c), name=f"launch-{k}") for k, c in calls.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for key in calls:
        if key in errors:
            raise errors[key]
    return results


def selected_params(request: pytest.FixtureRequest, argname: str, default: tuple = ()) -> list:
    """The values of parameter ``argname`` that this session's selected tests of the requesting
    module use, in first-use order (with ``--quick`` or ``-k`` only some worlds are launched)."""
    seen: list = []
    for item in request.session.items:
        spec = getattr(item, "callspec", None)
        if item.path == request.path and spec is not None and argname in spec.params:
            if spec.params[argname] not in seen:
                seen.append(spec.params[argname])
    return seen or list(default)


def run_worlds(fn: Callable, worlds: list[int], directory: Callable[[int], str], *args: Any) -> dict[int, list[dict]]:
    """``run_ranks(fn, world, directory(world), *args)`` for each world, side by side (Note [launches
    side by side]); ``{world: ranks}``."""
    dirs = {w: directory(w) for w in worlds}  # (made here: tmp_path_factory is not for threads)
    return together({w: (lambda w=w: run_ranks(fn, w, dirs[w], *args)) for w in worlds})
