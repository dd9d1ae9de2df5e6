"""The file system torch's DCP writer writes through during a zeroshard DCP save: every file's
size and CRC32 taken from the bytes as they are written (for ``zeroshard-dcp.json``), so the
commit does not read the files back.

The sum is taken in ``write`` itself, not on a worker thread: the writer's buffers may be
temporary (a zip header) or freed once ``write`` returns (a chunk copied off the GPU), so a
thread would need a copy of each, and measured on this machine the copy and the hand-off cost
more than the overlap saved (Note [DCP format mapping]).
"""
from __future__ import annotations

import io
import os
import zlib
from contextlib import contextmanager
from pathlib import Path
from typing import Generator

from torch.distributed.checkpoint.filesystem import FileSystem

from zeroshard.checkpoint import commit


class _Summed(io.RawIOBase):
    """A binary file opened for writing, summed as it is written."""

    def __init__(self, f: io.BufferedWriter) -> None:
        super().__init__()
        self.f, self.size, self.crc = f, 0, 0

    def writable(self) -> bool:
        return True

    def write(self, b: "bytes | bytearray | memoryview") -> int:  # type: ignore[override]
        view = memoryview(b).cast("B")
        self.crc = zlib.crc32(view, self.crc)
        n = self.f.write(view)
        self.size += len(view)
        return n if n is not None else len(view)

    def tell(self) -> int:
        return self.f.tell()

    def flush(self) -> None:
        self.f.flush()

    def fileno(self) -> int:
        return self.f.fileno()

    def finish(self) -> tuple[int, int]:
        return self.size, self.crc


class SummingFileSystem(FileSystem):
    """torch's ``FileSystem`` that records ``{file name: (size, crc32)}`` of what it wrote."""

    def __init__(self) -> None:
        super().__init__()
        self.sums: dict[str, tuple[int, int]] = {}

    @contextmanager
    def create_stream(self, path: "str | os.PathLike", mode: str) -> Generator[io.IOBase, None, None]:
        if mode != "wb":
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with Path(path).open("wb") as f:
            summed = _Summed(f)
            try:
                yield summed
            finally:
                self.sums[Path(path).name] = summed.finish()
        commit._point("dcp-file")  # (a data file or .metadata.tmp written; fsynced when sync_files)

    def rename(self, path: "str | os.PathLike", new_path: "str | os.PathLike") -> None:
        commit._point("dcp-metadata-rename")
        super().rename(path, new_path)
        if Path(path).name in self.sums:
            self.sums[Path(new_path).name] = self.sums.pop(Path(path).name)
