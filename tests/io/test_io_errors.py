"""Bad situations for zeroshard.io on real file systems: missing and read-only directories, a
full disk, truncated and corrupted files, and file systems that refuse O_DIRECT. Each error
names the path, the offset and the errno."""
from __future__ import annotations

import errno
import os

import pytest
import torch

from zeroshard.io import AIOError, ALIGN, DiskFullError, TruncatedFileError, aligned_empty, checksum, engine_status
from zeroshard.io import _plan
from zeroshard.io.handle import Handle

from tests.support.io_helpers import BACKENDS, make_engine, pattern, read_only_mount, refuse_o_direct, small_filesystem

BLOCK = 64 << 10


@pytest.mark.parametrize("backend", BACKENDS)
def test_missing_directory_and_file(tmp_path, backend):
    io = make_engine(backend, block_size=BLOCK)
    missing = tmp_path / "no" / "such" / "dir" / "f.bin"
    with pytest.raises(AIOError, match="does not exist") as info:
        io.pwrite(pattern(100), missing)
    assert info.value.errno == errno.ENOENT and info.value.filename == str(missing)
    assert str(missing) in str(info.value)
    with pytest.raises(AIOError) as info:
        io.pread(aligned_empty(100, torch.float32, pin=False), tmp_path / "absent.bin")
    assert info.value.errno == errno.ENOENT
    with pytest.raises(AIOError, match="directory") as info:
        io.pwrite(pattern(100), tmp_path)
    assert info.value.errno == errno.EISDIR
    io.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_read_only_directory(tmp_path, backend):
    io = make_engine(backend, block_size=BLOCK)
    with read_only_mount(str(tmp_path)) as ro:
        target = os.path.join(ro, "f.bin")
        with pytest.raises(AIOError, match="read-only") as info:
            io.pwrite(pattern(100), target)
        assert info.value.errno == errno.EROFS and target in str(info.value)
    io.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_full_disk_says_so_and_names_the_path(tmp_path, backend):
    io = make_engine(backend, block_size=BLOCK, queue_depth=4)
    with small_filesystem(str(tmp_path), size_mb=8) as mnt:
        target = os.path.join(mnt, "state.bin")
        h = io.pwrite(pattern(4 << 20), target)  # 16 MiB into an 8 MiB file system
        with pytest.raises(DiskFullError, match="disk full") as info:
            h.wait()
        err = info.value
        assert err.errno in (errno.ENOSPC, errno.EDQUOT)
        assert err.filename == target and target in str(err) and "bytes free" in str(err)
        assert 0 <= err.offset < 16 << 20 and err.nbytes == 16 << 20
        with pytest.raises(DiskFullError):
            h.wait()  # the same error again, not a hang or a success
        # Space freed: the engine is still usable on that disk.
        os.remove(target)
        small = pattern(1000)
        io.pwrite(small, target).wait()
        back = aligned_empty(1000, torch.float32, pin=False)
        io.pread(back, target).wait()
        assert torch.equal(small, back)
        io.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_truncated_file_is_an_error_not_zeros(tmp_path, backend):
    io = make_engine(backend, block_size=BLOCK)
    path = tmp_path / "f.bin"
    src = pattern(256 << 10)  # 1 MiB
    io.pwrite(src, path).wait()
    os.truncate(path, 600_000)
    dst = aligned_empty(src.numel(), torch.float32, pin=False)
    with pytest.raises(TruncatedFileError, match=r"\[0, 1048576\).*600000 bytes") as info:
        io.pread(dst, path)
    assert info.value.filename == str(path)
    # A read that fits in the shortened file still works.
    part = aligned_empty(1000, torch.float32, pin=False)
    io.pread(part, path, offset=4 * ALIGN).wait()
    assert torch.equal(part, src[4 * ALIGN // 4:4 * ALIGN // 4 + 1000])
    io.close()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("use_direct", [True, False])
def test_file_shrinking_under_a_read_fails_in_wait(tmp_path, backend, use_direct):
    """The engines' own end-of-file check (the file shrank after submission): the blocks are
    planned for 1 MiB, the file has 300000 bytes."""
    io = make_engine(backend, block_size=BLOCK, use_direct=use_direct)
    path = str(tmp_path / "f.bin")
    io.pwrite(pattern(256 << 10), path).wait()
    os.truncate(path, 300_000)
    dst = aligned_empty(256 << 10, torch.float32, pin=False).fill_(7.0)
    f = _plan.open_file(path, write=False, use_direct=use_direct, offset=0, nbytes=0)
    tasks = _plan.split(f, dst.data_ptr(), 1 << 20, 0, BLOCK)
    h = Handle(io._engine.submit(tasks, False), f, dst, path, 0, 1 << 20, False)
    with pytest.raises(TruncatedFileError, match="unexpected end of file.*300000 bytes") as info:
        h.wait()
    assert info.value.filename == path and info.value.offset == 300_000 // BLOCK * BLOCK  # first bad block
    io.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_corruption_is_caught_by_the_callers_checksum(tmp_path, backend):
    io = make_engine(backend, block_size=BLOCK)
    path = tmp_path / "f.bin"
    src = pattern(100_000)
    expected = [checksum(b) for b in src.split(BLOCK // 4)]  # one CRC per block
    io.pwrite(src, path).wait()
    with open(path, "r+b") as f:
        f.seek(123_457)
        byte = f.read(1)
        f.seek(123_457)
        f.write(bytes([byte[0] ^ 0x40]))
    dst = aligned_empty(src.numel(), torch.float32, pin=False)
    io.pread(dst, path).wait()
    bad = [i for i, b in enumerate(dst.split(BLOCK // 4)) if checksum(b) != expected[i]]
    assert bad == [123_457 // BLOCK]
    io.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_o_direct_refused_per_request_falls_back(tmp_path, backend):
    """The kernel's EINVAL for an O_DIRECT request (here: a misaligned buffer sent through the
    direct descriptor on purpose) is retried through the buffered descriptor, and counted."""
    io = make_engine(backend, block_size=BLOCK)
    path = str(tmp_path / "f.bin")
    src = pattern(3 * BLOCK // 4)
    io.pwrite(src, path).wait()
    f = _plan.open_file(path, write=False, use_direct=True, offset=0, nbytes=0)
    if f.direct_fd is None:
        f.close()
        pytest.skip(f"this file system refuses O_DIRECT at open: {engine_status()['direct_io']}")
    raw = aligned_empty(3 * BLOCK + 1, torch.uint8, pin=False)
    tasks = [(f.direct_fd, f.buffered_fd, raw.data_ptr() + 1, 3 * BLOCK, 0)]
    h = Handle(io._engine.submit(tasks, False), f, raw, path, 0, 3 * BLOCK, False)
    h.wait()
    assert h.direct_fallbacks == 1
    assert torch.equal(raw[1:], src.view(torch.uint8))
    io.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_o_direct_refused_at_open_uses_buffered_and_says_so(tmp_path, backend, monkeypatch):
    """A file system that refuses O_DIRECT at open() (EINVAL, as tmpfs did before Linux 6.6):
    simulated by failing exactly that open() call, since every file system here accepts it."""
    refuse_o_direct(monkeypatch)
    io = make_engine(backend, block_size=BLOCK)
    src = pattern(50_000)
    h = io.pwrite(src, tmp_path / "f.bin")
    h.wait()
    assert h.direct_bytes == 0
    dst = aligned_empty(src.numel(), torch.float32, pin=False)
    io.pread(dst, tmp_path / "f.bin").wait()
    assert torch.equal(src, dst)
    refused = engine_status()["direct_io"]["refused_by"]
    assert any("refuses O_DIRECT" in why and "buffered" in why for why in refused.values())
    io.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_wait_all_reports_errors_not_yet_seen(tmp_path, backend):
    io = make_engine(backend, block_size=BLOCK)
    with small_filesystem(str(tmp_path), size_mb=8) as mnt:
        io.pwrite(pattern(4 << 20), os.path.join(mnt, "a.bin"))  # never waited by the caller
        io.pwrite(pattern(10), tmp_path / "ok.bin")
        with pytest.raises(DiskFullError, match="a.bin"):
            io.wait_all()
        io.wait_all()  # reported once
        io.close()
