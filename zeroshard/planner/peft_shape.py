"""The trainable share of a PEFT (LoRA) fine-tune, counted exactly: the model and its adapters
are built on the meta device (no memory), as ``ModelShape.from_hf_config`` counts parameters."""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from zeroshard.planner.model_shape import load_hf_config


def lora_counts(hf_config: str, r: Optional[int] = None, targets: Optional[Sequence[str]] = None,
                peft_config: Any = None) -> tuple[int, int]:
    """(all parameters, trainable parameters) of ``get_peft_model(model, LoraConfig(r, targets))``
    (or of a given ``peft_config``)."""
    try:
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM
    except ImportError as exc:
        raise RuntimeError(f"counting LoRA parameters needs peft and transformers: {exc}") from exc
    if peft_config is None:
        from zeroshard.train.finetune_config import LORA_R_MAX
        if isinstance(r, bool) or not isinstance(r, int) or not 1 <= r <= LORA_R_MAX:
            raise ValueError(f"--lora-r={r!r} must be an int in [1, {LORA_R_MAX}]")
        peft_config = LoraConfig(r=r, lora_alpha=2 * r, target_modules=list(targets) if targets else "all-linear")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(load_hf_config(hf_config))
        try:
            model = get_peft_model(model, peft_config)
        except ValueError as exc:  # e.g. a target module the model does not have
            raise ValueError(f"LoRA on {hf_config}: {str(exc).splitlines()[0]}") from None
    seen: set[int] = set()
    total = trainable = 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += p.numel()
        trainable += p.numel() if p.requires_grad else 0
    return total, trainable
