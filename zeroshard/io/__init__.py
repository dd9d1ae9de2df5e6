"""Asynchronous file I/O of large CPU tensors (the layer NVMe offload sits on).

Public surface:

- ``AsyncIO(block_size=8 << 20, queue_depth=16, use_direct=True)``: ``pwrite``/``pread``
  return a ``Handle`` (``wait()``, ``done()``); ``wait_all()``, ``close()``.
- ``aligned_empty(numel, dtype)``: 4096-byte-aligned (pinned when CUDA is there) buffers.
- ``checksum(tensor)``: CRC-32 of a tensor's bytes, cheap enough to run per block.
- ``engine_status()``: which backend runs (native thread pool or Python threads) and why.
- Errors: ``AIOError`` (an ``OSError``), ``DiskFullError``, ``TruncatedFileError``.

``zeroshard bench aio --path DIR`` measures a disk and recommends block size and queue depth.
"""
from __future__ import annotations

from .buffers import aligned_empty, checksum
from .aio_config import ALIGN, AIOConfig
from .aio_engine import AsyncIO
from .io_errors import AIOError, DiskFullError, TruncatedFileError
from .handle import Handle
from .status import engine_status

__all__ = ["AsyncIO", "Handle", "AIOConfig", "ALIGN", "aligned_empty", "checksum", "engine_status",
           "AIOError", "DiskFullError", "TruncatedFileError"]
