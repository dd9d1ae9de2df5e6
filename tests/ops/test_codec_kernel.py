"""The C++ int8 codec (csrc/adam/codec_int8.cpp) writes the same bytes as the torch path and
decodes to the same values, at any thread count (Note [codec error bounds])."""
import pytest
import torch

from zeroshard.comm.codecs.codec_formats import Int8Codec, _int8_kernel, _ScaledCodec


def _kernel_or_skip():
    k = _int8_kernel(torch.zeros(1), torch.zeros(1, dtype=torch.uint8))
    if k is None:
        pytest.skip("the CPU kernel is not built here (python -m zeroshard.ops says why)")
    return k


@pytest.mark.parametrize("block", [2, 32, 256])
@pytest.mark.parametrize("n", [1, 7, 255, 256, 257, 100_003])
def test_kernel_bytes_equal_the_torch_path(block, n):
    _kernel_or_skip()
    codec = Int8Codec(block=block)
    g = torch.Generator().manual_seed(n + block)
    x = torch.randn(n, generator=g) * torch.logspace(-6, 3, n)  # (blocks of every magnitude)
    x[: min(n, block)] = 0.0  # (an all-zero block: scale 0)
    if n > 3 * block:
        x[2 * block:3 * block] = -2.5  # (constant)
    want = torch.empty(codec.encoded_bytes(n), dtype=torch.uint8)
    _ScaledCodec.encode(codec, x, want)
    threads = torch.get_num_threads()
    for t in (1, threads):
        torch.set_num_threads(t)
        got = torch.full_like(want, 7)
        codec.encode(x, got)
        assert torch.equal(got, want), (n, block, t, (got != want).nonzero()[:5].flatten().tolist())
        dec, ref = torch.empty(n), torch.empty(n)
        codec.decode(got, dec)
        _ScaledCodec.decode(codec, want, ref)
        assert torch.equal(dec, ref)
    torch.set_num_threads(threads)


def test_kernel_keeps_non_finite_visible_and_checks_its_buffer():
    k = _kernel_or_skip()
    codec = Int8Codec(block=8)
    x = torch.randn(24)
    x[9] = float("nan")
    assert torch.isnan(codec.roundtrip(x)[8:16]).all() and torch.isfinite(codec.roundtrip(x)[:8]).all()
    with pytest.raises(RuntimeError, match="needed"):
        k.int8_encode(torch.zeros(24), torch.zeros(10, dtype=torch.uint8), 8)
