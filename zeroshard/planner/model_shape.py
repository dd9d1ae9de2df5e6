"""What the planner needs to know about a model: its parameter count and transformer shape.

A shape comes from a parameter count alone (the layer count and width are then assumed,
see ``ModelShape.from_params``), from zeroshard's toy ``GPTConfig``, or from a Hugging Face
``config.json`` (the count is then exact: the model is built on the meta device).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer, as far as memory is concerned."""

    n_params: int
    """Trainable parameters (Ψ in the ZeRO formulas)."""
    n_layers: int
    """Transformer blocks: stage 3 gathers one block at a time."""
    d_model: int
    """Hidden width: activations are batch × sequence × d_model per saved tensor."""
    n_heads: int = 1
    vocab: int = 50257
    """Vocabulary: the logits (batch × sequence × vocab) are often the largest activation."""
    d_ff: int = 0
    """MLP width; 0 means 4 × d_model."""
    name: str = "model"
    block_numel: int = 0
    """Exact parameters of one block when known; 0 means the count from the widths."""
    loss_chunk: int = 0
    """Tokens per chunk of the loss (``zeroshard.chunked_cross_entropy``): the logits of that many
    tokens live at a time; 0: the full logits (``F.cross_entropy`` on the head's output)."""
    checkpoint_parts: int = 1
    """Checkpoints per checkpointed block: 1 (the block), or 2 (its attention and MLP halves apart:
    Note [checkpoints finer than a block] in zeroshard/testing/toy.py)."""

    def __post_init__(self) -> None:
        for field in ("n_params", "n_layers", "d_model", "n_heads", "vocab"):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ModelShape.{field}={value!r} must be a positive integer")
        if self.d_ff < 0:
            raise ValueError(f"ModelShape.d_ff={self.d_ff!r} must be >= 0 (0 means 4 × d_model)")
        if not isinstance(self.block_numel, int) or not 0 <= self.block_numel <= self.n_params:
            raise ValueError(f"ModelShape.block_numel={self.block_numel!r} must be an int in [0, n_params]")
        if isinstance(self.loss_chunk, bool) or not isinstance(self.loss_chunk, int) or self.loss_chunk < 0:
            raise ValueError(f"ModelShape.loss_chunk={self.loss_chunk!r} must be an int >= 0 (0: the full logits)")
        if self.checkpoint_parts not in (1, 2) or isinstance(self.checkpoint_parts, bool):
            raise ValueError(f"ModelShape.checkpoint_parts={self.checkpoint_parts!r} must be 1 (a checkpoint per block) "
                             "or 2 (the attention and MLP halves apart)")

    @property
    def ffn(self) -> int:
        return self.d_ff or 4 * self.d_model

    @property
    def block_params(self) -> int:
        """Parameters of one block (the stage-3 gather unit): attention 4d² + MLP 2·d·ffn."""
        if self.block_numel:
            return self.block_numel
        return min(self.n_params, 4 * self.d_model ** 2 + 2 * self.d_model * self.ffn)

    @classmethod
    def from_params(cls, n_params: int, *, n_layers: int = 0, d_model: int = 0,
                    vocab: int = 50257, name: str = "") -> "ModelShape":
        """A GPT-like shape for a bare count. Unknown width and depth follow Ψ ≈ 12·L·d² with
        d ≈ 64·L (GPT-2/3's aspect ratio, roughly): an assumption that only moves the
        activation and buffer estimates, never the model-state bytes."""
        if n_params < 1:
            raise ValueError(f"n_params={n_params!r} must be >= 1")
        if not n_layers and not d_model:
            n_layers = max(1, round((n_params / (12 * 64 ** 2)) ** (1 / 3)))
        if not d_model:
            d_model = max(64, int((n_params / (12 * n_layers)) ** 0.5) // 64 * 64)
        if not n_layers:
            n_layers = max(1, round(n_params / (12 * d_model ** 2)))
        return cls(n_params=n_params, n_layers=n_layers, d_model=d_model,
                   n_heads=max(1, d_model // 64), vocab=vocab, name=name or f"{n_params / 1e6:.0f}M params")

    @classmethod
    def from_gpt(cls, config: Any, n_params: int, name: str = "") -> "ModelShape":
        """From a ``zeroshard.testing.toy.GPTConfig`` and the model's counted parameters."""
        return cls(n_params=n_params, n_layers=config.n_layers, d_model=config.d_model,
                   n_heads=config.n_heads, vocab=config.vocab,
                   name=name or f"TinyGPT d={config.d_model} L={config.n_layers}",
                   loss_chunk=getattr(config, "loss_chunk", 0), checkpoint_parts=parts_of(config))

    @classmethod
    def from_hf_config(cls, path: str) -> "ModelShape":
        """From a Hugging Face ``config.json`` (or a directory holding one). The parameter
        count is exact: the model is instantiated on the meta device (no memory, no download)."""
        config = load_hf_config(path)
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        n = sum(p.numel() for p in model.parameters() if p.requires_grad)
        get = lambda *names: next((getattr(config, k) for k in names if getattr(config, k, None)), 0)  # noqa: E731
        d = int(get("hidden_size", "n_embd", "d_model"))
        return cls(n_params=n, n_layers=int(get("num_hidden_layers", "n_layer", "num_layers")),
                   d_model=d, n_heads=int(get("num_attention_heads", "n_head")) or 1,
                   vocab=int(get("vocab_size")) or 1, d_ff=int(get("intermediate_size", "n_inner") or 0),
                   name=f"{getattr(config, 'model_type', 'hf')} ({os.path.basename(os.path.abspath(path))})")


def parts_of(config: Any) -> int:
    """Checkpoints per block a model config asks for: 2 with ``checkpoint_granularity="half"``, else 1."""
    return 2 if getattr(config, "checkpoint_granularity", "block") == "half" else 1


def load_hf_config(path: str) -> Any:
    """A ``transformers`` config object from a ``config.json`` file or its directory."""
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"no Hugging Face config at {path!r}; pass a config.json file or the "
                         "directory that holds it")
    try:
        from transformers import AutoConfig
    except ImportError as exc:
        raise RuntimeError("reading a Hugging Face config needs transformers: pip install transformers") from exc
    with open(path) as f:
        data = json.load(f)
    model_type = data.pop("model_type", None)
    if model_type is None:
        raise ValueError(f"{path!r} has no 'model_type'; it does not look like a Hugging Face config.json")
    return AutoConfig.for_model(model_type, **data)
