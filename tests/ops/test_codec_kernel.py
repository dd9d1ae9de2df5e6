"""The C++ block codecs (csrc/adam/codec_int8.cpp, codec_blocks_avx2.cpp, codec_fp8_int4.cpp) write
the same bytes as the torch path and decode to the same values, at any thread count, on odd
sizes, padding, zero and constant blocks and blocks holding inf or NaN; the AVX2 paths equal the
portable ones (Note [codec error bounds])."""
import pytest
import torch

from tests.support.codec_data import codec_data as _data
from tests.support.codec_data import same_values as _same_values
from tests.support.codec_data import torch_path
from zeroshard.comm.codecs.codec_formats import Fp8Codec, Int4Codec, Int8Codec, _codec_kernel

CODECS = {"int8": Int8Codec, "fp8": Fp8Codec, "int4": Int4Codec}


def _kernel_or_skip(name: str):
    k = _codec_kernel(name, torch.zeros(1), torch.zeros(1, dtype=torch.uint8))
    if k is None:
        pytest.skip("the CPU kernel is not built here (python -m zeroshard.ops says why)")
    return k


@pytest.mark.parametrize("name", list(CODECS))
@pytest.mark.parametrize("block", [2, 32, 256])
@pytest.mark.parametrize("n", [1, 7, 255, 256, 257, 100_003])
def test_kernel_bytes_equal_the_torch_path(name, block, n):
    _kernel_or_skip(name)
    codec = CODECS[name](block=block)
    x = _data(n, block, non_finite=True)
    want, ref = torch_path(codec, x)
    threads = torch.get_num_threads()
    try:
        for t in (1, threads):
            torch.set_num_threads(t)
            got = torch.full_like(want, 7)
            codec.encode(x, got)
            assert torch.equal(got, want), (name, n, block, t, (got != want).nonzero()[:5].flatten().tolist())
            dec = torch.empty(n)
            codec.decode(got, dec)
            assert _same_values(dec, ref), (name, n, block, t)
    finally:
        torch.set_num_threads(threads)


def test_fp8_kernel_converts_every_value_as_torch_does():
    """Every e4m3 code decodes as torch's float8_e4m3fn does, and values on and between the
    codes (ties included, subnormals, both signs) encode as torch converts them (blocks of 64
    led by 448: the scale is exactly 1, and the vector loop of the AVX2 build sees them)."""
    _kernel_or_skip("fp8")
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    finite = grid[grid.isfinite() & (grid.abs() <= 448)].sort().values
    mids = (finite[1:] + finite[:-1]) / 2
    values = torch.cat([finite, mids, mids.nextafter(torch.tensor(1e9)), mids.nextafter(torch.tensor(-1e9)),
                        torch.tensor([500.0, -1e30, float("inf"), float("nan")])])
    values = torch.cat([values, values.new_zeros(-values.numel() % 63)]).view(-1, 63)
    x = torch.cat([torch.full((values.shape[0], 1), 448.0), values], dim=1).flatten()
    x[-1] = 0.0  # (one finite block, the last, keeps the non-finite out of every other)
    codec = Fp8Codec(block=64)
    want = torch.empty(codec.encoded_bytes(x.numel()), dtype=torch.uint8)
    codec.reference_encode(x, want)
    got = torch.empty_like(want)
    codec.encode(x, got)
    assert torch.equal(got, want), (got != want).nonzero()[:5].flatten().tolist()
    dec, ref = torch.empty(x.numel()), torch.empty(x.numel())
    codec.decode(got, dec)
    codec.reference_decode(want, ref)
    assert _same_values(dec, ref)


@pytest.mark.parametrize("name,block", [(c, b) for c in ("int8", "int4", "fp8") for b in (64, 34)])
def test_avx2_codecs_equal_the_portable_path(name, block):
    k = _kernel_or_skip(name)
    if "avx2" not in k.supported_isas():
        pytest.skip("this CPU has no AVX2")
    before = k.isa()
    codec = CODECS[name](block=block)
    x = _data(100_003, block, non_finite=True)
    outs = {}
    try:
        for isa in ("scalar", "avx2"):
            assert k.set_isa(isa)
            buf = torch.empty(codec.encoded_bytes(x.numel()), dtype=torch.uint8)
            codec.encode(x, buf)
            dec = torch.empty(x.numel())
            codec.decode(buf, dec)
            outs[isa] = (buf, dec)
    finally:
        k.set_isa(before)
    assert torch.equal(outs["scalar"][0], outs["avx2"][0])
    assert _same_values(outs["scalar"][1], outs["avx2"][1])


@pytest.mark.parametrize("name", list(CODECS))
def test_kernel_keeps_non_finite_visible_and_checks_its_buffer(name):
    k = _kernel_or_skip(name)
    codec = CODECS[name](block=8)
    x = torch.randn(24)
    x[9] = float("nan")
    assert torch.isnan(codec.roundtrip(x)[8:16]).all() and torch.isfinite(codec.roundtrip(x)[:8]).all()
    with pytest.raises(RuntimeError, match="needed"):
        getattr(k, f"{name}_encode")(torch.zeros(24), torch.zeros(codec.encoded_bytes(24) - 1, dtype=torch.uint8), 8)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (tests/ops/test_cuda_codec_replay.py "
                    "checks the CUDA kernel's grid on the host)")
@pytest.mark.parametrize("name", list(CODECS))
def test_cuda_kernel_bytes_equal_the_cpu_path(name):
    """On CUDA tensors the CUDA kernel (csrc/adam/cuda_codec_kernel.cu) runs, writes the CPU path's
    bytes (into a byte slice at an odd offset too) and decodes to its values."""
    from zeroshard.ops._loader import REGISTRY
    probe = (torch.zeros(1, device="cuda"), torch.zeros(1, dtype=torch.uint8, device="cuda"))
    assert _codec_kernel(name, *probe) is not None, f"CUDA present but codec kernel inactive: {REGISTRY.cuda().reason}"
    for block in (2, 34, 256):
        for n in (1, 7, 257, 100_003):
            codec = CODECS[name](block=block)
            x = _data(n, block, non_finite=True)
            want, ref = torch_path(codec, x)
            slab = torch.full((want.numel() + 3,), 7, dtype=torch.uint8, device="cuda")
            got = slab[3:]
            codec.encode(x.cuda(), got)
            assert torch.equal(got.cpu(), want), (name, block, n, (got.cpu() != want).nonzero()[:5].flatten().tolist())
            dec = torch.empty(n, device="cuda")
            codec.decode(got, dec)
            assert _same_values(dec.cpu(), ref), (name, block, n)
