"""Swapped unit parts stay 4096-aligned across their release and re-allocation, so the swap
files move them with O_DIRECT, not through the page cache (Note [aligned swap parts] in
zeroshard/io/buffers.py)."""
from __future__ import annotations

import platform

import pytest
import torch

import zeroshard
from tests.support.nvme_params_worker import CFG
from zeroshard.io import ALIGN
from zeroshard.io.buffers import MAPPED_BYTES, held_bytes, resizable_aligned, storage_bytes
from zeroshard.units.flat_unit import alloc_storage, free_storage
from zeroshard.testing.toy import TinyGPT, synthetic_batch

glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the alignment after re-allocation is glibc's")


@glibc
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_a_released_part_comes_back_aligned(dtype):
    t = resizable_aligned(12345, dtype)
    view = t[100:200]  # views keep seeing the storage across the cycle
    assert t.data_ptr() % ALIGN == 0 and storage_bytes(t) >= MAPPED_BYTES
    assert held_bytes(t) == 12345 * t.element_size()  # the padding holds no resident pages
    noise = []
    for i in range(6):
        free_storage(t)
        assert held_bytes(t) == 0
        noise.append(torch.empty((i + 1) * 100_003, dtype=torch.uint8))  # the heap moves meanwhile
        alloc_storage(t)
        assert t.data_ptr() % ALIGN == 0, i
        t.fill_(i)
        assert view.data_ptr() == t.data_ptr() + 100 * t.element_size() and bool((view == i).all())


@glibc
def test_stage3_nvme_traffic_goes_through_o_direct(tmp_path):
    """The swap files of a ZeRO-Infinity run move (almost) every byte of a step with O_DIRECT,
    the gathers reading straight into the gathered buffer; the bits are the in-memory run's."""
    from zeroshard.io._plan import direct_refusals
    def run(**place):
        torch.manual_seed(0)
        model = TinyGPT(CFG)
        opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-2, stage=3, stage3_unit_numel=1,
                                      **place)
        losses = []
        for step in range(3):
            loss = model(*synthetic_batch(step, 2, CFG))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return opt, losses
    opt, losses = run(offload_optimizer="nvme", offload_params="nvme", nvme_path=str(tmp_path))
    if direct_refusals():
        pytest.skip(f"this file system refuses O_DIRECT: {direct_refusals()}")
    files = [opt.engine.unit_store.file, opt.engine.joined().swapper.file]
    moved = sum(f.bytes_read + f.bytes_written for f in files)
    assert sum(f.direct_bytes for f in files) >= 0.95 * moved, [(f.direct_bytes, f.bytes_read, f.bytes_written)
                                                               for f in files]
    _, want = run()
    assert losses == want
