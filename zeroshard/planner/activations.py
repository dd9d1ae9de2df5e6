"""Activation memory of a decoder-only transformer for one micro-batch, per rank.

Counted per saved tensor of a pre-norm block (after Korthikanti et al., 2022, "Reducing
Activation Recomputation in Large Transformer Models", section 4.1), without dropout masks
and with a fused attention kernel (scaled_dot_product_attention with a flash or
memory-efficient backend keeps no batch × heads × s × s scores; ``eager_attention`` adds
them back). An estimate to plan with, good to tens of percent: allocators, autograd
temporaries and framework workspaces are not modelled.
"""
from __future__ import annotations

from zeroshard.planner.model_shape import ModelShape


def block_activation_elements(shape: ModelShape, tokens: int, seq_len: int, eager_attention: bool) -> int:
    """Elements one block saves for backward: LN1 in, qkv in, q/k/v, attention out, proj in,
    LN2 in, fc in (9·d) plus fc out and GELU out (2·ffn) per token."""
    per_token = 9 * shape.d_model + 2 * shape.ffn
    scores = 2 * shape.n_heads * seq_len * tokens if eager_attention else 0  # scores + softmax
    return tokens * per_token + scores


def activation_bytes(shape: ModelShape, micro_batch: int, seq_len: int, act_bytes: int, *,
                     checkpointing: bool, eager_attention: bool = False) -> int:
    """Peak bytes of activations on one rank for one micro-batch of ``micro_batch × seq_len``.

    Without checkpointing every block keeps its saved tensors until its backward. With
    checkpointing (one checkpoint per block) only each block's input is kept, plus one
    block's tensors while it is recomputed. The logits come on top either way: kept in the
    model dtype, upcast to fp32 for the loss, and their fp32 gradient (8 bytes more per
    logit), which is why a large vocabulary dominates small models.
    """
    tokens = micro_batch * seq_len
    block = block_activation_elements(shape, tokens, seq_len, eager_attention) * act_bytes
    if checkpointing:
        blocks = shape.n_layers * tokens * shape.d_model * act_bytes + block
    else:
        blocks = shape.n_layers * block
    embeddings = 2 * tokens * shape.d_model * act_bytes  # embedding output + final norm input
    logits = tokens * shape.vocab * (act_bytes + 8)
    return blocks + embeddings + logits
