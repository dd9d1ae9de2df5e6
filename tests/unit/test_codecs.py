"""The codecs of quantized collectives keep their stated per-block error bound (Note [codec error
bounds] in zeroshard/comm/codecs/codec_formats.py), pad sizes that do not divide the block, and keep a
non-finite value visible."""
import math

import pytest
import torch

from zeroshard.comm.codecs.codec_formats import Bf16Codec, Codec, Fp8Codec, Int4Codec, Int8Codec, make_codec

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


def test_codec_options_refuse_what_they_cannot_do():
    from zeroshard.config import ZeroConfig
    with pytest.raises(ValueError, match="stage=3"):
        ZeroConfig(stage=2, weight_codec="int8")
    with pytest.raises(ValueError, match="gradients only"):
        ZeroConfig(stage=3, weight_codec="int4")
    with pytest.raises(ValueError, match="grad_codec"):
        ZeroConfig(stage=2, grad_error_feedback=True)
    with pytest.raises(ValueError, match="codec_links"):
        ZeroConfig(stage=2, grad_codec="int8", codec_links="intra")
    with pytest.raises(ValueError, match="codec_block"):
        ZeroConfig(stage=2, grad_codec="int8", codec_block=7)
    c = ZeroConfig(stage=3, weight_codec="fp8", grad_codec="int4", codec_links="inter_node", codec_block=64).codecs
    assert (c.weights, c.grads, c.block) == ("fp8", "int4", 64)
    assert c.applies_to("replicate") and c.applies_to("dp") and not c.applies_to("shard")


def test_deepspeed_zeropp_keys_map_to_codecs_and_hpz():
    from zeroshard.train.deepspeed_config import translate
    zero = {"stage": 3, "zero_quantized_weights": True, "zero_quantized_gradients": True,
            "zero_hpz_partition_size": 2}
    plan = translate({"zero_optimization": zero}, world_size=4)
    assert (plan.zero["weight_codec"], plan.zero["grad_codec"], plan.zero["hpz"]) == ("int8", "int4", True)
    assert plan.hpz_partition_size == 2
    off = translate({"zero_optimization": {"stage": 3, "zero_quantized_weights": False,
                                           "zero_hpz_partition_size": 1}}, world_size=4)
    assert "weight_codec" not in off.zero and off.hpz_partition_size is None
    with pytest.raises(ValueError, match="weight_codec='int8' quantizes stage 3"):
        translate({"zero_optimization": {"stage": 2, "zero_quantized_weights": True}}, world_size=2)
    with pytest.raises(ValueError, match="zero_hpz_partition_size"):  # (below stage 3: reported by name)
        translate({"zero_optimization": {"stage": 2, "zero_hpz_partition_size": 2}}, world_size=4)
    with pytest.raises(ValueError, match="true or false"):
        translate({"zero_optimization": {"stage": 3, "zero_quantized_gradients": 1}}, world_size=2)


def test_an_overflowing_step_does_not_poison_the_residual():
    """fp16: a step with inf gradients is skipped; its residual must not carry inf into the next."""
    from zeroshard.comm.codecs import CollectiveCodecs, LinkCodecs
    from zeroshard.comm.codecs.coded import _encode_chunks
    codecs = LinkCodecs(CollectiveCodecs(grads="int8", block=16, error_feedback=True))
    r = codecs.residual("u", 64, torch.device("cpu"))
    x = torch.randn(64)
    _encode_chunks(Int8Codec(block=16), x, 2, r, codecs, "dp")
    assert r.abs().max() > 0
    x[3] = float("inf")
    _encode_chunks(Int8Codec(block=16), x, 2, r, codecs, "dp")
    assert torch.equal(r, torch.zeros(64))


def test_codec_spec_of_a_launcher_becomes_optimizer_options():
    from zeroshard.comm.codecs.codec_options import codec_kwargs
    assert codec_kwargs("none") == {}
    assert codec_kwargs("weights=int8,grads=int4,links=inter_node,block=64,feedback") == {
        "weight_codec": "int8", "grad_codec": "int4", "codec_links": "inter_node", "codec_block": 64,
        "grad_error_feedback": True}
    with pytest.raises(ValueError, match="gradients only"):
        codec_kwargs("weights=int4")
    with pytest.raises(ValueError, match="speed=3"):
        codec_kwargs("grads=int8,speed=3")


def test_a_loaded_loss_scale_rescales_the_live_residuals():
    """Note [residuals under a moving loss scale]: a scaler state loaded into a running optimizer
    moves the scale its residuals were made under (one process: the residual is set by hand)."""
    import zeroshard
    from tests.support.models import TinyNet
    opt = zeroshard.ZeroOptimizer(TinyNet(), torch.optim.AdamW, lr=1e-2, stage=2, mixed_precision="fp16",
                                  initial_loss_scale=2.0 ** 10, grad_codec="int8", grad_error_feedback=True)
    sd = opt.state_dict()
    r = opt.engine.codecs.residual("0@dp", 8, torch.device("cpu"))
    r.copy_(torch.arange(8.0) - 3.5)
    sd["loss_scaler"] = {**sd["loss_scaler"], "scale": 2.0 ** 12}
    opt.load_state_dict(sd)
    assert opt.loss_scale == 2.0 ** 12
    assert torch.equal(opt.engine.codecs.residuals["0@dp"], (torch.arange(8.0) - 3.5) * 4)
    opt.close()
