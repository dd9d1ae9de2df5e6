"""The models the benchmarks train: zeroshard's TinyGPT at a named size, or any Hugging Face
causal LM built from a config file (random weights, no download), with synthetic batches."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from zeroshard.planner.model_shape import ModelShape, load_hf_config
from zeroshard.testing.toy import GPTConfig, TinyGPT

PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(vocab=256, d_model=128, n_layers=2, n_heads=4, seq_len=64),
    "small": GPTConfig(vocab=256, d_model=256, n_layers=4, n_heads=4, seq_len=64),
    "medium": GPTConfig(vocab=256, d_model=512, n_layers=6, n_heads=8, seq_len=64),
    "large": GPTConfig(vocab=256, d_model=768, n_layers=8, n_heads=12, seq_len=64),
}
"""TinyGPT sizes: about 0.4M, 3.2M, 19M and 57M parameters."""


@dataclass(frozen=True)
class ModelSource:
    """A preset name, a path to a Hugging Face ``config.json``, or explicit TinyGPT dims."""

    gpt: Optional[GPTConfig] = None
    hf_config: Optional[str] = None
    seq_len: int = 64
    """Sequence length of the synthetic batches (TinyGPT: its ``seq_len``)."""

    def __post_init__(self) -> None:
        if (self.gpt is None) == (self.hf_config is None):
            raise ValueError("ModelSource needs exactly one of gpt=GPTConfig(...) or hf_config='config.json'")

    @classmethod
    def parse(cls, text: str, *, d_model: int = 0, n_layers: int = 0, seq_len: int = 0) -> "ModelSource":
        """``"small"`` (a preset), ``"path/config.json"``, or a preset with dims overridden."""
        if text in PRESETS:
            c = PRESETS[text]
            if d_model or n_layers or seq_len:
                c = GPTConfig(vocab=c.vocab, d_model=d_model or c.d_model, n_layers=n_layers or c.n_layers,
                              n_heads=max(1, (d_model or c.d_model) // 64), seq_len=seq_len or c.seq_len)
            return cls(gpt=c, seq_len=c.seq_len)
        if text.endswith(".json") or "/" in text:
            return cls(hf_config=text, seq_len=seq_len or 64)
        raise ValueError(f"--model {text!r} is neither a preset ({', '.join(PRESETS)}) nor a path to a "
                         "Hugging Face config.json")

    @property
    def _hf_path(self) -> str:
        """The Hugging Face config of a source without ``gpt`` (``__post_init__``: one is set)."""
        if self.hf_config is None:
            raise RuntimeError(f"{self!r} has neither gpt= nor hf_config=")
        return self.hf_config

    @property
    def name(self) -> str:
        if self.gpt is not None:
            return f"TinyGPT d={self.gpt.d_model} L={self.gpt.n_layers}"
        return self._hf_path

    @property
    def vocab(self) -> int:
        return self.gpt.vocab if self.gpt is not None else int(load_hf_config(self._hf_path).vocab_size)

    def build(self) -> nn.Module:
        if self.gpt is not None:
            return TinyGPT(self.gpt)
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_config(load_hf_config(self._hf_path))
        model.config.use_cache = False  # training: no KV cache in memory
        return model

    def shape(self) -> ModelShape:
        if self.gpt is not None:
            n = sum(p.numel() for p in TinyGPT(self.gpt).parameters())
            return ModelShape.from_gpt(self.gpt, n, self.name)
        return ModelShape.from_hf_config(self._hf_path)

    def batch(self, step: int, global_batch: int, rank: int, world: int,
              device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's share of the deterministic global batch of ``step``."""
        if global_batch % world:
            raise ValueError(f"global batch {global_batch} does not split over world size {world}; "
                             "use a multiple of every world size measured")
        g = torch.Generator().manual_seed(step)
        data = torch.randint(0, self.vocab, (global_batch, self.seq_len + 1), generator=g)
        local = global_batch // world
        data = data[rank * local:(rank + 1) * local].to(device)
        return data[:, :-1], data[:, 1:]

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.gpt is not None:
            return model(x, y)
        return model(input_ids=x, labels=x).loss  # HF shifts the labels itself: y is x moved by one
