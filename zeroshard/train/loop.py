"""The training loop: micro-batches -> optimizer step -> step boundary (agree, log, save).

Lifecycle: ``resume()`` (the newest valid checkpoint under the root, if any) -> ``run()``
-> "completed" | "preempted". Everything a bit-exact resume needs is in the checkpoint:
parameters and optimizer pieces, the schedule, the data position (``ResumableSampler``),
RNG states (dropout), the fp16 loss scale. A checkpoint is only taken at a step boundary,
so a preempted run and an uninterrupted one go through the same states.

The step boundary costs one collective of two numbers: the preemption flag and this
rank's loss (``PreemptionHandler.agree``), so every rank agrees on stopping and the logged
loss is the mean over ranks. With ``redundancy="peer"`` (``zeroshard finetune --redundancy
peer``) every step is then committed to the memory tier (``memory_checkpoint``), a preemption
hands off before its save, and ``resume()`` loads from the tiers when they are at least as new.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn

import zeroshard
from zeroshard.checkpoint import CheckpointError
from zeroshard.train.failures import StepWatchdog
from zeroshard.train.faults import Fault
from zeroshard.train.preemption import PreemptionHandler, signal_name
from zeroshard.train.progress import Progress

LossFn = Callable[[nn.Module, Any], torch.Tensor]


@dataclass(frozen=True)
class LoopSettings:
    max_steps: int
    checkpoint_root: str
    grad_accum: int = 1
    grad_clip: Optional[float] = None
    """Max global gradient norm; None or 0: no clipping."""
    save_interval: int = 50
    keep_last: Optional[int] = 2
    async_save: bool = False

    def __post_init__(self) -> None:
        if self.max_steps < 1 or self.grad_accum < 1 or self.save_interval < 1:
            raise ValueError(f"max_steps={self.max_steps}, grad_accum={self.grad_accum} and save_interval="
                             f"{self.save_interval} must all be >= 1")


class TrainLoop:
    def __init__(self, settings: LoopSettings, model: nn.Module, optimizer: Any, scheduler: Any,
                 loader: torch.utils.data.DataLoader, sampler: Any, loss_fn: LossFn, progress: Progress,
                 preemption: PreemptionHandler, watchdog: Optional[StepWatchdog] = None,
                 fault: Optional[Fault] = None, extra: Optional[dict] = None) -> None:
        self.s = settings
        self.model, self.opt, self.sched = model, optimizer, scheduler
        self.loader, self.sampler, self.loss_fn = loader, sampler, loss_fn
        self.progress, self.preemption, self.watchdog, self.fault = progress, preemption, watchdog, fault
        self.extra = dict(extra or {})
        """Run facts stored with every checkpoint (and compared on resume)."""
        self.rank = optimizer.engine.comm.rank
        self.world = optimizer.engine.comm.world_size
        self.step = 0
        self.saved_step: Optional[int] = None
        self.resumed_from: Optional[str] = None
        self._batches: Optional[Iterator] = None
        self.lr = 0.0

    # -- checkpoints -------------------------------------------------------------------------
    def resume(self) -> Optional[str]:
        """Loads the newest valid checkpoint, if there is one; returns its directory."""
        on_disk = zeroshard.latest_checkpoint(self.s.checkpoint_root) is not None
        if not on_disk and self.opt.engine.memory_tier is None:
            return None
        try:  # (with redundancy="peer" the memory tiers may hold a step the disk does not)
            info = zeroshard.load_checkpoint(self.s.checkpoint_root, model=self.model, optimizer=self.opt,
                                             scheduler=self.sched, dataloader=self.sampler)
        except CheckpointError:
            if on_disk:
                raise
            return None
        self.step = self.saved_step = int(info["step"])
        self.resumed_from = info["path"]
        for path, reason in info.get("skipped", []):
            self.progress.log(f"skipped damaged checkpoint {path}: {reason}", echo=True)
        saved = (info.get("extra") or {}).get("run", {})
        changed = {k: (saved.get(k), v) for k, v in self.extra.items() if k in saved and saved[k] != v}
        if changed:  # allowed (e.g. a new world size), but the run is then not the same run
            self.progress.log(f"resuming with changed settings (saved, now): {changed}", echo=True)
        source = (f" (memory tiers, {info.get('bytes_read', 0)} disk bytes read)" if info.get("source") == "memory"
                  else "")
        self.progress.log(f"resumed from {info['path']} at step {self.step}{source}"
                          f"{' (resharded)' if info.get('resharded') else ''}", echo=True)
        return info["path"]

    def save(self, wait: bool = False) -> None:
        if self.saved_step == self.step:
            return
        pause = self.watchdog.paused() if self.watchdog is not None else contextlib.nullcontext()
        with pause:
            handle = zeroshard.save_checkpoint(
                self.s.checkpoint_root, self.step, model=self.model, optimizer=self.opt, scheduler=self.sched,
                dataloader=self.sampler, extra={"run": self.extra}, async_save=self.s.async_save and not wait,
                keep_last=self.s.keep_last)
            if wait:
                handle.wait()
        self.saved_step = self.step
        self.progress.summary.checkpoints.append(self.step)
        self.progress.log(f"checkpoint step {self.step} -> {self.s.checkpoint_root}")

    # -- data --------------------------------------------------------------------------------
    def _next_batch(self) -> Any:
        if self._batches is None:
            self._batches = iter(self.loader)
        try:
            return next(self._batches)
        except StopIteration:
            # The epoch is over: the sampler deals the next epoch's order.
            self.sampler.set_epoch(self.sampler.epoch + 1)
            self._batches = iter(self.loader)
            return next(self._batches)

    # -- the loop ----------------------------------------------------------------------------
    def _train_step(self) -> float:
        """One optimizer step over ``grad_accum`` micro-batches; returns this rank's mean loss."""
        total = 0.0
        for _ in range(self.s.grad_accum):
            loss = self.loss_fn(self.model, self._next_batch())
            if self.fault is not None:
                self.fault.maybe_fire(self.rank, self.step + 1)  # mid-step: after a forward
            self.opt.backward(loss / self.s.grad_accum)
            total += float(loss.detach())
        if self.s.grad_clip:
            self.opt.clip_grad_norm_(self.s.grad_clip)
        skipped = self.opt.engine.scaler.skipped_steps if self.opt.engine.scaler is not None else 0
        self.lr = float(self.opt.param_groups[0]["lr"])  # the lr this step uses (logged)
        self.opt.step()
        # DeepSpeed does not advance the schedule on a step skipped for fp16 overflow: neither do we.
        if self.sched is not None and (self.opt.engine.scaler is None or self.opt.engine.scaler.skipped_steps == skipped):
            self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        return total / self.s.grad_accum

    def run(self) -> str:
        """Trains up to ``max_steps``; returns "completed" or "preempted" (saved either way)."""
        steps_done = 0
        while self.step < self.s.max_steps:
            loss = self._train_step()
            self.step += 1
            steps_done += 1
            stop, (loss_sum,) = self.preemption.agree(self.opt.engine.comm.group, [loss])
            if self.watchdog is not None:
                self.watchdog.beat(self.step)
            self.progress.step(self.step, loss_sum / self.world, self.lr, steps_done)
            if stop:
                who = signal_name(self.preemption.received) if self.preemption.requested else "another rank"
                self.progress.log(f"preemption requested ({who}): saving step {self.step} and exiting", echo=True)
                if self.opt.engine.memory_tier is not None:  # the handoff first (Note [preemption handoff])
                    info = zeroshard.memory_handoff(self.step, preemption=self.preemption, model=self.model,
                                                    optimizer=self.opt, scheduler=self.sched, dataloader=self.sampler,
                                                    extra={"run": self.extra})
                    self.progress.log(f"step {self.step} handed to the memory tiers in {info['seconds']:.2f} s "
                                      f"(leaving ranks {info['leaving']}, slots sent {info['pairs']})"
                                      if info["handed_off"] else "the memory tier is off: no handoff", echo=True)
                self.save(wait=True)
                self.opt.engine.comm.barrier()
                return "preempted"
            if self.opt.engine.memory_tier is not None:  # the step's commit (Note [peer memory tier])
                zeroshard.memory_checkpoint(self.step, model=self.model, optimizer=self.opt, scheduler=self.sched,
                                            dataloader=self.sampler, extra={"run": self.extra})
                pacer = self.opt.engine.memory_tier.pacer  # (every="auto": Note [commit pacing])
                news = pacer.news() if pacer is not None else None
                if news is not None:
                    self.progress.log(news, echo=True)
            if self.step % self.s.save_interval == 0:
                self.save()
        self.save(wait=True)
        zeroshard.wait_checkpoint()
        return "completed"
