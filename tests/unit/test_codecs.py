"""The codecs of quantized collectives keep their stated per-block error bound (Note [codec error
bounds] in zeroshard/comm/codecs/formats.py), pad sizes that do not divide the block, and keep a
non-finite value visible."""
import math

import pytest
import torch

from zeroshard.comm.codecs.formats import Bf16Codec, Codec, Fp8Codec, Int4Codec, Int8Codec, make_codec

CODECS = [Codec(), Bf16Codec(), Fp8Codec(block=64), Int8Codec(block=32), Int8Codec(block=256),
          Int4Codec(block=16), Int4Codec(block=128)]
STATED = {"none": 0.0, "bf16": 2.0 ** -8, "fp8": 2.0 ** -4, "int8": 1 / 254, "int4": 1 / 14}


def _data(n: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    ramp = torch.linspace(-1, 1, n)
    return {
        "normal": torch.randn(n, generator=g),
        "heavy_tail": torch.randn(n, generator=g) ** 5 * 1e3,
        "tiny": torch.randn(n, generator=g) * 1e-30,
        "one_outlier": torch.cat([torch.full((n - 1,), 1e-3), torch.tensor([50.0])]),
        "halfway": (torch.arange(n) % 255 - 127).float() / 127 * 3.5 + 3.5 / 254,  # codes at .5
        "ramp": ramp, "zeros": torch.zeros(n), "constant": torch.full((n,), -2.5),
    }


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: f"{c.name}-{c.block}")
@pytest.mark.parametrize("n", [1, 3, 31, 256, 1000, 4097])
def test_decode_error_stays_within_the_stated_per_block_bound(codec: Codec, n: int) -> None:
    for what, x in _data(n).items():
        y = codec.roundtrip(x)
        assert y.shape == x.shape
        nb = math.ceil(n / codec.block)
        err = torch.cat([(y - x).abs(), torch.zeros(nb * codec.block - n)]).view(nb, codec.block).amax(1)
        bound = codec.bound(x)
        worst = (err - bound).max().item()
        assert worst <= 0, f"{codec.name} block {codec.block}, {what} n={n}: error exceeds the bound by {worst}"
        # the bound is the stated fraction of each block's largest magnitude (not a loose one)
        a = torch.cat([x.abs(), torch.zeros(nb * codec.block - n)]).view(nb, codec.block).amax(1)
        assert torch.all(bound <= a * STATED[codec.name] * (1 + 1e-5) + 1e-37), (codec.name, what)
        if codec.name == "none" or what == "zeros":
            assert torch.equal(y, x)


@pytest.mark.parametrize("codec", CODECS[1:], ids=lambda c: f"{c.name}-{c.block}")
def test_the_bound_is_reached_not_only_stated(codec: Codec) -> None:
    """Near-worst inputs come close to the bound (a codec that were silently exact, or a bound
    far above the real error, would not)."""
    x = torch.randn(64 * codec.block, generator=torch.Generator().manual_seed(1))
    err = (codec.roundtrip(x) - x).abs().view(-1, codec.block).amax(1)
    assert (err / codec.bound(x)).max() > 0.5


@pytest.mark.parametrize("codec", CODECS[2:], ids=lambda c: f"{c.name}-{c.block}")
def test_sizes_that_do_not_divide_the_block_are_padded_into_whole_blocks(codec: Codec) -> None:
    n = codec.block * 3 + 1
    assert codec.encoded_bytes(n) == 4 * 4 + (4 * codec.block) * (2 if codec.name != "int4" else 1) // 2
    buf = torch.empty(codec.encoded_bytes(n), dtype=torch.uint8)
    x = torch.randn(n)
    codec.encode(x, buf)
    out = torch.full((n,), float("nan"))
    codec.decode(buf, out)
    assert torch.isfinite(out).all() and (out - x).abs().max() <= codec.bound(x).max()


@pytest.mark.parametrize("codec", CODECS[1:], ids=lambda c: f"{c.name}-{c.block}")
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_a_non_finite_value_decodes_non_finite(codec: Codec, bad: float) -> None:
    """fp16's loss scaler finds overflow by non-finite gradients: quantizing must not hide it."""
    x = torch.randn(3 * codec.block)
    x[codec.block + 2] = bad
    assert not torch.isfinite(codec.roundtrip(x)).all()


def test_bytes_per_element_and_encoding_into_a_bf16_weight() -> None:
    assert Int8Codec(block=256).encoded_bytes(256) == 260
    assert Int4Codec(block=128).encoded_bytes(128) == 68
    assert Fp8Codec(block=256).encoded_bytes(512) == 520
    assert Bf16Codec().encoded_bytes(10) == 20
    w = torch.randn(300).bfloat16()
    c = Int8Codec(block=64)
    buf = torch.empty(c.encoded_bytes(300), dtype=torch.uint8)
    c.encode(w, buf)
    out = torch.empty(300, dtype=torch.bfloat16)
    c.decode(buf, out)
    assert ((out.float() - w.float()).abs().view(-1) <= c.roundtrip(w).sub(w.float()).abs() * 1.01 + 2e-2).all()


def test_codec_names_and_blocks_are_checked() -> None:
    assert make_codec("none") is None
    assert isinstance(make_codec("int4", block=64), Int4Codec)
    with pytest.raises(ValueError, match="int2"):
        make_codec("int2")
    with pytest.raises(ValueError, match="block=3"):
        Int8Codec(block=3)


def test_decoding_is_deterministic_bytes_for_bytes() -> None:
    x = torch.randn(5000)
    for codec in CODECS:
        a = torch.empty(codec.encoded_bytes(5000), dtype=torch.uint8)
        b = torch.empty_like(a)
        codec.encode(x, a)
        codec.encode(x.clone(), b)
        assert torch.equal(a, b), codec.name
