"""zeroshard.io.AsyncIO on real files: round trips across sizes, offsets, dtypes, alignment,
both backends, O_DIRECT on and off, and the API's lifecycle."""
from __future__ import annotations

import os
import zlib

import pytest
import torch

from zeroshard.io import ALIGN, AIOConfig, aligned_empty, checksum, engine_status

from tests.support.io_helpers import BACKENDS, make_engine, pattern
from tests.support.asserts import assert_same

BLOCK = 64 << 10  # small blocks so a few hundred KiB already split into many tasks


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("use_direct", [True, False])
@pytest.mark.parametrize("nbytes", [0, 1, ALIGN - 1, ALIGN, ALIGN + 1, 3 * BLOCK, 5 * BLOCK + 123])
def test_round_trip_sizes(tmp_path, backend, use_direct, nbytes):
    io = make_engine(backend, block_size=BLOCK, queue_depth=4, use_direct=use_direct)
    src = pattern(nbytes, torch.uint8)
    path = tmp_path / "f.bin"
    h = io.pwrite(src, path, offset=ALIGN)
    assert h.wait() is src
    assert os.path.getsize(path) == (ALIGN + nbytes if nbytes else 0)  # writing nothing extends nothing
    dst = aligned_empty(nbytes, torch.uint8, pin=False).zero_()
    io.pread(dst, path, offset=ALIGN).wait()
    assert torch.equal(src, dst)
    if use_direct and nbytes >= ALIGN:
        assert h.direct_bytes == nbytes - nbytes % ALIGN  # only the partial last page is buffered
    if not use_direct:
        assert h.direct_bytes == 0
    io.close()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_dtypes_and_unaligned_offsets_and_buffers(tmp_path, backend, dtype):
    io = make_engine(backend, block_size=BLOCK, queue_depth=3)
    src = pattern(50_001, dtype)
    path = tmp_path / "f.bin"
    io.pwrite(src, path, offset=13).wait()  # unaligned offset: buffered I/O, same bytes
    raw = aligned_empty(src.numel() * src.element_size() + 1, torch.uint8, pin=False)
    dst = raw[1:].view(dtype) if dtype.itemsize == 1 else raw[1:]  # unaligned buffer
    h = io.pread(dst, path, offset=13)
    h.wait()
    assert h.direct_bytes == 0
    assert torch.equal(raw[1:], src.view(torch.uint8))
    io.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_many_requests_in_flight_one_file(tmp_path, backend):
    io = make_engine(backend, block_size=BLOCK, queue_depth=8)
    parts = [pattern(3 * BLOCK // 4, torch.float32, seed=i) for i in range(12)]
    path = tmp_path / "f.bin"
    handles = [io.pwrite(p, path, offset=i * 3 * BLOCK) for i, p in enumerate(parts)]
    io.wait_all()
    assert all(h.done() for h in handles)
    back = [aligned_empty(p.numel(), torch.float32, pin=False) for p in parts]
    for i, b in enumerate(back):
        io.pread(b, path, offset=i * 3 * BLOCK)
    io.wait_all()
    assert_same(back, parts, "parts read back")
    io.close()


def test_backends_write_the_same_bytes(tmp_path):
    src = pattern(200_003, torch.float32)
    writer = make_engine("native", block_size=BLOCK)
    reader = make_engine("python", block_size=2 * BLOCK, queue_depth=2)
    writer.pwrite(src, tmp_path / "n.bin").wait()
    reader.pwrite(src, tmp_path / "p.bin").wait()
    assert (tmp_path / "n.bin").read_bytes() == (tmp_path / "p.bin").read_bytes()
    dst = aligned_empty(src.numel(), torch.float32, pin=False)
    reader.pread(dst, tmp_path / "n.bin").wait()
    assert torch.equal(src, dst)
    writer.close()
    reader.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_lifecycle(tmp_path, backend):
    io = make_engine(backend, block_size=BLOCK)
    src = pattern(1000)
    h = io.pwrite(src, tmp_path / "f.bin")
    h.wait()
    h.wait()  # idempotent
    assert h.done() and "pwrite" in repr(h)
    io.wait_all()
    io.close()
    io.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        io.pwrite(src, tmp_path / "g.bin")
    with make_engine(backend) as io2:
        io2.pwrite(src, tmp_path / "g.bin")
    assert os.path.getsize(tmp_path / "g.bin") == 4000  # the context manager waited


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_arguments(tmp_path, backend):
    io = make_engine(backend)
    with pytest.raises(ValueError, match="not contiguous.*contiguous"):
        io.pwrite(torch.zeros(8, 8).t(), tmp_path / "f.bin")
    with pytest.raises(ValueError, match="offset=-1"):
        io.pwrite(torch.zeros(8), tmp_path / "f.bin", offset=-1)
    with pytest.raises(TypeError, match="torch.Tensor"):
        io.pwrite(b"bytes", tmp_path / "f.bin")
    io.close()


def test_config_validation_names_the_fix():
    with pytest.raises(ValueError, match="multiple of 4096.*block_size=4096"):
        AIOConfig(block_size=5000)
    with pytest.raises(ValueError, match="queue_depth=0"):
        AIOConfig(queue_depth=0)
    with pytest.raises(ValueError, match="backend='uring'"):
        AIOConfig(backend="uring")
    with pytest.raises(TypeError, match="use_direct"):
        AIOConfig(use_direct=1)


def test_aligned_empty_and_checksum():
    for dtype in (torch.float32, torch.bfloat16, torch.uint8):
        t = aligned_empty(12345, dtype, pin=False)
        assert t.data_ptr() % ALIGN == 0 and t.numel() == 12345 and t.dtype == dtype and t.is_contiguous()
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="pin=True"):
            aligned_empty(10, torch.float32, pin=True)
    a, b = pattern(1000), pattern(777, seed=1)
    whole = torch.cat([a, b])
    assert checksum(whole) == zlib.crc32(whole.numpy().tobytes())
    assert checksum(b, checksum(a)) == checksum(whole)  # chaining, per block
    assert checksum(torch.empty(0)) == 0
    with pytest.raises(ValueError, match="contiguous"):
        checksum(torch.zeros(4, 4).t())


def test_engine_status_names_backend_and_reason():
    s = engine_status()
    assert s["backend"] in ("native", "python")
    assert s["native"]["reason"]
    assert s["backend"] == ("native" if s["native"]["available"] else "python")
    assert "python" in s["fallback"]


def test_native_requested_but_disabled_is_explained(monkeypatch):
    from zeroshard.io import _native, aio_engine as engine

    monkeypatch.setattr(_native, "native", lambda: _native.NativeState(None, "none", "disabled for this test"))
    monkeypatch.setattr(engine, "native", _native.native)
    with pytest.raises(RuntimeError, match="disabled for this test"):
        engine.AsyncIO(backend="native")
    monkeypatch.setattr(engine, "_warned", False)
    with pytest.warns(RuntimeWarning, match="disabled for this test.*Python threads"):
        io = engine.AsyncIO(backend="auto")
    assert io.backend == "python"
    io.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_unwaited_requests_release_files_and_report_errors(tmp_path, backend):
    io = make_engine(backend, block_size=BLOCK)
    fds_before = len(os.listdir("/proc/self/fd"))
    src = pattern(1000)
    for i in range(50):  # never waited one by one
        io.pwrite(src, tmp_path / f"f{i}.bin")
    io.wait_all()
    assert len(io._pending) == 0
    assert len(os.listdir("/proc/self/fd")) <= fds_before + 2
    io.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_dropped_engine_finishes_its_writes(tmp_path, backend):
    """No close(), no wait, no other reference to the tensors: the data still lands whole."""
    import gc

    io = make_engine(backend, block_size=BLOCK, queue_depth=2)
    for i in range(4):
        io.pwrite(pattern(300_000, seed=i), tmp_path / f"f{i}.bin")
    del io
    gc.collect()
    for i in range(4):
        assert (tmp_path / f"f{i}.bin").read_bytes() == pattern(300_000, seed=i).numpy().tobytes()
