"""Numerics of zeroshard.ops.adam_step_ / adam_step_multi_ on CPU, for every instruction set
this CPU can run (AVX-512, AVX2, scalar), against torch.optim and the pure-torch reference."""
from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from zeroshard.ops import adam_step_, adam_step_multi_, reference_adam_step_
from zeroshard.ops._loader import REGISTRY

from tests.support.asserts import assert_same

# Not multiples of 16 or 8 on purpose, plus empty, single-element and > 1 thread's share.
SIZES = (0, 1, 7, 15, 16, 17, 31, 33, 105, 1000, 70_001)
# The 100-step comparison skips the multi-threaded size: the thread split cannot change any
# element's arithmetic (test_list_call_equals_per_tensor_calls checks that bit for bit).
SMALL_SIZES = SIZES[:-1]
HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8)
ATOL, RTOL = 1e-6, 1e-5


def _isas() -> list[str]:
    state = REGISTRY.cpu()
    return list(state.module.supported_isas()) if state.module is not None else ["reference"]


@pytest.fixture(params=_isas())
def isa(request: pytest.FixtureRequest) -> Iterator[str]:
    """Forces one instruction set for the test, then restores the dispatched one."""
    module = REGISTRY.cpu().module
    if module is None:
        yield "reference"
        return
    before = module.isa()
    assert module.set_isa(request.param)
    try:
        yield request.param
    finally:
        module.set_isa(before)


def _state(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=gen), torch.zeros(n), torch.zeros(n)


def _grads(n: int, steps: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=gen) * 0.1 for _ in range(steps)]


@pytest.mark.parametrize("adamw_mode", [True, False])
@pytest.mark.parametrize("weight_decay", [0.0, 0.05])
def test_100_steps_match_torch_optim(isa: str, adamw_mode: bool, weight_decay: float) -> None:
    for n in SMALL_SIZES:
        p, m, v = _state(n, seed=n)
        ref = p.clone().requires_grad_(True)
        cls = torch.optim.AdamW if adamw_mode else torch.optim.Adam
        opt = cls([ref], lr=HYPER["lr"], betas=(0.9, 0.999), eps=1e-8, weight_decay=weight_decay)
        for step, g in enumerate(_grads(n, 100, seed=n + 1), start=1):
            adam_step_(p, g, m, v, step=step, weight_decay=weight_decay, adamw_mode=adamw_mode, **HYPER)
            ref.grad = g.clone()
            opt.step()
        torch.testing.assert_close(p, ref.detach(), atol=ATOL, rtol=RTOL, msg=f"{n=} {isa=}")
        torch.testing.assert_close(m, opt.state[ref]["exp_avg"], atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(v, opt.state[ref]["exp_avg_sq"], atol=ATOL, rtol=RTOL)


def test_step1_bias_correction(isa: str) -> None:
    # At step 1 bias correction makes the update lr * g / (|g| + eps'), i.e. ~lr * sign(g).
    p, m, v = _state(1000, seed=3)
    g = _grads(1000, 1, seed=4)[0]
    start = p.clone()
    adam_step_(p, g, m, v, step=1, weight_decay=0.0, adamw_mode=True, **HYPER)
    expected = start - HYPER["lr"] * g / (g.abs() + HYPER["eps"])
    torch.testing.assert_close(p, expected, atol=ATOL, rtol=RTOL)


def test_zero_gradients_only_decay(isa: str) -> None:
    p, m, v = _state(1000, seed=5)
    start = p.clone()
    for step in range(1, 4):
        adam_step_(p, torch.zeros(1000), m, v, step=step, weight_decay=0.1, adamw_mode=True, **HYPER)
    assert torch.count_nonzero(m) == 0 and torch.count_nonzero(v) == 0
    torch.testing.assert_close(p, start * (1 - HYPER["lr"] * 0.1) ** 3, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("lowp", [torch.bfloat16, torch.float16])
def test_copy_out_equals_rounding(isa: str, lowp: torch.dtype) -> None:
    for n in SIZES:
        p, m, v = _state(n, seed=7)
        # Values across the whole range, including ties, subnormals, infinities and overflow.
        bits = torch.randint(-(2**31), 2**31 - 1, (n,), generator=torch.Generator().manual_seed(n), dtype=torch.int32)
        p = torch.where(torch.arange(n) % 2 == 0, bits.view(torch.float32), p)
        p = torch.where(torch.isnan(p), torch.ones_like(p), p)
        # Odd sizes write into a view one element in: the unaligned (non-streaming) store path.
        out = torch.empty(n + 1, dtype=lowp)[n % 2:n % 2 + n]
        for step, g in enumerate(_grads(n, 3, seed=8), start=1):
            adam_step_(p, g, m, v, step=step, weight_decay=0.01, adamw_mode=True, out_lowp=out, **HYPER)
        assert torch.equal(out.view(torch.int16), p.to(lowp).view(torch.int16)), f"{n=} {isa=} {lowp=}"


def test_bf16_copy_out_nan_and_ties(isa: str) -> None:
    # lr=0 leaves p unchanged, so the copy-out sees exactly these bit patterns.
    patterns = torch.tensor([0x3F808000, 0x3F818000, 0x3F80FFFF, 0x7F7FFFFF, 0xFF800000, 0x00000001,
                             0x80000000, 0x7FC00001, 0xFFFFFFFF], dtype=torch.int64).to(torch.int32)
    p = patterns.repeat(5).view(torch.float32).clone()
    out = torch.empty(p.numel(), dtype=torch.bfloat16)
    adam_step_(p, torch.zeros_like(p), torch.zeros_like(p), torch.zeros_like(p), step=1, lr=0.0, beta1=0.9,
               beta2=0.999, eps=1e-8, weight_decay=0.0, adamw_mode=True, out_lowp=out)
    expected = p.to(torch.bfloat16)
    nan = torch.isnan(expected)
    # Any NaN is a correct rounding of NaN (torch's own scalar and vector paths disagree on
    # the payload); everything else must match bit for bit, ties to even included.
    assert torch.equal(torch.isnan(out), nan)
    assert torch.equal(out[~nan].view(torch.int16), expected[~nan].view(torch.int16))


@pytest.mark.parametrize("lowp", [torch.bfloat16, torch.float16])
def test_lowp_grads_equal_upcast_grads(isa: str, lowp: torch.dtype) -> None:
    n = 70_001
    p1, m1, v1 = _state(n, seed=9)
    p2, m2, v2 = p1.clone(), m1.clone(), v1.clone()
    for step, g in enumerate(_grads(n, 5, seed=10), start=1):
        g_low = g.to(lowp)
        adam_step_(p1, g_low, m1, v1, step=step, weight_decay=0.01, adamw_mode=True, grad_scale=0.5, **HYPER)
        adam_step_(p2, g_low.float(), m2, v2, step=step, weight_decay=0.01, adamw_mode=True, grad_scale=0.5,
                   **HYPER)
    assert torch.equal(p1, p2) and torch.equal(m1, m2) and torch.equal(v1, v2)


@pytest.mark.parametrize("adamw_mode", [True, False])
def test_grad_scale_matches_reference(isa: str, adamw_mode: bool) -> None:
    n = 1000
    p1, m1, v1 = _state(n, seed=11)
    p2, m2, v2 = p1.clone(), m1.clone(), v1.clone()
    for step, g in enumerate(_grads(n, 20, seed=12), start=1):
        g16 = (g * 1024).to(torch.float16)  # a loss-scaled fp16 gradient
        kw = dict(step=step, weight_decay=0.02, adamw_mode=adamw_mode, grad_scale=0.7 / 1024, **HYPER)
        adam_step_(p1, g16, m1, v1, **kw)
        reference_adam_step_(p2, g16, m2, v2, **kw)
    torch.testing.assert_close(p1, p2, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(v1, v2, atol=ATOL, rtol=RTOL)


def test_list_call_equals_per_tensor_calls(isa: str) -> None:
    # The thread split cuts tensors at arbitrary points (chunks of 2**18 elements over the
    # concatenated list, taken by 2 threads); results must not depend on it.
    sizes = [3, 300_000, 17, 0, 290_001, 1, 65]
    single = [_state(n, seed=n) for n in sizes]
    multi = [tuple(t.clone() for t in s) for s in single]
    grads = [_grads(n, 1, seed=n + 100)[0].bfloat16() for n in sizes]
    outs_single = [torch.empty(n, dtype=torch.bfloat16) for n in sizes]
    outs_multi = [torch.empty(n, dtype=torch.bfloat16) for n in sizes]
    kw = dict(step=3, weight_decay=0.01, adamw_mode=True, grad_scale=0.25, **HYPER)
    for (p, m, v), g, o in zip(single, grads, outs_single):
        adam_step_(p, g, m, v, out_lowp=o, **kw)
    adam_step_multi_([s[0] for s in multi], grads, [s[1] for s in multi], [s[2] for s in multi],
                     out_lowps=outs_multi, **kw)
    for i, (a, b) in enumerate(zip(single + [tuple(outs_single)], multi + [tuple(outs_multi)])):
        assert_same(b, a, f"multi-tensor step vs one tensor at a time, tensor {i}")


def test_non_contiguous_uses_reference() -> None:
    p = torch.randn(8, 6).t()
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    g = torch.randn(6, 8)
    p2, m2, v2 = p.clone(), m.clone(), v.clone()
    adam_step_(p, g, m, v, step=1, weight_decay=0.01, adamw_mode=True, **HYPER)
    reference_adam_step_(p2, g, m2, v2, step=1, weight_decay=0.01, adamw_mode=True, **HYPER)
    assert torch.equal(p, p2) and torch.equal(m, m2)


def test_bad_arguments_raise() -> None:
    p, m, v = _state(10, seed=0)
    with pytest.raises(ValueError, match="elements"):
        adam_step_(p, torch.zeros(9), m, v, step=1, weight_decay=0.0, adamw_mode=True, **HYPER)
    with pytest.raises(ValueError, match="step"):
        adam_step_(p, torch.zeros(10), m, v, step=0, weight_decay=0.0, adamw_mode=True, **HYPER)
    with pytest.raises(TypeError, match="step"):
        adam_step_(p, torch.zeros(10), m, v, step=1.5, weight_decay=0.0, adamw_mode=True, **HYPER)
    with pytest.raises(ValueError, match="betas"):
        adam_step_(p, torch.zeros(10), m, v, step=1, lr=1e-3, beta1=1.0, beta2=0.999, eps=1e-8,
                   weight_decay=0.0, adamw_mode=True)
    with pytest.raises(TypeError, match="out_lowp"):
        adam_step_(p, torch.zeros(10), m, v, step=1, weight_decay=0.0, adamw_mode=True,
                   out_lowp=torch.empty(10), **HYPER)
    with pytest.raises(TypeError, match="floating"):
        adam_step_(p, torch.zeros(10, dtype=torch.int32), m, v, step=1, weight_decay=0.0, adamw_mode=True,
                   **HYPER)


@pytest.mark.parametrize("adamw_mode", [True, False])
def test_every_instruction_set_gives_the_same_bits(adamw_mode: bool) -> None:
    """Note [unfused update] in csrc/adam/adam_body.inc: the vector builds round a product before
    its sum as the scalar build (and torch) do, so a run follows the same bits on any CPU."""
    module = REGISTRY.cpu().module
    if module is None or len(module.supported_isas()) < 2:
        pytest.skip("fewer than two instruction sets can run here")
    before, results = module.isa(), {}
    try:
        for name in module.supported_isas():
            assert module.set_isa(name)
            p, m, v = _state(1000, seed=3)
            for step, g in enumerate(_grads(1000, 20, seed=4), start=1):
                adam_step_(p, g, m, v, step=step, weight_decay=0.05, adamw_mode=adamw_mode, grad_scale=0.5, **HYPER)
            results[name] = (p, m, v)
    finally:
        module.set_isa(before)
    first, *rest = results
    for name in rest:
        for a, b in zip(results[first], results[name]):
            assert torch.equal(a, b), (first, name)
