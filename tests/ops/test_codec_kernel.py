"""The C++ block codecs (csrc/adam/codec_int8.cpp, codec_blocks_avx2.cpp, codec_fp8_int4.cpp) write
the same bytes as the torch path and decode to the same values, at any thread count, on odd
sizes, padding, zero and constant blocks and blocks holding inf or NaN; the AVX2 paths equal the
portable ones (Note [codec error bounds])."""
import pytest
import torch

from zeroshard.comm.codecs.codec_formats import Fp8Codec, Int4Codec, Int8Codec, _codec_kernel

CODECS = {"int8": Int8Codec, "fp8": Fp8Codec, "int4": Int4Codec}


def _kernel_or_skip(name: str):
    k = _codec_kernel(name, torch.zeros(1), torch.zeros(1, dtype=torch.uint8))
    if k is None:
        pytest.skip("the CPU kernel is not built here (python -m zeroshard.ops says why)")
    return k


def _data(n: int, block: int, non_finite: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(n + block)
    x = torch.randn(n, generator=g) * torch.logspace(-9, 3, n)  # (blocks of every magnitude, fp8 subnormals)
    x[: min(n, block)] = 0.0  # (an all-zero block: scale 0)
    if n > 3 * block:
        x[2 * block:3 * block] = -2.5  # (constant)
    x[n // 2] = 0.5 * float(x[n // 2 + 1 if n > 1 else 0]) or 1.0  # (ties of the rounding on some codes)
    if non_finite and n > 6 * block:
        x[3 * block + 1], x[4 * block + 3], x[5 * block] = float("nan"), float("inf"), float("-inf")
        x[5 * block + 1] = -float("nan")
    return x


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit where not NaN (-0.0 is not 0.0), NaN where the other is NaN (a NaN's
    payload is whichever operand's NaN the multiplication kept: not a value)."""
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(a.view(torch.int32)[~nan], b.view(torch.int32)[~nan])


@pytest.mark.parametrize("name", list(CODECS))
@pytest.mark.parametrize("block", [2, 32, 256])
@pytest.mark.parametrize("n", [1, 7, 255, 256, 257, 100_003])
def test_kernel_bytes_equal_the_torch_path(name, block, n):
    _kernel_or_skip(name)
    codec = CODECS[name](block=block)
    x = _data(n, block, non_finite=True)
    want = torch.empty(codec.encoded_bytes(n), dtype=torch.uint8)
    codec.reference_encode(x, want)
    ref = torch.empty(n)
    codec.reference_decode(want, ref)
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
