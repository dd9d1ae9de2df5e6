"""A small decoder-only transformer for the demo, the benchmarks and the planner's checks.

Deliberately plain (pre-norm blocks, learned positions, tied embeddings optional) so that
memory and step time depend on the ZeRO machinery, not on model tricks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from zeroshard.model.chunked_loss import chunked_cross_entropy


GRANULARITIES = ("block", "half")


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 256
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    seq_len: int = 64
    dropout: float = 0.0
    tie_embeddings: bool = False
    activation_checkpointing: bool = False
    """Recompute each block in backward (torch.utils.checkpoint, non-reentrant)."""
    checkpoint_granularity: str = "block"
    """What one checkpoint covers when a block is checkpointed (by the model or by the activation
    offloader): "block", or "half": the attention half and the MLP half apart (Note [checkpoints
    finer than a block]). Same bits either way."""
    loss_chunk: int = 0
    """Tokens per chunk of the loss when targets are given: 0, the full logits; else
    ``zeroshard.chunked_cross_entropy`` (Note [chunked cross-entropy] in zeroshard/model/chunked_loss.py)."""

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} must be divisible by n_heads={self.n_heads}")
        if self.checkpoint_granularity not in GRANULARITIES:
            raise ValueError(f"checkpoint_granularity={self.checkpoint_granularity!r} must be one of {GRANULARITIES}")
        if isinstance(self.loss_chunk, bool) or not isinstance(self.loss_chunk, int) or self.loss_chunk < 0:
            raise ValueError(f"loss_chunk={self.loss_chunk!r} must be an int >= 0 (0: the full logits)")


class Block(nn.Module):
    """Note [checkpoints finer than a block]: a checkpointed block keeps its input and, while it is
    recomputed in backward, all of its saved tensors (17 x its input at ffn = 4d). Checkpointed in
    its two residual halves (``checkpoint_parts``), it keeps both halves' inputs (2 x) and holds one
    half's tensors at a time (the MLP half's, 10 x, is the larger): more kept without offload, less
    that no plan moves with it (the planner counts both: ``recompute_elements`` in
    zeroshard/planner/activations.py). The halves are methods over the same submodules, so the
    parameters' names and order do not change, and the same operations run: the same bits."""

    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.n_heads = c.n_heads
        self.granularity = c.checkpoint_granularity
        self.checkpoints_halves = c.activation_checkpointing and c.checkpoint_granularity == "half"
        """The model checkpoints this block in halves itself (TinyGPT.forward then calls it plainly)."""
        self.ln1 = nn.LayerNorm(c.d_model)
        self.qkv = nn.Linear(c.d_model, 3 * c.d_model, bias=False)  # no key bias: its gradient is pure rounding noise
        self.proj = nn.Linear(c.d_model, c.d_model)
        self.ln2 = nn.LayerNorm(c.d_model)
        self.fc = nn.Linear(c.d_model, 4 * c.d_model)
        self.out = nn.Linear(4 * c.d_model, c.d_model)
        self.drop = nn.Dropout(c.dropout)

    def attention_half(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.n_heads, d // self.n_heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return x + self.drop(self.proj(a.transpose(1, 2).reshape(b, t, d)))

    def mlp_half(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.out(F.gelu(self.fc(self.ln2(x)))))

    def checkpoint_parts(self) -> tuple[Callable[[torch.Tensor], torch.Tensor], ...]:
        """The parts one checkpoint each covers when this block is checkpointed, in order, each taking
        the previous one's output (empty: the block is one checkpoint)."""
        return (self.attention_half, self.mlp_half) if self.granularity == "half" else ()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpoints_halves and torch.is_grad_enabled():
            for part in self.checkpoint_parts():
                x = checkpoint(part, x, use_reentrant=False)
            return x
        return self.mlp_half(self.attention_half(x))


class TinyGPT(nn.Module):
    def __init__(self, c: GPTConfig = GPTConfig()) -> None:
        super().__init__()
        self.config = c
        self.tok = nn.Embedding(c.vocab, c.d_model)
        self.pos = nn.Embedding(c.seq_len, c.d_model)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.n_layers))
        self.ln_f = nn.LayerNorm(c.d_model)
        self.head = nn.Linear(c.d_model, c.vocab, bias=False)
        if c.tie_embeddings:
            self.head.weight = self.tok.weight

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            if self.config.activation_checkpointing and torch.is_grad_enabled() and not block.checkpoints_halves:
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        if targets is not None and self.config.loss_chunk:
            return chunked_cross_entropy(self.ln_f(x), self.head.weight, targets, chunk_tokens=self.config.loss_chunk,
                                         bias=self.head.bias)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def synthetic_batch(step: int, batch: int, c: GPTConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic token batch for a step: the same global batch whatever the world size."""
    g = torch.Generator().manual_seed(step)
    data = torch.randint(0, c.vocab, (batch, c.seq_len + 1), generator=g)
    return data[:, :-1], data[:, 1:]
