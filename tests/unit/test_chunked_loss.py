"""``zeroshard.chunked_cross_entropy`` (Note [chunked cross-entropy]): the loss and the gradients of
the hidden states, the weight and the bias are those of ``F.cross_entropy`` on the full logits within
fp32 rounding (the sums run in another order), ignore_index and chunks that do not divide the tokens
included; bad arguments are refused naming them; the peak of live tensor bytes is lower; TinyGPT
with ``loss_chunk`` gives the same loss and its planner shape counts the chunk."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

import zeroshard
from zeroshard.planner.activations import logits_bytes
from zeroshard.planner.model_shape import ModelShape
from zeroshard.testing.toy import GPTConfig, TinyGPT, synthetic_batch

from tests.support.live_bytes import LiveBytes

RTOL = 2e-6  # (relative to the largest element of each tensor: fp32 sums in another order; measured <= 4e-7)


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    err = ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()
    assert err <= RTOL, f"{what}: relative error {err:.2e} > {RTOL}"


def _inputs(bias: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 13, 16, generator=g)
    weight = torch.randn(37, 16, generator=g) / 4
    targets = torch.randint(0, 37, (3, 13), generator=g)
    targets[0, :5] = -100
    targets[2, 7] = -100
    return hidden, weight, targets, torch.randn(37, generator=g) if bias else None


@pytest.mark.parametrize("reduction,bias", [("mean", False), ("sum", True), ("none", True)])
def test_matches_full_cross_entropy(reduction, bias):
    h0, w0, t, b0 = _inputs(bias)
    leaves = [x.clone().requires_grad_() for x in (h0, w0) + ((b0,) if bias else ())]
    want = F.cross_entropy(F.linear(leaves[0], leaves[1], leaves[2] if bias else None).float().reshape(-1, 37),
                           t.reshape(-1), reduction=reduction)
    if reduction == "none":
        want = want.view(t.shape)
    upstream = torch.randn(want.shape, generator=torch.Generator().manual_seed(1))
    want_grads = torch.autograd.grad(want, leaves, upstream)
    for chunk in (1, 5, 39, 1000):  # (39 = all tokens; 5 does not divide 39)
        mine = [x.clone().requires_grad_() for x in (h0, w0) + ((b0,) if bias else ())]
        got = zeroshard.chunked_cross_entropy(mine[0], mine[1], t, chunk_tokens=chunk,
                                              bias=mine[2] if bias else None, reduction=reduction)
        assert got.shape == want.shape and got.dtype == torch.float32
        _close(got.detach(), want.detach(), f"loss, chunk {chunk}")
        for name, g, w in zip(("hidden", "weight", "bias"), torch.autograd.grad(got, mine, upstream), want_grads):
            _close(g, w, f"{name}'s gradient, chunk {chunk}")
        if reduction != "mean":
            assert torch.all(got.detach().view(-1)[t.view(-1) == -100] == 0) if reduction == "none" else True


def test_bad_arguments_are_refused_by_name():
    h, w, t, _ = _inputs(False)
    cases = [(dict(chunk_tokens=0), "chunk_tokens=0"), (dict(reduction="avg"), "reduction='avg'"),
             (dict(bias=torch.zeros(5)), r"bias \(5,\) must be \(vocab,\) = \(37,\)")]
    for kw, msg in cases:
        with pytest.raises(ValueError, match=msg):
            zeroshard.chunked_cross_entropy(h, w, t, **kw)
    with pytest.raises(ValueError, match=r"hidden \(3, 13, 16\) and weight \(37, 8\)"):
        zeroshard.chunked_cross_entropy(h, w[:, :8], t)
    with pytest.raises(ValueError, match=r"targets \(3, 12\) must have hidden's shape"):
        zeroshard.chunked_cross_entropy(h, w, t[:, :12])
    bad = t.clone()
    bad[1, 1] = 37
    with pytest.raises(ValueError, match="target 37 out of range"):
        zeroshard.chunked_cross_entropy(h, w, bad, chunk_tokens=4)


def test_peak_live_bytes_lower_and_tinygpt_counts_it():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(512, 32, generator=g, requires_grad=True)
    weight = torch.randn(2048, 32, generator=g, requires_grad=True)
    targets = torch.randint(0, 2048, (512,), generator=g)
    peaks = {}
    for chunk in (0, 64):
        with LiveBytes() as live:
            loss = (F.cross_entropy(F.linear(hidden, weight).float(), targets) if not chunk else
                    zeroshard.chunked_cross_entropy(hidden, weight, targets, chunk_tokens=chunk))
            loss.backward()
        peaks[chunk] = live.peak
    full_logits = 512 * 2048 * 4
    assert peaks[64] < peaks[0] - 2 * full_logits, peaks  # (the full run holds logits, fp32 copy / gradient)
    assert peaks[64] < 2048 * 32 * 4 * 2 + 6 * 64 * 2048 * 4 + 4 * 512 * 32 * 4, peaks  # (weight grads + chunk)

    cfg = GPTConfig(vocab=64, d_model=32, n_layers=2, n_heads=4, seq_len=16, dropout=0.1)
    losses = []
    for c in (cfg, replace(cfg, loss_chunk=24)):
        torch.manual_seed(0)
        model = TinyGPT(c)
        torch.manual_seed(1)
        losses.append(model(*synthetic_batch(0, 4, c)))
    _close(losses[1].detach(), losses[0].detach(), "TinyGPT's loss with loss_chunk=24")
    shape = ModelShape.from_gpt(replace(cfg, loss_chunk=24), 1000)
    assert shape.loss_chunk == 24
    assert logits_bytes(shape, 64, 4) == 24 * 64 * 12 + 64 * (2 * 32 * 4 + 8) < logits_bytes(replace(shape, loss_chunk=0), 64, 4)
    with pytest.raises(ValueError, match="loss_chunk=-1"):
        GPTConfig(loss_chunk=-1)
