"""The memory tier's slot checksum (Note [slot checksum]): CRC-32C computed in the copy's pass
over the whole slot, gaps included, and a read that verifies with the algorithm its stamp names."""
import os
import shutil

import pytest
import torch

from zeroshard.resilience import checksum, slots


def test_copy_in_checksums_the_whole_slot_in_the_copy_pass_and_a_read_catches_a_torn_byte(tmp_path):
    if checksum.native() is None:
        # (a machine without a C++ compiler lacks the capability; with one, a kernel that did not
        # build is a failure, not a skip)
        if shutil.which(os.environ.get("CXX", "c++")) is not None:
            pytest.fail(f"the CRC-32C kernel did not build although a C++ compiler is here: {checksum.reason}")
        pytest.skip(f"no C++ compiler here: the CRC-32C kernel cannot be built ({checksum.reason})")
    known = torch.frombuffer(bytearray(b"123456789"), dtype=torch.uint8)
    assert checksum.of(checksum.CRC32C, known) == 0xE3069283  # (the standard CRC-32C check value)
    a = torch.randn(1000)
    b = torch.arange(77, dtype=torch.bfloat16)
    c = torch.randn(8, 6).t()  # (not contiguous: copied by torch, then summed)
    buf = torch.zeros(4000 + 256 + 512, dtype=torch.uint8)
    tensors = [(4000 + 64, b), (0, a), (4000 + 256, c)]
    crc = checksum.copy_in(checksum.CRC32C, buf, tensors)
    assert torch.equal(buf[:4000].view(torch.float32), a)
    assert torch.equal(buf[4064:4064 + 154].view(torch.bfloat16), b)
    assert torch.equal(buf[4256:4256 + 192].view(torch.float32), c.reshape(-1))
    assert crc == checksum.of(checksum.CRC32C, buf)  # (one pass: the same value as a pass over the slot)
    assert checksum.copy_in(checksum.CRC32, buf.clone(), tensors) == checksum.of(checksum.CRC32, buf)
    slot = slots.begin(str(tmp_path))
    slots.write_data(slot, buf.numpy().data)
    stamp = {"run_id": "r", "digest": "d", "step": 3, "world_size": 1, "owner": 0, "checksum": checksum.CRC32C}
    slots.finish(slot, stamp, b"{}", buf.numel(), crc)
    info = slots.scan(str(tmp_path), "r", "d")[0]
    assert torch.equal(slots.read(info)[1], buf)
    into = torch.empty_like(buf)  # (a replica by file: copied and checked in one pass)
    assert slots.copy_data(slot, into, checksum.CRC32C) == crc and torch.equal(into, buf)
    with open(os.path.join(slot, "data.bin"), "r+b") as f:  # one byte of a gap between tensors
        f.seek(4000 + 10)
        f.write(b"\1")
    with pytest.raises(ValueError, match="checksum"):
        slots.read(info)
