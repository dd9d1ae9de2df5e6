"""The ZeroOptimizer the Hugging Face ``Trainer`` would have built from ``TrainingArguments``.

    from zeroshard.integrations.transformers import ZeroCallback, optimizer_from_args
    opt = optimizer_from_args(model, args, stage=2)          # lr, betas, eps, weight decay: args'
    trainer = Trainer(model=model, args=args, optimizers=(opt, None), callbacks=[ZeroCallback()])

A hand-written ``ZeroOptimizer(model, torch.optim.AdamW, lr=...)`` silently takes torch's
defaults where the Trainer takes the arguments' (``weight_decay=0.01`` against the Trainer's
``args.weight_decay``, 0.0 by default; betas, eps), and decays every parameter where the Trainer
spares biases and norms. This builds what ``Trainer.create_optimizer`` builds: the class and
keywords of ``Trainer.get_optimizer_cls_and_kwargs(args)`` (``args.optim``, ``learning_rate``,
``adam_beta1``/``adam_beta2``, ``adam_epsilon``, ``optim_args``) and the two groups of
``Trainer.get_decay_parameter_names`` (``args.weight_decay`` / 0.0), over the trainable
parameters, as a ZeroOptimizer with zeroshard's own options (``stage=``, ...).
"""
from __future__ import annotations

from torch import nn

from zeroshard.optim.zero_optimizer import ZeroOptimizer

# Keywords of the Trainer's torch optimizers that choose torch's own implementation; zeroshard
# runs the update itself (its fused kernel for Adam/AdamW), so they do not apply.
_IMPLEMENTATION_KEYS = ("fused", "foreach")


def optimizer_from_args(model: nn.Module, args: object, **zero_options: object) -> ZeroOptimizer:
    """``ZeroOptimizer`` over ``model`` as ``Trainer(model, args).create_optimizer()`` would
    build its optimizer; ``zero_options`` are zeroshard's (``stage``, ``mixed_precision``,
    ``offload_optimizer``, ...). Scheduler: leave it to the Trainer (``optimizers=(opt, None)``)."""
    from transformers import Trainer, TrainingArguments

    if not isinstance(model, nn.Module):
        raise TypeError(f"optimizer_from_args(model=...) must be an nn.Module, got {type(model).__name__}")
    if not isinstance(args, TrainingArguments):
        raise TypeError(f"optimizer_from_args(args=...) must be a transformers.TrainingArguments, got "
                        f"{type(args).__name__}")
    cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args, model)  # type: ignore[arg-type]  # (any Module)
    if not isinstance(cls, type):
        raise ValueError(f"TrainingArguments(optim={args.optim!r}) builds its optimizer through a factory "
                         f"({cls!r}); pass a torch.optim class yourself: ZeroOptimizer(model, cls, ...)")
    options: dict = {**{k: v for k, v in kwargs.items() if k not in _IMPLEMENTATION_KEYS}, **zero_options}
    decay = set(Trainer.get_decay_parameter_names(None, model))  # type: ignore[arg-type]  # (self is not used)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [{"params": [p for n, p in named if n in decay], "weight_decay": args.weight_decay},
              {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    return ZeroOptimizer(groups, cls, module=model, **options)


__all__ = ["optimizer_from_args"]
