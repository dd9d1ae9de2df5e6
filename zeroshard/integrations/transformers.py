"""The Hugging Face ``transformers.Trainer`` with a ZeroOptimizer: one callback.

    opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=..., stage=2)
    trainer = Trainer(model=model, args=args, train_dataset=ds, optimizers=(opt, scheduler),
                      callbacks=[ZeroCallback()])

``optimizer_from_args(model, args, stage=2)`` builds that optimizer as the Trainer would from
its ``TrainingArguments`` (lr, betas, eps, weight decay and the decay/no-decay split;
``trainer_optimizer.py``).

What the callback does, all through ``TrainerCallback`` events:

- ``on_init_end``: keeps the model out of the ``DistributedDataParallel`` wrap the Trainer's
  Accelerator applies at more than one process (the optimizer reduces gradients already;
  ``_common.keep_out_of_ddp``), and refuses the Trainer's ``bf16``/``fp16`` autocast, which a
  model kept out of ``prepare`` would not get (use ``ZeroOptimizer(mixed_precision=...)``);
- before each checkpoint (``on_step_end`` / ``on_epoch_end`` with ``control.should_save``,
  ``on_evaluate`` under ``save_strategy="best"``; every rank runs these), arms the save guard
  (Note [rank-0 saves] in ``_common.py``): the ``optimizer.pt`` the Trainer writes from rank 0
  holds every rank's state (consolidated, in ``torch.optim`` format, grouped as a plain
  Trainer groups its own optimizer: Note [regrouped state]) and at stage 3 the model file
  holds full weights; ``resume_from_checkpoint`` then loads it on every rank as usual, and a
  plain Trainer (no zeroshard) resumes it too;
- ``on_train_end`` keeps the final full weights ready at stage 3, so ``trainer.save_model()``
  after ``train()`` writes whole tensors.

Without the callback at more than one process the model would be wrapped in DDP; a save the
callback did not prepare (a rank-0-only ``torch.save(optimizer.state_dict())``) is refused at
save time, naming this callback.
"""
from __future__ import annotations

from typing import Any

from torch import nn
from torch.optim.lr_scheduler import LRScheduler
from transformers import TrainerCallback

from zeroshard.optim.zero_optimizer import ZeroOptimizer
from zeroshard.integrations._common import SaveGuard, check_no_autocast, keep_out_of_ddp, optimizer_of
from zeroshard.integrations.trainer_optimizer import optimizer_from_args
from zeroshard.optim.regroup import scheduler_to_grouping, scheduler_to_own_grouping, to_grouping

FIX = ("Add the zeroshard Trainer callback, which makes the Trainer's checkpoint hold every rank's state: "
       "Trainer(..., callbacks=[zeroshard.integrations.transformers.ZeroCallback()]); or save with "
       "zeroshard.save_checkpoint(dir, step, model=model, optimizer=opt) on every rank")


def _wraps(model: object, inner: object) -> bool:
    """Whether ``model`` wraps ``inner`` (a PEFT model's base, or any module holding it)."""
    get_base = getattr(model, "get_base_model", None)
    if callable(get_base) and get_base() is inner:
        return True
    return any(m is inner for m in model.modules()) if hasattr(model, "modules") else False


def trainer_grouping(model: nn.Module) -> list[list[str]]:
    """The names of the two param groups a plain ``Trainer`` builds its optimizer with (decay,
    no decay; trainable parameters only), so its resume loads the callback's checkpoint."""
    from transformers import Trainer
    decay = set(Trainer.get_decay_parameter_names(None, model))  # type: ignore[arg-type]  # (reads no self)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [[n for n, _ in named if n in decay], [n for n, _ in named if n not in decay]]


class ZeroCallback(TrainerCallback):
    """See the module docstring. Stateless across Trainers; safe to pass to several."""

    def __init__(self) -> None:
        self._guards: dict[int, SaveGuard] = {}

    def _guard(self, model: Any, optimizer: Any) -> SaveGuard:
        opt = optimizer_of(model, optimizer)
        guard = self._guards.get(id(opt))
        if guard is None or guard.optimizer is not opt:
            guard = self._guards[id(opt)] = SaveGuard.install(opt, FIX)
        return guard

    def on_init_end(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                    **kwargs: Any) -> None:
        if optimizer is None:
            raise ValueError("ZeroCallback needs the ZeroOptimizer passed to the Trainer: "
                             "Trainer(..., optimizers=(zeroshard.ZeroOptimizer(model, ...), scheduler))")
        opt = optimizer_of(model, optimizer)
        if args.bf16 or args.fp16:
            check_no_autocast("bf16" if args.bf16 else "fp16", "TrainingArguments(bf16/fp16=True):")
        if opt.engine.module is not None and model is not None and opt.engine.module is not model:
            if _wraps(model, opt.engine.module):  # (TRL's SFTTrainer(peft_config=...) applies the adapters itself)
                raise ValueError(
                    f"the Trainer's model is a {type(model).__name__} wrapped around the {type(opt.engine.module).__name__} "
                    "the ZeroOptimizer was built over (SFTTrainer(peft_config=...) applies get_peft_model after "
                    "the optimizer exists, so the adapters would never train). Apply the adapters first, then build "
                    "the optimizer over the wrapped model, and pass no peft_config: model = peft.get_peft_model("
                    "model, peft_config); opt = zeroshard.ZeroOptimizer(model, ...); SFTTrainer(model=model, "
                    "optimizers=(opt, None), callbacks=[ZeroCallback()], ...)")
            raise ValueError(f"the Trainer's model ({type(model).__name__}) is not the model its ZeroOptimizer "
                             f"manages ({type(opt.engine.module).__name__})")
        # (the Trainer samples a 1/world_size share of the data per process: every process must be a rank
        # the optimizer averages over, or each trains on its share alone)
        ranks = opt.data_parallel_size * (opt.engine.tp.comm.world_size if opt.engine.tp is not None else 1)
        if getattr(args, "world_size", 1) > ranks:
            raise RuntimeError(
                f"the Trainer runs world_size={args.world_size} processes but the ZeroOptimizer spans {ranks} "
                f"rank(s) (world_size={opt.engine.comm.world_size}): it was built before torch.distributed."
                "init_process_group (or over a smaller process_group). Build it after the process group is "
                "initialized, e.g. after TrainingArguments(...), which initializes it under torchrun")
        keep_out_of_ddp(model)
        self._guard(model, opt)
        if kwargs.get("lr_scheduler") is not None and model is not None:
            self._regroup_scheduler(kwargs["lr_scheduler"], opt, model)

    def _regroup_scheduler(self, scheduler: LRScheduler, opt: ZeroOptimizer, model: nn.Module) -> None:
        """The scheduler's state is saved in the plain Trainer's grouping too (its per-group
        lists would not fit the plain Trainer's two groups) while a save is armed, and read back
        into the optimizer's grouping (Note [regrouped state]); instance attributes, so only
        this scheduler is touched."""
        cls = type(scheduler)
        guard = self._guard(model, opt)

        def state_dict() -> dict:
            state = {k: v for k, v in cls.state_dict(scheduler).items()  # (torch's takes __dict__: not these)
                     if k not in ("state_dict", "load_state_dict")}
            if guard.optimizer_state is not None and "param_names" in guard.optimizer_state["param_groups"][0]:
                state = scheduler_to_grouping(opt, state, trainer_grouping(model))
            return state

        def load_state_dict(state: dict) -> None:
            cls.load_state_dict(scheduler, scheduler_to_own_grouping(opt, state))
        scheduler.state_dict, scheduler.load_state_dict = state_dict, load_state_dict  # type: ignore[method-assign,assignment]

    def _arm(self, model: Any, optimizer: Any, weights_only: bool = False) -> None:
        guard = self._guard(model, optimizer)
        guard.disarm()
        guard.arm(optimizer=not weights_only)
        if guard.optimizer_state is not None and model is not None:  # (rank 0: Note [regrouped state])
            regrouped = to_grouping(guard.optimizer, guard.optimizer_state, trainer_grouping(model))
            if regrouped is not None:
                guard.optimizer_state = regrouped

    def on_step_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                      **kwargs: Any) -> None:
        self._guard(model, optimizer).disarm()  # the weights are about to change

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                    **kwargs: Any) -> None:
        if control.should_save:
            self._arm(model, optimizer)

    on_epoch_end = on_step_end

    def on_evaluate(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                    **kwargs: Any) -> None:
        if str(getattr(args.save_strategy, "value", args.save_strategy)) == "best":
            self._arm(model, optimizer)  # the Trainer decides after this event whether to save

    def on_save(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                **kwargs: Any) -> None:
        self._guard(model, optimizer).disarm()

    def on_train_end(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                     **kwargs: Any) -> None:
        self._arm(model, optimizer, weights_only=True)  # for trainer.save_model() after train()


__all__ = ["ZeroCallback", "FIX", "optimizer_from_args"]
