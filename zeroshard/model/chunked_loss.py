"""``chunked_cross_entropy``: the language-model head and its cross-entropy, the logits of one chunk
of tokens alive at a time (Note [chunked cross-entropy]).

Note [chunked cross-entropy]: ``F.cross_entropy(hidden @ weight.T)`` keeps tokens x vocab logits for
backward (in the model dtype, their fp32 upcast and, in backward, their fp32 gradient: 10-12 bytes
per vocabulary entry per token), which at a 32k vocabulary is more than all of a 7B model's
checkpointed block inputs. Here the forward computes, per chunk of ``chunk_tokens`` tokens, the
chunk's logits (``F.linear`` in the hidden's dtype, as the head would), their fp32 log-sum-exp and
the target's logit, and lets them go: only the hidden states and the targets are saved (the weight
and bias are parameters, saved by reference). Backward recomputes each chunk's logits, forms their
fp32 gradient (softmax minus the target's one-hot, scaled by the loss's gradient), casts it to the
logits' dtype as autograd would for ``logits.float()``, and accumulates the hidden's gradient (one
slice per chunk, in the hidden's dtype) and the weight's (fp32, cast once at the end). The loss
equals the unchunked one up to fp32 summation order, and so do the gradients (the weight's is a
sum over chunks instead of one matmul). What stays for backward, per token: the hidden (its
dtype), the target (8 bytes), and in backward the hidden's gradient; per chunk, its logits as
above; the planner counts those (``logits_bytes`` in zeroshard/planner/activations.py). Like
Liger's and torchtune's fused linear cross-entropy, without a fused kernel.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch.autograd.function import FunctionCtx

REDUCTIONS = ("mean", "sum", "none")


def _check(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_tokens: int,
           bias: Optional[torch.Tensor], reduction: str) -> None:
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ValueError(f"chunked_cross_entropy: chunk_tokens={chunk_tokens!r} must be an int >= 1")
    if reduction not in REDUCTIONS:
        raise ValueError(f"chunked_cross_entropy: reduction={reduction!r} must be one of {REDUCTIONS}")
    if weight.dim() != 2 or hidden.dim() < 1 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"chunked_cross_entropy: hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)} do not "
                         "match: weight must be (vocab, d) and hidden (..., d)")
    if tuple(targets.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"chunked_cross_entropy: targets {tuple(targets.shape)} must have hidden's shape without its "
                         f"last dimension, {tuple(hidden.shape[:-1])}")
    if targets.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"chunked_cross_entropy: targets must be class indices (int64), not {targets.dtype}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"chunked_cross_entropy: bias {tuple(bias.shape)} must be (vocab,) = ({weight.shape[0]},)")


@dataclass(frozen=True)
class _Settings:
    chunk: int
    ignore_index: int
    reduction: str
    count: int
    """Targets not ``ignore_index`` (the mean's divisor)."""


class _Ctx(FunctionCtx):
    """The autograd context as this function uses it (a typed view: what forward leaves for backward)."""
    settings: _Settings
    saved_tensors: tuple[torch.Tensor, ...]
    needs_input_grad: tuple[bool, ...]


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: _Ctx, hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                targets: torch.Tensor, chunk: int, ignore_index: int, reduction: str) -> torch.Tensor:
        h = hidden.reshape(-1, hidden.shape[-1])
        t = targets.reshape(-1)
        losses = torch.empty(t.shape[0], dtype=torch.float32, device=h.device)
        vocab = weight.shape[0]
        valid = t != ignore_index
        bad = valid & ((t < 0) | (t >= vocab))
        if bool(bad.any()):  # (once, before any chunk: one host sync on a GPU, not one per chunk)
            raise ValueError(f"chunked_cross_entropy: target {int(t[bad][0])} out of range [0, {vocab}) "
                             f"(ignore_index={ignore_index})")
        index = torch.where(valid, t, 0).unsqueeze(1)
        for start in range(0, h.shape[0], chunk):
            logits = F.linear(h[start:start + chunk], weight, bias).float()
            picked = logits.gather(1, index[start:start + chunk]).squeeze(1)
            losses[start:start + chunk] = torch.where(valid[start:start + chunk], torch.logsumexp(logits, dim=1) - picked,
                                                      0.0)
        count = int(valid.sum())
        ctx.save_for_backward(hidden, weight, targets, *(() if bias is None else (bias,)))
        ctx.settings = _Settings(chunk, ignore_index, reduction, count)
        if reduction == "none":
            return losses.view(targets.shape)
        total = losses.sum()
        return total / count if reduction == "mean" else total  # (mean over no valid token: nan, as F.cross_entropy)

    @staticmethod
    def backward(ctx: _Ctx, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        hidden, weight, targets, *rest = ctx.saved_tensors
        bias = rest[0] if rest else None
        c = ctx.settings
        h = hidden.reshape(-1, hidden.shape[-1])
        t = targets.reshape(-1)
        want_h, want_w, want_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        grad_h = torch.empty_like(h) if want_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_w else None
        grad_b = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if want_b else None
        scale = grad.float() / c.count if c.reduction == "mean" else grad.float()
        per_token = scale.reshape(-1) if c.reduction == "none" else None
        for start in range(0, h.shape[0], c.chunk):
            hc, tc = h[start:start + c.chunk], t[start:start + c.chunk]
            logits = F.linear(hc, weight, bias)
            dtype = logits.dtype
            g = torch.softmax(logits.float(), dim=1)
            del logits
            valid = tc != c.ignore_index
            g[valid, tc[valid]] -= 1.0
            g[~valid] = 0.0
            g.mul_(per_token[start:start + c.chunk].unsqueeze(1) if per_token is not None else scale)
            g = g.to(dtype)  # (the gradient autograd hands F.linear for logits.float())
            if grad_h is not None:
                grad_h[start:start + c.chunk] = g @ weight
            if grad_w is not None:
                grad_w += (g.t() @ hc).float()
            if grad_b is not None:
                grad_b += g.float().sum(0)
        return (None if grad_h is None else grad_h.view(hidden.shape),
                None if grad_w is None else grad_w.to(weight.dtype),
                None if grad_b is None else grad_b.to(weight.dtype), None, None, None, None)


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *, chunk_tokens: int = 1024,
                          bias: Optional[torch.Tensor] = None, ignore_index: int = -100,
                          reduction: str = "mean") -> torch.Tensor:
    """``F.cross_entropy(F.linear(hidden, weight, bias).float().flatten(0, -2), targets.flatten(), ...)``
    with the logits of at most ``chunk_tokens`` tokens alive at a time, in forward and in backward
    (Note [chunked cross-entropy]). ``hidden``: (..., d); ``weight``: (vocab, d); ``targets``: class
    indices shaped as ``hidden`` without its last dimension; ``reduction``: "mean" (over the targets
    not ``ignore_index``), "sum" or "none" (fp32 losses shaped as ``targets``)."""
    _check(hidden, weight, targets, chunk_tokens, bias, reduction)
    out: torch.Tensor = _ChunkedCrossEntropy.apply(hidden, weight, bias, targets, chunk_tokens, ignore_index, reduction)
    return out
