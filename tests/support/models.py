"""Small models with the awkward shapes that break naive partitioning."""
from __future__ import annotations

import torch
from torch import nn
import torch.nn.functional as F

from zeroshard.testing.toy import GPTConfig

VOCAB, SEQ = 32, 5
# The two-layer TinyGPT most tests train (frozen: share it, replace fields with dataclasses.replace).
TINY_GPT = GPTConfig(vocab=64, d_model=32, n_layers=2, n_heads=4, seq_len=8)


class TinyNet(nn.Module):
    """Uneven shapes on purpose: a 7x15 weight, a 1-element bias, a 1-element and a
    3-element parameter (smaller than a world size of 4), and a frozen layer (the same values in
    every instance, as a pretrained base: checkpoints record it by digest, not its values)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 15)
        self.frozen = nn.Linear(15, 15)
        self.frozen.requires_grad_(False)
        # A "pretrained" frozen layer, the same in every instance whatever the seed: the values a
        # seed-0 TinyNet draws for it (the global stream is consumed as before).
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            nn.Embedding(VOCAB, 15)
            base = nn.Linear(15, 15)
        self.frozen.load_state_dict(base.state_dict())
        self.fc1 = nn.Linear(15, 7)
        self.norm = nn.LayerNorm(7)
        self.gain = nn.Parameter(torch.ones(1))
        self.mix = nn.Parameter(torch.randn(3))
        self.fc2 = nn.Linear(7, 1)
        self.head = nn.Linear(7, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        h = h + self.frozen(h)
        h = torch.tanh(self.norm(self.fc1(h))) * self.gain
        h = torch.cat([h[..., :3] * self.mix, h[..., 3:]], dim=-1)
        logits = self.head(h)
        aux = self.fc2(h).pow(2).mean()
        return F.cross_entropy(logits.reshape(-1, VOCAB).float(), tokens.roll(1, -1).reshape(-1)) + aux.float()


def param_groups(model: nn.Module, named: bool = False) -> list[dict]:
    """Two groups with different hyperparameters: matrices decay, the rest do not."""
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (decay if p.dim() >= 2 else no_decay).append((n, p) if named else p)
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0, "lr": 5e-3}]


def batch(step: int, size: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, VOCAB, (size, SEQ), generator=g)


class Block(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


class FrozenBaseNet(nn.Module):
    """Two repeated blocks (stage-3 units), a head, and a frozen layer."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.base = nn.Linear(width, width)
        self.base.requires_grad_(False)
        self.blocks = nn.ModuleList([Block(width), Block(width)])
        self.head = nn.Linear(width, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.base(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x)
