"""The storage writer of a zeroshard DCP save: torch's ``FileSystemWriter`` (its planning,
file names, ``.metadata`` and rename) with its ``write_data`` replaced by one that writes each
rank's one data file item by item, holding one chunk at a time.

Note [DCP streaming writer]: why not torch's own ``write_data``:
- it keeps every tensor it wrote to a file alive until the file is closed (a dict it fills
  for its safetensors variant), so an offline conversion that reads each chunk from disk as
  the writer asks would hold the whole state;
- it writes each chunk with ``torch.save``, whose per-record CRC32 (a second pass over the
  bytes that no reader checks by default; the checksum file beside ``.metadata`` covers every
  file) can only be turned off through a global switch (``torch.serialization.set_crc32_options``:
  a module global in older torch, which every thread's ``torch.save`` would see meanwhile;
  context-local in torch 2.13, where it still changes every ``torch.save`` of the saving
  thread and of contexts copied from it until restored).
Each blob here is what ``torch.save`` writes with the CRC32 off, through torch's own zip
writer given the option directly: same bytes, same loader, no global touched.
"""
from __future__ import annotations

import os
import pickle
from typing import IO, cast

import torch
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, FileSystemWriter, _StorageInfo
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from zeroshard.checkpoint.dcp_summing import SummingFileSystem


def save_blob(tensor: object, stream: IO[bytes]) -> None:
    """``torch.save(tensor, stream)`` without the per-record CRC32, leaving torch's switch alone."""
    writer = torch._C.PyTorchFileWriter(stream, False, torch.serialization._get_storage_alignment())
    torch.serialization._save(tensor, writer, pickle, torch.serialization.DEFAULT_PROTOCOL, False)
    writer.write_end_of_file()


class StreamingWriter(FileSystemWriter):
    """``FileSystemWriter`` writing ``__{rank}_0.distcp`` one item at a time (see the module)."""

    def __init__(self, path: str, fs: SummingFileSystem) -> None:
        super().__init__(path, single_file_per_rank=True, sync_files=True, thread_count=1)
        self.fs = fs

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        name = f"{plan.storage_data.prefix}0{DEFAULT_SUFFIX}"
        results = []
        # (torch's order: the bytes entries, then the tensors, each as the planner resolves it)
        items = [i for i in plan.items if i.type == WriteItemType.BYTE_IO] + \
            [i for i in plan.items if i.type != WriteItemType.BYTE_IO]
        with self.fs.create_stream(self.fs.concat_path(self.path, name), "wb") as stream:
            for item in items:
                offset = stream.tell()
                data = planner.resolve_data(item)
                if item.type == WriteItemType.BYTE_IO:
                    stream.write(data.getbuffer())  # type: ignore[union-attr]
                else:
                    tensor = data.detach().cpu()  # type: ignore[union-attr]
                    if tensor.untyped_storage().size() != tensor.nbytes:  # (torch.save writes whole storages)
                        tensor = tensor.clone()
                    save_blob(tensor, cast(IO[bytes], stream))
                    del tensor
                del data  # (one chunk at a time: a conversion's chunk read from disk goes now)
                length = stream.tell() - offset
                results.append(WriteResult(index=item.index, size_in_bytes=length,
                                           storage_data=_StorageInfo(name, offset, length)))
            stream.flush()
            os.fsync(stream.fileno())
        done: Future[list[WriteResult]] = Future()
        done.set_result(results)
        return done
