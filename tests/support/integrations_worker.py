"""Runs inside each rank (``python tests/support/integrations_worker.py OUT DIR LIBS STAGES``, under torchrun
for 2 ranks): the Hugging Face Trainer, Accelerate and Lightning, each with torch.optim.AdamW
(the reference) and with a ZeroOptimizer at the given stages, on the GPT-2 of
tests/support/dropin_worker.py. Every zeroshard run saves at step K through the library, a fresh run
resumes from that checkpoint, and both finish at step STEPS. Writes per-cell JSON for
tests/integrations/test_integrations.py: weights vs the reference, resumed vs uninterrupted, logged grad norm
and learning rate vs the reference."""
from __future__ import annotations

import json
import os
import sys
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

if __name__ == "__main__":  # run as a script: import this worktree's zeroshard and tests
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import zeroshard  # noqa: E402
from tests.support.dropin_worker import MAX_NORM, SEQ, VOCAB, gpt2  # noqa: E402

STEPS = 6          # optimizer steps per run
K = 3              # checkpoint step the resumed run starts from
ACCUM = 2          # micro-batches per optimizer step
GLOBAL_MICRO = 4   # samples per micro-batch over all ranks
LR, WD = 1e-2, 0.1


def samples(n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1234)
    return torch.randint(0, VOCAB, (n, SEQ), generator=g)


class TokenDataset(torch.utils.data.Dataset):
    def __init__(self, dicts: bool) -> None:
        self.data = samples(STEPS * ACCUM * GLOBAL_MICRO)
        self.dicts = dicts

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> Any:
        x = self.data[i]
        return {"input_ids": x, "labels": x} if self.dicts else x


def make_optimizer(model: torch.nn.Module, stage: Optional[int]) -> torch.optim.Optimizer:
    if stage is None:
        return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    return zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=LR, weight_decay=WD, stage=stage)


def lr_lambda(step: int) -> float:
    return 1.0 / (1 + 0.2 * step)


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    opt = zeroshard.optim.registry.optimizer_for(model)
    if opt is not None and opt.engine.gatherer is not None:
        return zeroshard.full_state_dict(model, rank0_only=False)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def rel_diff(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    """Largest |got - ref| over all weights, relative to the largest |ref| (the model's scale).
    (Per tensor, attention key biases are not comparable: their true gradient is zero, so Adam
    turns rounding noise into full-size steps of either sign in any two implementations.)"""
    diff = max(float((got[k].float() - v.float()).abs().max()) for k, v in ref.items())
    return diff / max(float(v.abs().max()) for v in ref.values())


def worst_tensor(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> list:
    rows = [(float((got[k].float() - v.float()).abs().max()) / max(float(v.abs().max()), 1e-12), k)
            for k, v in ref.items()]
    return max(rows)


def seq_rel(a: list[float], b: list[float]) -> float:
    if len(a) != len(b):
        return float("inf")
    return max((abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b)), default=0.0)


# -- Hugging Face Trainer -------------------------------------------------------------------------
def run_trainer(stage: Optional[int], out: str, world: int, resume: Optional[str] = None) -> dict:
    from transformers import Trainer, TrainingArguments
    model = gpt2()
    opt = make_optimizer(model, stage)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    args = TrainingArguments(
        output_dir=out, per_device_train_batch_size=GLOBAL_MICRO // world, gradient_accumulation_steps=ACCUM,
        max_steps=STEPS, save_strategy="steps", save_steps=K, logging_steps=1, max_grad_norm=MAX_NORM,
        report_to=[], use_cpu=True, seed=0, disable_tqdm=True, dataloader_num_workers=0,
        save_total_limit=None, ddp_backend="gloo" if world > 1 else None)
    callbacks = []
    if stage is not None:
        from zeroshard.integrations.transformers import ZeroCallback
        callbacks.append(ZeroCallback())
    trainer = Trainer(model=model, args=args, train_dataset=TokenDataset(True), optimizers=(opt, sched),
                      callbacks=callbacks)
    trainer.train(resume_from_checkpoint=resume)
    logs = [e for e in trainer.state.log_history if "grad_norm" in e]
    return {"weights": weights(model), "grad_norm": [float(e["grad_norm"]) for e in logs],
            "lr": [float(e["learning_rate"]) for e in logs], "checkpoint": os.path.join(out, f"checkpoint-{K}")}


# -- Accelerate -----------------------------------------------------------------------------------
def run_accelerate(stage: Optional[int], out: str, world: int, resume: Optional[str] = None) -> dict:
    from accelerate import Accelerator
    acc = Accelerator(cpu=True, gradient_accumulation_steps=ACCUM)
    model = gpt2()
    opt = make_optimizer(model, stage)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    if stage is not None:
        from zeroshard.integrations.accelerate import attach
        attach(acc, opt)
    loader = torch.utils.data.DataLoader(TokenDataset(True), batch_size=GLOBAL_MICRO // world, shuffle=False)
    model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
    start = 0
    if resume is not None:
        acc.load_state(resume)
        start = K
        loader = acc.skip_first_batches(loader, K * ACCUM)
    norms, lrs, step = [], [], start
    for batch in loader:
        with acc.accumulate(model):
            loss = model(**batch).loss
            acc.backward(loss)
            if acc.sync_gradients:
                norms.append(float(acc.clip_grad_norm_(model.parameters(), MAX_NORM)))
                lrs.append(float(sched.get_last_lr()[0]))
            opt.step()
            sched.step()
            opt.zero_grad()
        if acc.sync_gradients:
            step += 1
            if step == K and resume is None:
                acc.save_state(os.path.join(out, f"step-{K}"))
    return {"weights": weights(acc.unwrap_model(model)), "grad_norm": norms, "lr": lrs,
            "checkpoint": os.path.join(out, f"step-{K}")}


# -- Lightning ------------------------------------------------------------------------------------
def run_lightning(stage: Optional[int], out: str, world: int, resume: Optional[str] = None) -> dict:
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.utilities import grad_norm

    class Lit(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = gpt2()  # (stage 3 takes the HF model: its forward runs; the module's does not)
            self.norms: list[float] = []
            self.lrs: list[float] = []

        def training_step(self, batch: torch.Tensor, i: int) -> torch.Tensor:
            return self.net(input_ids=batch, labels=batch).loss

        def configure_optimizers(self) -> Any:
            opt = make_optimizer(self.net if stage is not None else self, stage)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

        def on_before_optimizer_step(self, optimizer: Any) -> None:
            self.norms.append(float(grad_norm(self, 2)["grad_2.0_norm_total"]))
            self.lrs.append(float(optimizer.param_groups[0]["lr"]))

    if stage is None:
        strategy: Any = "ddp" if world > 1 else "auto"
    else:
        from zeroshard.integrations.lightning import ZeroStrategy
        strategy = ZeroStrategy()
    steps_per_epoch = K  # an epoch ends at the checkpoint, so resuming starts a fresh epoch
    ckpt = ModelCheckpoint(dirpath=out, every_n_epochs=1, save_top_k=-1, save_on_train_epoch_end=True,
                           filename="{epoch}")
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_epochs=STEPS // steps_per_epoch,
                        gradient_clip_val=MAX_NORM, accumulate_grad_batches=ACCUM, callbacks=[ckpt],
                        logger=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, limit_val_batches=0, use_distributed_sampler=False)
    data = TokenDataset(False)
    data.data = data.data[:steps_per_epoch * ACCUM * GLOBAL_MICRO]
    # The same sampler for every strategy (Lightning's injected one shuffles at any world size).
    sampler = torch.utils.data.DistributedSampler(data, world, int(os.environ.get("RANK", "0")), shuffle=False)
    loader = torch.utils.data.DataLoader(data, batch_size=GLOBAL_MICRO // world, sampler=sampler)
    lit = Lit()
    trainer.fit(lit, train_dataloaders=loader, ckpt_path=resume)
    return {"weights": weights(lit.net), "grad_norm": lit.norms, "lr": lit.lrs,
            "checkpoint": os.path.join(out, "epoch=0.ckpt")}


RUNNERS: dict[str, Callable[..., dict]] = {"trainer": run_trainer, "accelerate": run_accelerate,
                                           "lightning": run_lightning}


def main(out_path: str, root: str, libs: list[str], stages: list[int]) -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("gloo")
    torch.set_num_threads(1)
    results: dict[str, Any] = {}
    for lib in libs:
        run = RUNNERS[lib]
        ref = run(None, os.path.join(root, f"{lib}-ref"), world)
        for stage in stages:
            key = f"{lib}-stage{stage}"
            try:
                full = run(stage, os.path.join(root, f"{key}-full"), world)
                resumed = run(stage, os.path.join(root, f"{key}-resumed"), world, resume=full["checkpoint"])
                results[key] = {
                    "weight_rel": rel_diff(full["weights"], ref["weights"]),
                    "resume_rel": rel_diff(resumed["weights"], full["weights"]),
                    "resume_ref_rel": rel_diff(resumed["weights"], ref["weights"]),
                    "grad_norm_rel": seq_rel(full["grad_norm"], ref["grad_norm"]),
                    "lr_rel": seq_rel(full["lr"], ref["lr"]),
                    "resumed_log_rel": seq_rel(resumed["grad_norm"], ref["grad_norm"][-len(resumed["grad_norm"]):]
                                               if resumed["grad_norm"] else []),
                    "grad_norms": full["grad_norm"], "ref_grad_norms": ref["grad_norm"],
                    "clipped": min(ref["grad_norm"]) > MAX_NORM if ref["grad_norm"] else False,
                    "worst_tensor": worst_tensor(full["weights"], ref["weights"]),
                    "moved": max(float((full["weights"][k] - v).abs().max()) for k, v in gpt2().state_dict().items()
                                 if k in full["weights"]),
                }
            except Exception as exc:  # reported per cell; at 2 ranks a failure stops both
                import traceback
                results[key] = {"error": f"{type(exc).__name__}: {exc}"[:3000], "trace": traceback.format_exc()[-4000:]}
                if world > 1:
                    raise
    if world > 1:
        results["refusal"] = refusal_probe()
    with open(f"{out_path}.rank{rank}", "w") as f:
        json.dump(results, f, indent=1)


def refusal_probe() -> dict:
    """What a rank-0-only torch.save(optimizer.state_dict()) meets under each integration: an
    error at save time naming the fix (an in-memory round trip still works)."""
    import io
    out = {}
    fixes = {"trainer": ("zeroshard.integrations.transformers", "ZeroCallback"),
             "accelerate": ("zeroshard.integrations.accelerate", "attach("),
             "lightning": ("zeroshard.integrations.lightning", "ZeroStrategy")}
    for lib, (module, needle) in fixes.items():
        import importlib
        from zeroshard.integrations._common import SaveGuard
        model = gpt2()
        opt = make_optimizer(model, 2)
        SaveGuard.install(opt, importlib.import_module(module).FIX)
        sd = opt.state_dict()
        opt.load_state_dict(sd)  # in memory: fine
        try:
            torch.save(sd, io.BytesIO())
            out[lib] = "saved"
        except RuntimeError as exc:
            out[lib] = "refused" if needle in str(exc) else f"refused without the fix: {exc}"
    return out


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3].split(","), [int(s) for s in sys.argv[4].split(",")])
    # Results are written: end as the training entry points do (Note [teardown] in
    # zeroshard/train/failures.py), so native destructors at interpreter exit cannot abort a
    # finished rank (seen once in CI: SIGABRT after the last cell).
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    from zeroshard.train.failures import end_process
    end_process(0)
