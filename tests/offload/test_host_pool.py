"""HOST_POOL and huge pages: released unit buffers are reused, bounded, and returned at the
end of each backward pass and step (Note [reused host buffers] in zeroshard/io/host_pool.py)."""
from __future__ import annotations

import mmap
import os
import subprocess
import sys

import pytest
import torch

from zeroshard.io import buffers
from zeroshard.io.host_pool import HOST_POOL, MIN_BYTES, HostBufferPool
from zeroshard.units.flat_unit import alloc_storage, free_storage
from zeroshard.testing.toy import GPTConfig, TinyGPT

from tests.support.host_pool_run import train_stage3_nvme

MIB = 1 << 20


def _tensor(mib: int) -> torch.Tensor:
    return torch.empty(mib * MIB // 4, dtype=torch.float32)


def test_a_released_buffer_is_handed_to_the_next_of_its_size() -> None:
    pool = HostBufferPool(max_buffers=2)
    a, b = _tensor(4), torch.empty(0)
    a.fill_(7.0)
    view = a[10:20]
    ptr = a.data_ptr()
    pool.release(a)
    assert a.untyped_storage().nbytes() == 0 and view.untyped_storage().nbytes() == 0
    assert pool.held == 4 * MIB
    pool.acquire(b, 4 * MIB)
    assert b.untyped_storage().data_ptr() == ptr and pool.held == 0 and pool.reused == 4 * MIB
    pool.acquire(a, 4 * MIB)  # (nothing pooled now: fresh memory, and the views see it)
    a.fill_(1.0)
    assert a.untyped_storage().data_ptr() != ptr and view.sum().item() == 10.0


def test_what_it_holds_is_bounded_and_trim_returns_it() -> None:
    pool = HostBufferPool(max_buffers=2)
    for mib in (2, 2, 2, 8):
        pool.release(_tensor(mib))
    # within 2 x the largest seen so far, the oldest first out: the third 2 MiB pushed out the first
    assert pool.held == 12 * MIB
    pool.release(_tensor(8))  # 20 MiB would be over 2 x 8: the two 2 MiB go
    assert pool.held == 16 * MIB
    assert pool.trim() == 16 * MIB and pool.held == 0
    t = torch.empty(0)
    pool.acquire(t, 8 * MIB)
    assert pool.reused == 0


def test_a_trim_from_a_finalizer_inside_the_pools_lock_does_not_wait_for_itself() -> None:
    """The garbage collector may run an optimizer's teardown (which trims the pool) inside the
    pool's own critical section on the same thread: the trim must not wait for the lock its own
    thread holds (it hung a 2-rank construction); the holder trims as it leaves (Note [trim
    from a finalizer])."""
    pool = HostBufferPool(max_buffers=2)
    pool.release(_tensor(2))
    with pool._lock:  # (what release holds while the collector runs the teardown)
        assert pool.trim(wait=False) == 0
    assert pool.held == 2 * MIB  # (left to the holder)
    t = torch.empty(0)
    pool.acquire(t, 8 * MIB)  # (leaving acquire, the holder runs the trim it was asked for)
    assert pool.held == 0 and pool.reused == 0
    pool.release(_tensor(2))
    assert pool.held == 2 * MIB and pool.trim(wait=False) == 2 * MIB and pool.held == 0


def test_a_buffer_a_little_larger_serves_and_padding_costs_nothing() -> None:
    pool = HostBufferPool(max_buffers=2)
    a = _tensor(4)
    pool.release(a)
    b = torch.empty(0)
    pool.acquire(b, 4 * MIB - 8192)  # (a frozen unit's gathered buffer vs its padded shard: KiB apart)
    assert b.untyped_storage().nbytes() == 4 * MIB and pool.reused == 4 * MIB - 8192
    small = buffers.resizable_aligned(1000, torch.float32)  # a swapped part: 32 MiB storage, 4 KB used
    small.fill_(1.0)
    pool.release(small)
    assert pool.held < 64 * 1024  # (its untouched pages are not counted)


def test_small_and_pinned_buffers_are_not_pooled() -> None:
    pool = HostBufferPool()
    pool.release(torch.empty(MIN_BYTES // 8))
    assert pool.held == 0
    if torch.cuda.is_available():
        pool.release(torch.empty(4 * MIB, dtype=torch.uint8, pin_memory=True))
        assert pool.held == 0


def test_empty_is_aligned_and_pooled() -> None:
    pool = HostBufferPool()
    t = pool.empty(3 * MIB, torch.float32)
    assert t.numel() == 3 * MIB and t.data_ptr() % 4096 == 0
    ptr = t.untyped_storage().data_ptr()
    pool.release(t)
    u = pool.empty(3 * MIB, torch.float32)
    assert u.untyped_storage().data_ptr() == ptr and u.data_ptr() % 4096 == 0


def test_free_and_alloc_storage_go_through_the_pool() -> None:
    HOST_POOL.trim()
    t = buffers.resizable_aligned(2 * MIB, torch.float32)
    t.fill_(1.0)
    before = HOST_POOL.reused
    free_storage(t)
    alloc_storage(t)
    assert HOST_POOL.reused - before == buffers.storage_bytes(t)
    assert t.data_ptr() % 4096 == 0
    HOST_POOL.trim()


def test_training_reuses_buffers_across_steps_and_close_returns_them(tmp_path) -> None:
    """A stage-3 NVMe run takes its buffers from the pool: a step after the first maps at most half
    of what the first did (the pool lives across steps: Note [reused host buffers]); close empties
    it; the losses are those of a run with the pool off, bit for bit."""
    (tmp_path / "on").mkdir()
    (tmp_path / "off").mkdir()
    losses, mapped, reused, held = train_stage3_nvme(str(tmp_path / "on"))
    # The first step maps what it needs; later ones take nearly all of it from the pool (here
    # 192 MiB, then 64 MiB per step: the step's swapped parts in flight outnumber what 4x the
    # largest buffer holds; a 16-block LoRA step maps nothing, docs/results.md). Emptied per
    # step, as before, every step would map as much as the first.
    assert mapped[0] > 0 and max(mapped[1:]) <= mapped[0] // 2, mapped
    assert held > 0
    state = sum(p.numel() * 4 for p in TinyGPT(GPTConfig(vocab=512, d_model=512, n_layers=3, n_heads=4,
                                                          seq_len=16)).parameters())
    assert reused > 3 * state  # (each step gathers twice and swaps every part through memory)
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from tests.support.host_pool_run import train_stage3_nvme; "
            "print(repr(train_stage3_nvme(sys.argv[2])[0]))")
    env = {**os.environ, "ZEROSHARD_HOST_POOL": "0"}
    out = subprocess.run([sys.executable, "-c", code, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), str(tmp_path / "off")],
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert eval(out.stdout.strip().splitlines()[-1]) == losses


@pytest.mark.skipif(not buffers._ADVISE, reason="transparent huge pages are not in madvise mode here")
def test_advised_buffers_get_huge_pages() -> None:
    """The advice always reaches the kernel (the mapping carries VM_HUGEPAGE, "hg" in smaps);
    the pages are huge unless the kernel had none free at that moment, which it counts."""
    def fallbacks() -> int:
        with open("/proc/vmstat") as f:
            return sum(int(line.split()[1]) for line in f if line.startswith("thp_fault_fallback "))
    # A fresh private anonymous mapping (heap memory glibc already touched stays on small
    # pages, and a shared one is shmem, which this advice does not cover).
    region = mmap.mmap(-1, 16 * MIB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    t = torch.frombuffer(region, dtype=torch.float32)
    buffers.advise_huge_pages(t)
    before = fallbacks()
    t.fill_(1.0)
    fell_back = fallbacks() > before
    # (the advice splits the mapping: the advised part starts at the first 2 MiB boundary)
    addr, fields = -(-t.data_ptr() // (2 * MIB)) * 2 * MIB, {}
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                if inside:
                    break
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside:
                fields[head.rstrip(":")] = line.split()[1:]
    assert "hg" in fields["VmFlags"], fields["VmFlags"]
    if not fell_back:
        assert int(fields["AnonHugePages"][0]) >= 14 * 1024  # kB: the whole 2 MiB pages inside 16 MiB
    del t
    region.close()
