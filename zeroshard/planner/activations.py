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


def recompute_elements(shape: ModelShape, tokens: int, seq_len: int, eager_attention: bool) -> int:
    """Elements a checkpointed block holds while it is recomputed (beyond its own input, which no
    count here includes): its saved tensors, or with ``checkpoint_parts`` 2 the larger half's (the
    attention half: LN1 in, qkv in, q/k/v, attention out, proj in, 7·d per token (and the scores
    under eager attention); the MLP half: LN2 in, fc in (2·d) and fc out, GELU out (2·ffn)) plus the
    other half's input, brought back with it (the block's record holds both: Note [checkpoints finer
    than a block] in zeroshard/testing/toy.py)."""
    if shape.checkpoint_parts == 1:
        return block_activation_elements(shape, tokens, seq_len, eager_attention)
    scores = 2 * shape.n_heads * seq_len * tokens if eager_attention else 0
    attention, mlp = tokens * 7 * shape.d_model + scores, tokens * (2 * shape.d_model + 2 * shape.ffn)
    return max(attention, mlp) + (shape.checkpoint_parts - 1) * tokens * shape.d_model


def checkpoint_input_elements(shape: ModelShape, tokens: int) -> int:
    """Elements a checkpointed block keeps for backward: each checkpoint's input."""
    return shape.checkpoint_parts * tokens * shape.d_model


def logits_bytes(shape: ModelShape, tokens: int, act_bytes: int) -> int:
    """The loss's activations: the full logits kept in the model dtype, their fp32 upcast and fp32
    gradient (8 bytes more per logit); with ``loss_chunk`` (Note [chunked cross-entropy] in
    zeroshard/model/chunked_loss.py) one chunk's logits as counted so, and for every token what the
    chunked loss keeps: the head's input (model dtype), its gradient in backward (model dtype) and
    the target (8 bytes)."""
    if not shape.loss_chunk:
        return tokens * shape.vocab * (act_bytes + 8)
    return min(tokens, shape.loss_chunk) * shape.vocab * (act_bytes + 8) + tokens * (2 * shape.d_model * act_bytes + 8)


def activation_bytes(shape: ModelShape, micro_batch: int, seq_len: int, act_bytes: int, *,
                     checkpointing: bool, eager_attention: bool = False) -> int:
    """Peak bytes of activations on one rank for one micro-batch of ``micro_batch × seq_len``.

    Without checkpointing every block keeps its saved tensors until its backward. With
    checkpointing only each checkpoint's input is kept (one per block, or per half with
    ``checkpoint_parts`` 2), plus what one block holds while it is recomputed. The logits come on
    top either way (``logits_bytes``): with the full logits, a large vocabulary dominates small models.
    """
    tokens = micro_batch * seq_len
    if checkpointing:
        blocks = (shape.n_layers * checkpoint_input_elements(shape, tokens)
                  + recompute_elements(shape, tokens, seq_len, eager_attention)) * act_bytes
    else:
        blocks = shape.n_layers * block_activation_elements(shape, tokens, seq_len, eager_attention) * act_bytes
    embeddings = 2 * tokens * shape.d_model * act_bytes  # embedding output + final norm input
    return blocks + embeddings + logits_bytes(shape, tokens, act_bytes)
