"""torch DCP's checkpointable protocol on a stage-3 piece (``stages/sharded_tensor.py``).

A stage-3 ``model.state_dict()`` holds, per parameter, the piece this rank owns (flat elements
``[start, start + n)`` of the whole). Handed to ``dcp.save`` / ``dcp.load`` (as torch's
``get_state_dict`` / ``get_model_state_dict`` hand it), torch would take it for a whole
replicated tensor; with the three methods DTensor implements it is written and read as the
chunks (``layout/boxes.py``) this rank holds: ``dcp.save`` writes each rank's boxes, ``dcp.load``
reads the overlapping chunks of any DCP checkpoint straight into the piece's storage, and the
``load_state_dict`` that follows writes them through the unit (master, gathered copy).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from zeroshard.layout.boxes import Box, boxes

if TYPE_CHECKING:  # (imported where DCP calls: torch.distributed.checkpoint costs 0.8 s of CPU per process)
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
    from torch.distributed.checkpoint.planner import WriteItem


class DcpChunks:
    """Mixed into the stage-3 piece class: needs ``shape``, ``dtype``, ``start``, ``n``, ``local``."""

    shape: torch.Size
    dtype: torch.dtype
    start: int
    n: int

    if TYPE_CHECKING:  # (the piece class's own property; declared here for the type checker only)
        @property
        def local(self) -> torch.Tensor: ...

    def _boxes(self) -> list[Box]:
        return boxes(tuple(self.shape), self.start, self.start + self.n)

    def __create_write_items__(self, fqn: str, obj: object) -> list[WriteItem]:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
        return [WriteItem(index=MetadataIndex(fqn, torch.Size(o)), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s)),
                                                      properties=TensorProperties(dtype=self.dtype), size=self.shape))
                for o, s, _, _ in self._boxes()]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
        return [ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s)) for o, s, _, _ in self._boxes()]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        want = tuple(index.offset or ())
        for o, s, lo, hi in self._boxes():
            if o == want:
                return self.local[lo - self.start:hi - self.start].view(s)
        raise ValueError(f"{index.fqn}: no chunk at offsets {list(want)} on this rank "
                         f"(it holds elements [{self.start}, {self.start + self.n}) of {list(self.shape)})")
