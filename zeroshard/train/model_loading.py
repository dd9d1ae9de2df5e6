"""Building the Hugging Face causal LM to fine-tune: from a weights directory or a config.

- ``--model DIR`` (config.json + safetensors, optionally a tokenizer): stages 0-2 load it
  with ``from_pretrained``; stage 3 builds the model on the meta device and, once the
  ZeroOptimizer owns it, ``zeroshard.load_safetensors`` reads only each rank's ranges, so no
  rank ever holds the full model.
- ``--model-config PATH`` (a config.json or a directory holding one): random weights from
  ``--seed``, built eagerly at every stage (each rank holds the full model once, before the
  ZeroOptimizer partitions it). For tests and small from-scratch runs.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn


@dataclass(frozen=True)
class ModelSource:
    """Where the weights come from after the optimizer is built (stage 3) or None."""

    weights_dir: Optional[str]
    """A directory of safetensors to load into a meta-built model, or None."""
    tokenizer_dir: Optional[str]


def _first_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:400] or type(exc).__name__


def load_config(model_dir: Optional[str], model_config: Optional[str]) -> Any:
    from transformers import AutoConfig
    path = model_dir or model_config
    flag = "--model" if model_dir else "--model-config"
    if path is None:
        raise ValueError("give --model DIR (config.json + safetensors) or --model-config PATH (config.json)")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{flag} {path!r} does not exist; --model takes a directory with config.json and "
                                "*.safetensors, --model-config a config.json (nothing is downloaded)")
    if model_dir is not None and not os.path.isdir(model_dir):
        raise ValueError(f"--model {model_dir!r} is not a directory; give the directory holding config.json and "
                         "*.safetensors (or --model-config FILE for random weights)")
    config_file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.isfile(config_file):
        raise ValueError(f"{flag} {path!r} has no config.json (a regular file); nothing is downloaded")
    if os.path.getsize(config_file) > 16 << 20:
        raise ValueError(f"{flag}: {config_file!r} is over 16 MiB: not a model config")
    try:
        return AutoConfig.from_pretrained(path)
    except Exception as exc:  # noqa: BLE001 - transformers raises OSError, ValueError, KeyError, JSON errors...
        raise ValueError(f"{flag}: cannot read the model config {config_file!r}: {_first_line(exc)}") from exc


def _has_weights(model_dir: str) -> bool:
    return any(f.endswith(".safetensors") or f == "model.safetensors.index.json" for f in os.listdir(model_dir))


def build_model(model_dir: Optional[str], model_config: Optional[str], stage: int, seed: int,
                activation_checkpointing: bool, lora: Any = None) -> tuple[nn.Module, ModelSource]:
    """The model (on the meta device for stage 3) and what must still happen to its weights;
    with ``lora`` (a ``peft.LoraConfig``) the base is frozen and wrapped by ``get_peft_model``."""
    from transformers import AutoModelForCausalLM
    config = load_config(model_dir, model_config)
    config.use_cache = False  # a KV cache is useless in training and conflicts with recomputation
    if model_dir is not None and not _has_weights(model_dir):
        raise FileNotFoundError(f"--model {model_dir} has no *.safetensors weights; use --model-config for random "
                                "init")
    torch.manual_seed(seed)
    flag = "--model" if model_dir else "--model-config"
    try:
        if stage == 3 and model_dir is not None:
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(config)
            source = ModelSource(model_dir, model_dir)
        elif model_dir is not None:
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
            source = ModelSource(None, model_dir)
        else:
            # Random init from a config is built eagerly at every stage: Hugging Face models
            # initialise weights in ``_init_weights``, not in the modules' ``reset_parameters``
            # that ``zeroshard.init_meta_weights`` calls (GPT-2's Conv1D has none).
            model = AutoModelForCausalLM.from_config(config)
            source = ModelSource(None, None)
    except (MemoryError, KeyboardInterrupt):
        raise
    except Exception as exc:  # noqa: BLE001 - unsupported architectures, damaged weights, bad sizes...
        raise ValueError(f"{flag} {model_dir or model_config}: cannot build a causal LM from it: "
                         f"{_first_line(exc)}") from exc
    if activation_checkpointing:
        # Non-reentrant recomputation: zeroshard's gradient hooks need each parameter's gradient
        # once per backward (docs/design.md, "Known limits").
        kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if lora is not None:
        from peft import get_peft_model
        try:
            model = get_peft_model(model, lora)
        except ValueError as exc:  # e.g. target modules not found
            raise ValueError(f"LoRA on {flag} {model_dir or model_config}: {_first_line(exc)}") from exc
    model.train()
    return model, source


def max_positions(model: nn.Module) -> Optional[int]:
    """The longest sequence the model's position embeddings cover, if its config says."""
    config = getattr(model, "config", None)
    for name in ("max_position_embeddings", "n_positions", "n_ctx"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def finish_weights(model: nn.Module, source: ModelSource, seed: int = 0) -> None:
    """Stage 3: fills the meta-built model once the ZeroOptimizer has partitioned it."""
    import zeroshard
    from zeroshard.optim.registry import optimizer_for
    if source.weights_dir is not None:
        zeroshard.load_safetensors(model, source.weights_dir)
    opt = optimizer_for(model)
    if opt is not None and any(u.needs_init for u in opt.engine.joined().all_units):  # PEFT adapters of a meta start
        zeroshard.init_meta_weights(model, seed=seed)


def save_model_files(model: nn.Module, tokenizer: Any, out_dir: str) -> None:
    """config.json (+ generation config, tokenizer) next to exported weights, so that
    ``AutoModelForCausalLM.from_pretrained(out_dir)`` works."""
    config = getattr(model, "config", None)
    if config is None:
        raise TypeError(f"{type(model).__name__} has no Hugging Face config (model.config) to save beside the weights")
    config.use_cache = True
    config.save_pretrained(out_dir)
    config.use_cache = False
    generation = getattr(model, "generation_config", None)
    if generation is not None:
        generation.save_pretrained(out_dir)
    if hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(out_dir)
