"""Starting N local ranks on gloo: for the demo, the tests and the benchmarks.

Real training is launched with ``torchrun``; this helper exists so a single command can
show (and test) real multi-process behaviour on one machine without a launcher.
"""
from __future__ import annotations

import datetime
import gc
import os
import socket
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, threads: int, fn: Callable, args: tuple,
           errors: Any) -> None:
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


def spawn(fn: Callable, world_size: int, *args: Any, threads: int | None = None) -> None:
    """Runs ``fn(rank, world_size, *args)`` in ``world_size`` gloo processes; raises with the
    failing rank's traceback. ``fn`` must be importable (module level)."""
    if threads is None:
        threads = max(1, (os.cpu_count() or 1) // world_size)
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, threads, fn, args, errors))
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
