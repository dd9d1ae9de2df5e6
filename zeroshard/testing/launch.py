"""Starting N local ranks on gloo: for the demo, the tests and the benchmarks.

Real training is launched with ``torchrun``; this helper exists so a single command can
show (and test) real multi-process behaviour on one machine without a launcher.

Note [start method]: a "spawn" child imports torch and zeroshard afresh, about 3 s of CPU per
rank, which dominated the test suite on 2 cores (a 2-rank job of one all-reduce: 9 s). With
``ZEROSHARD_START_METHOD=forkserver`` (the test suite sets it) the ranks fork from one server
that imported them once (the same job: under 1 s). A forked child gets the server's environment,
so each child takes the caller's environment as it starts; variables read when a process or a
library starts (the allocator's, OpenMP's, the interpreter's) cannot be applied that way, so
when they differ from the server's the ranks are spawned. A forked child also leaves through
``os._exit``: no ``atexit`` handlers run in it, which is why "spawn" stays the default.
``ZEROSHARD_FORKSERVER_PRELOAD`` (comma-separated modules) adds to what the server imports: the
test suite adds transformers' GPT-2 and Llama models, 2 s of CPU that each rank building one
paid again (Hugging Face's variables, read as it starts, then count among those above).
"""
from __future__ import annotations

import datetime
import gc
import os
import socket
import time
import traceback
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, Any, Callable, Literal

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

if TYPE_CHECKING:
    from multiprocessing.context import ForkServerContext, SpawnContext


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Variables read when a process or a library starts (Note [start method]).
_EXEC_TIME = ("MALLOC_", "LD_", "OMP_", "KMP_", "GOMP_", "MKL_", "PYTHON", "GLIBC_", "ZEROSHARD_HUGE_PAGES",
              "ZEROSHARD_FORKSERVER_PRELOAD", "HF_", "TRANSFORMERS_")
_server_env: dict[str, str] | None = None


def _exec_time_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith(_EXEC_TIME)}


def _start_method() -> Literal["spawn", "forkserver"]:
    """"spawn", or "forkserver" when asked for and the process-start environment is the server's."""
    global _server_env
    method = os.environ.get("ZEROSHARD_START_METHOD", "spawn")
    if method not in ("spawn", "forkserver"):
        raise ValueError(f"ZEROSHARD_START_METHOD={method!r}: use 'spawn' (the default) or 'forkserver'")
    if method == "spawn":
        return "spawn"
    if _server_env is None:  # (the server starts with the first rank, in this environment)
        extra = [m.strip() for m in os.environ.get("ZEROSHARD_FORKSERVER_PRELOAD", "").split(",") if m.strip()]
        # (torch's dynamo, pipelining and DCP are imported by zeroshard where first used, Note
        # [pipelining imported on first use]; the server imports them once for every rank it forks)
        mp.set_forkserver_preload(["torch", "torch.distributed", "zeroshard", "torch._dynamo",
                                   "torch.distributed.pipelining", "torch.distributed.checkpoint", *extra])
        _server_env = _exec_time_env()
    elif _exec_time_env() != _server_env:
        return "spawn"
    return "forkserver"


def _context(method: Literal["spawn", "forkserver"]) -> SpawnContext | ForkServerContext:
    return mp.get_context("spawn") if method == "spawn" else mp.get_context("forkserver")


def _adopt(env: dict[str, str] | None) -> None:
    if env is not None:  # forked from the server: the caller's environment (Note [start method])
        os.environ.clear()
        os.environ.update(env)


def _entry(rank: int, world_size: int, port: int, threads: int, fn: Callable, args: tuple,
           errors: Any, env: dict[str, str] | None = None) -> None:
    _adopt(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(threads)
    try:
        timeout = datetime.timedelta(seconds=float(os.environ.get("ZEROSHARD_PG_TIMEOUT", "300")))
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timeout)
        fn(rank, world_size, *args)
    except BaseException:
        errors.put((rank, traceback.format_exc()))
        raise
    finally:
        # Free cycles holding process groups and let gloo threads drop finished work (which
        # takes the GIL) while Python is alive: at interpreter exit that aborts the process.
        gc.collect()
        if dist.is_initialized():
            dist.destroy_process_group()
        time.sleep(0.05)


def _run_alone(fn: Callable, args: tuple, env: dict[str, str] | None, threads: int) -> None:
    _adopt(env)
    torch.set_num_threads(threads)
    fn(*args)


def start_process(fn: Callable, *args: object, threads: int = 1) -> BaseProcess:
    """Starts one process running ``fn(*args)`` (no process group), the way ``spawn`` starts
    ranks (Note [start method]); returns the started ``multiprocessing`` process. For a child
    that is meant to die (a crash test kills it mid-save) without paying for a fresh import."""
    method = _start_method()
    proc = _context(method).Process(
        target=_run_alone, args=(fn, args, dict(os.environ) if method == "forkserver" else None, threads))
    proc.start()
    return proc


def spawn(fn: Callable, world_size: int, *args: Any, threads: int | None = None) -> None:
    """Runs ``fn(rank, world_size, *args)`` in ``world_size`` gloo processes; raises with the
    failing rank's traceback. ``fn`` must be importable (module level)."""
    if threads is None:
        threads = max(1, (os.cpu_count() or 1) // world_size)
    method = _start_method()
    ctx = _context(method)
    errors = ctx.SimpleQueue()
    port = free_port()
    env = dict(os.environ) if method == "forkserver" else None
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, threads, fn, args, errors, env))
             for r in range(world_size)]
    for p in procs:
        p.start()
    # A rank that dies leaves the others blocked in a collective: stop them after a grace.
    failed_at = None
    while any(p.is_alive() for p in procs):
        time.sleep(0.05)
        if failed_at is None and any(p.exitcode not in (None, 0) for p in procs):
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > 10:
            for p in procs:
                if p.is_alive():
                    p.terminate()
    for p in procs:
        p.join()
    failed = [p.exitcode for p in procs if p.exitcode != 0]
    if failed:
        msgs = []
        while not errors.empty():
            rank, tb = errors.get()
            msgs.append(f"--- rank {rank} ---\n{tb}")
        raise RuntimeError(f"{len(failed)} of {world_size} ranks failed (exit codes {failed})\n" + "\n".join(msgs))
