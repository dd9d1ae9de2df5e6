"""Optimizer state per parameter for the planner (``zeroshard estimate --optimizer``).

Adam/AdamW keep two fp32 moments (8 bytes per parameter), SGD with momentum one (4). Muon's
recipe keeps one fp32 momentum on each hidden matrix and AdamW's two moments on the rest
(embeddings, head, norms); Adafactor keeps factored second moments of each matrix, one row and
one column vector (4·(m+n) bytes for m·n parameters), and a full one of each vector. From the
model's shape: the hidden matrices are what the embedding (and an untied head: vocab×d each)
and the norms (d each, two per block and a final one) leave of the parameters, exact for a
Llama; Adafactor's factors follow the widths (attention as 4 d×d matrices, the MLP as
``ModelShape.block_params`` counts it), within ~10% on a GQA or gated model.
"""
from __future__ import annotations

from zeroshard.planner.model_shape import ModelShape

OPTIMIZERS = ("adamw", "adam", "sgd", "muon", "adafactor")


def optimizer_bytes_per_param(shape: ModelShape, optimizer: str) -> float:
    """Average bytes of optimizer state per trainable parameter of ``shape`` under ``optimizer``."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer={optimizer!r}; use one of {OPTIMIZERS}")
    if optimizer in ("adamw", "adam"):
        return 8.0
    if optimizer == "sgd":
        return 4.0
    d, layers, n = shape.d_model, shape.n_layers, shape.n_params
    norms = (2 * layers + 1) * d
    embedding = shape.vocab * d
    # the embedding and an untied head, told apart by what the blocks leave over
    tables = min(2, max(1, round((n - layers * shape.block_params - norms) / embedding)))
    matrices = max(0, n - tables * embedding - norms)
    if optimizer == "muon":  # (a momentum on the hidden matrices, AdamW's moments on the rest)
        return (4 * matrices + 8 * (n - matrices)) / n
    # Adafactor: per block, the 4 attention matrices' rows and columns (d + d each), the MLP's
    # (2 of d + ffn, as block_params counts it) and the norms' full moments; each table's
    # vocab + d; one step count.
    per_block = 4 * (4 * 2 * d + 2 * (d + shape.ffn) + 2 * d)
    return (layers * per_block + 4 * tables * (shape.vocab + d) + 4 * d + 4) / n
