"""A DCP ``.metadata`` is a pickle: zeroshard reads it with an unpickler that admits only DCP's
metadata classes, and never follows a data file path out of the checkpoint directory."""
from __future__ import annotations

import os
import pickle

import pytest
import torch
from torch.distributed.checkpoint import metadata as md
from torch.distributed.checkpoint.filesystem import _StorageInfo

from zeroshard.checkpoint import dcp_metadata
from zeroshard.checkpoint.checkpoint_errors import CheckpointCorruptError


class _Payload:
    """Unpickling this would create the marker file (os.system runs a shell command)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _metadata(path: str = "__0_0.distcp", extra: object = None) -> md.Metadata:
    size = torch.Size([4, 3])
    props = md.TensorProperties(dtype=torch.float32)
    meta = md.Metadata(state_dict_metadata={
        "model.w": md.TensorStorageMetadata(props, size, [md.ChunkStorageMetadata(torch.Size([0, 0]), size)])})
    meta.storage_data = {md.MetadataIndex("model.w", torch.Size([0, 0])): _StorageInfo(path, 0, 10)}
    meta.planner_data = extra
    return meta


def test_metadata_that_would_run_code_is_refused_and_nothing_runs(tmp_path):
    marker = tmp_path / "marker"
    (tmp_path / ".metadata").write_bytes(pickle.dumps(_metadata(extra=_Payload(str(marker)))))
    with pytest.raises(CheckpointCorruptError, match=r"\.metadata: refused \(global posix\.system"):
        dcp_metadata.read_metadata(str(tmp_path))
    assert not marker.exists()
    # (the same payload through the plain unpickler does run: the test's payload is real)
    pickle.loads(pickle.dumps(_Payload(str(marker))))
    assert marker.exists()


def test_metadata_of_dcp_classes_reads(tmp_path):
    (tmp_path / ".metadata").write_bytes(pickle.dumps(_metadata()))
    meta = dcp_metadata.read_metadata(str(tmp_path))
    assert meta.state_dict_metadata["model.w"].size == torch.Size([4, 3])


@pytest.mark.parametrize("path", ["../outside.distcp", "/etc/passwd", "sub/../../x", "..", ""])
def test_data_file_paths_never_leave_the_directory(tmp_path, path):
    (tmp_path / ".metadata").write_bytes(pickle.dumps(_metadata(path)))
    with pytest.raises(CheckpointCorruptError, match="leaves the checkpoint directory"):
        dcp_metadata.read_metadata(str(tmp_path))


def test_chunk_blob_is_loaded_weights_only(tmp_path):
    marker = tmp_path / "marker2"
    blob = tmp_path / "blob"
    torch.save({"x": _Payload(str(marker))}, str(blob))
    with pytest.raises(CheckpointCorruptError, match="not a readable tensor or value blob"):
        dcp_metadata.load_blob(blob.read_bytes(), "chunk")
    assert not marker.exists()
