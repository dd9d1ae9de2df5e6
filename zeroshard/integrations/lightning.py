"""Lightning with a ZeroOptimizer: a strategy.

    class Module(lightning.LightningModule):
        def configure_optimizers(self):
            return zeroshard.ZeroOptimizer(self, torch.optim.AdamW, lr=..., stage=2)

    trainer = lightning.Trainer(strategy=ZeroStrategy(), gradient_clip_val=1.0, accumulate_grad_batches=4,
                                callbacks=[ModelCheckpoint(...)])
    trainer.fit(Module(), ckpt_path=...)

``ZeroStrategy`` is Lightning's ``DDPStrategy`` (process group, launchers, distributed sampler,
collectives) without the ``DistributedDataParallel`` wrap: the ZeroOptimizer reduces the
gradients, once (under DDP they would be reduced twice, and DDP's end-of-backward copy would
overwrite the averaged gradients zeroshard publishes). Its checkpoint hooks make the file that
rank 0 writes complete: ``optimizer_state`` is the consolidated optimizer state (``torch.optim``
format; every rank loads its shard from it at resume) and ``lightning_module_state_dict`` the
full weights at stage 3 (both collectives; Lightning calls them on every rank). Gradient
clipping (``gradient_clip_val``, by norm or value), ``accumulate_grad_batches`` and the
``grad_norm`` utility work on the gradients zeroshard publishes. Use it at one process too.
"""
from __future__ import annotations

from typing import Any

from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import DDPStrategy
from torch.optim import Optimizer

from zeroshard.integrations._common import SaveGuard, check_no_autocast, optimizer_of
from zeroshard.optim.zero_optimizer import ZeroOptimizer

FIX = ("Train with the zeroshard strategy, whose checkpoints hold every rank's state: "
       "lightning.Trainer(strategy=zeroshard.integrations.lightning.ZeroStrategy())")


class ZeroStrategy(DDPStrategy):
    strategy_name = "zeroshard"

    def configure_ddp(self) -> None:
        """No DistributedDataParallel: the ZeroOptimizer built in ``configure_optimizers`` reduces."""

    def setup(self, trainer: Any) -> None:
        check_no_autocast(self.precision_plugin.precision, "lightning.Trainer(precision=...):")
        super().setup(trainer)
        for opt in self.optimizers:
            zopt = optimizer_of(None, opt)  # a TypeError names the fix for any other optimizer
            if zopt.engine.shards_parameters and zopt.engine.module is self.lightning_module:
                # Stage 3 gathers the root unit in the root module's forward, which Lightning
                # never calls (it calls training_step).
                raise ValueError(
                    "stage 3 needs the model whose forward training_step calls, not the LightningModule: "
                    "ZeroOptimizer(self.model, ...) in configure_optimizers (the LightningModule's "
                    "checkpoints still hold every weight)")
            SaveGuard.install(zopt, FIX)

    @staticmethod
    def _zero(optimizer: Optimizer) -> ZeroOptimizer:
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer.optimizer  # (the optimizer it wraps)
        return optimizer_of(None, optimizer)

    def optimizer_state(self, optimizer: Optimizer) -> dict:
        """Every rank's state, consolidated on rank 0 (a collective; the others return {})."""
        state = self._zero(optimizer).consolidated_state_dict(to_rank=0)
        return state if state is not None else {}

    def lightning_module_state_dict(self) -> dict:
        """Full weights on rank 0 at stage 3 (a collective; {} elsewhere); the module's own
        state dict otherwise."""
        module = self.lightning_module
        if module is None:  # (Lightning attaches the module before it saves a checkpoint)
            raise RuntimeError("ZeroStrategy.lightning_module_state_dict: no LightningModule is attached")
        sharded = [o for o in map(self._zero, self.optimizers) if o.engine.shards_parameters]
        if not sharded:
            return module.state_dict()
        from zeroshard import full_state_dict
        names = {id(m): n for n, m in module.named_modules()}
        sd = module.state_dict()
        for zopt in sharded:
            managed = zopt.engine.module
            full = full_state_dict(managed, rank0_only=True) if managed is not None else None
            if managed is None or full is None:
                continue
            prefix = names[id(managed)] + "." if names[id(managed)] else ""
            sd.update({prefix + k: v for k, v in full.items()})
        return sd if self.is_global_zero else {}


__all__ = ["ZeroStrategy", "FIX"]
