"""An activation record's file checksum (Note [activation file checksum] in
zeroshard/offload/activations/block_record.py): computed during the copy out (CRC-32C) or after it
(crc32), over the whole file, alignment gaps included; a permuted saved tensor comes back with its
bytes and strides; a flipped byte is an error naming the block, with either algorithm."""
from __future__ import annotations

import os

import pytest
import torch

from zeroshard.io.aio_engine import AsyncIO
from zeroshard.offload.activations.block_record import BlockActivations
from zeroshard.resilience import checksum


@pytest.fixture(scope="module")
def io():
    engine = AsyncIO()
    yield engine
    engine.close()


@pytest.mark.parametrize("algorithm", ["crc32c", "crc32"])
def test_file_checksum_covers_the_file_and_a_flipped_byte_names_the_block(io, tmp_path, algorithm):
    if algorithm == "crc32c" and checksum.native() is None:
        pytest.skip(f"no CRC-32C kernel: {checksum.reason}")
    torch.manual_seed(0)
    saved = [torch.randn(5, 7), torch.randn(6, 3, 4).permute(2, 0, 1), torch.arange(11, dtype=torch.int64)]
    record = BlockActivations("blocks.3", 1, torch.device("cpu"), algorithm=algorithm)
    for t in saved:
        record.add(t)
    record.move_out(io, str(tmp_path))
    record.written(wait=True)
    with open(record.path, "rb") as f:
        raw = f.read()
    assert len(raw) == record.nbytes > record.moved  # (alignment gaps between the entries)
    assert record._crc == checksum.of(algorithm, torch.frombuffer(bytearray(raw), dtype=torch.uint8))
    back = [record.tensor(i, io) for i in range(len(saved))]
    assert all(torch.equal(a, b) and a.stride() == b.stride() for a, b in zip(saved, back))

    again = BlockActivations("blocks.4", 2, torch.device("cpu"), algorithm=algorithm)
    again.add(saved[1])
    again.move_out(io, str(tmp_path))
    again.written(wait=True)
    with open(again.path, "r+b") as f:
        f.seek(17)
        byte = f.read(1)
        f.seek(17)
        f.write(bytes([byte[0] ^ 0x10]))
    with pytest.raises(RuntimeError, match=r"block 'blocks.4'.*checksum does not match"):
        again.tensor(0, io)
    again.discard()
    record.discard()
    assert not os.listdir(tmp_path)
