"""``ActivationOffload``: the validated options of activation offload (``offload_activations=``).

``offload_activations="cpu"`` or ``"nvme"`` is sugar for ``ActivationOffload(where=...)``; the
NVMe directory is the offload options' ``nvme_path`` unless ``path`` names one. Each field is
checked here so that a typo fails at construction with the value and the fix.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from zeroshard.units.tier import Tier

_TIERS = {"cpu": Tier.HOST, "nvme": Tier.NVME}  # (the strings parsed once: Note [typed offload options])


@dataclass(frozen=True, kw_only=True)
class ActivationOffload:
    """Where the tensors autograd saves in the covered blocks' forward wait for their backward
    (Note [activation offload] in zeroshard/offload/activations/offloader.py)."""

    where: str
    """"cpu": host memory (the host buffer pool; pinned buffers on an accelerator);
    "nvme": files under ``path`` through the async I/O engine."""
    blocks: Optional[tuple[str, ...]] = None
    """The modules whose saved tensors move, by class name or by qualified module name
    (``model.named_modules()``); None: the model's repeated blocks (each child of a
    ``ModuleList``/``Sequential`` whose children share one class, e.g. transformer layers).
    A checkpointed block (``torch.utils.checkpoint``, ``use_reentrant=False``) keeps only its
    input, which is what moves."""
    path: Optional[str] = None
    """"nvme": the directory for activation files; None: the offload options' ``nvme_path``."""
    prefetch: int = 2
    """How many blocks ahead of backward are read back (or copied to the device) at once."""
    min_bytes: int = 64 << 10
    """Saved tensors smaller than this stay where they are (a copy would cost more than it frees)."""
    inductor_split: bool = False
    """Accept a model compiled whole with inductor: the offloader's hooks split its compiled forward at
    each block, so the gradients are not the same bits as without offload (Note [activation offload
    under inductor] in compiled_split.py); False: that forward is refused naming the alternatives."""

    def __post_init__(self) -> None:
        if (_TIERS.get(self.where) if isinstance(self.where, str) else None) is None:
            raise ValueError(f"offload_activations={self.where!r} is not a place for activations; use 'cpu' "
                             "(host memory) or 'nvme' (files under nvme_path), or None to keep them on the device")
        if self.blocks is not None:
            names = (self.blocks,) if isinstance(self.blocks, str) else self.blocks
            if not isinstance(names, (tuple, list)) or not names or not all(isinstance(b, str) and b for b in names):
                raise TypeError(f"ActivationOffload(blocks={self.blocks!r}) must be module class names or module "
                                "names (a non-empty tuple of str, e.g. ('Block',) or ('blocks.0', 'blocks.1'))")
            object.__setattr__(self, "blocks", tuple(names))
        if self.path is not None and (not isinstance(self.path, (str, os.PathLike)) or not str(self.path)):
            raise TypeError(f"ActivationOffload(path={self.path!r}) must be a directory path (a str)")
        if self.tier is Tier.HOST and self.path is not None:
            raise ValueError(f"ActivationOffload(path={self.path!r}) is only used with where='nvme'; drop it, or "
                             "pass where='nvme'")
        if isinstance(self.prefetch, bool) or not isinstance(self.prefetch, int) or self.prefetch < 1:
            raise ValueError(f"ActivationOffload(prefetch={self.prefetch!r}) must be an int >= 1 (blocks read back "
                             "ahead of backward)")
        if isinstance(self.min_bytes, bool) or not isinstance(self.min_bytes, int) or self.min_bytes < 0:
            raise ValueError(f"ActivationOffload(min_bytes={self.min_bytes!r}) must be an int >= 0 (bytes)")
        if not isinstance(self.inductor_split, bool):
            raise TypeError(f"ActivationOffload(inductor_split={self.inductor_split!r}) must be a bool")

    @property
    def tier(self) -> Tier:
        """Where the activations wait: ``Tier.HOST`` or ``Tier.NVME``."""
        return _TIERS[self.where]


def activation_options(value: object, nvme_path: Optional[str]) -> Optional[ActivationOffload]:
    """The typed options for ``offload_activations=value`` (None: activations stay), with the NVMe
    directory taken from ``nvme_path`` when the value does not name one."""
    if value is None:
        return None
    if isinstance(value, str):
        value = ActivationOffload(where=value)
    if not isinstance(value, ActivationOffload):
        raise TypeError(f"offload_activations={value!r} must be None, 'cpu', 'nvme' or a "
                        f"zeroshard.ActivationOffload(...), not a {type(value).__name__}")
    if value.tier is Tier.NVME and value.path is None:
        if not nvme_path:
            raise ValueError("offload_activations='nvme' needs a directory for the activation files: pass "
                             "nvme_path=<directory> (or ActivationOffload(where='nvme', path=...))")
        value = ActivationOffload(where="nvme", blocks=value.blocks, path=str(nvme_path), prefetch=value.prefetch,
                                  min_bytes=value.min_bytes, inductor_split=value.inductor_split)
    return value


def takes_nvme_path(value: object) -> bool:
    """``offload_activations=value`` writes its files under the offload options' ``nvme_path``."""
    if isinstance(value, str):
        return _TIERS.get(value) is Tier.NVME
    return isinstance(value, ActivationOffload) and value.tier is Tier.NVME and value.path is None
