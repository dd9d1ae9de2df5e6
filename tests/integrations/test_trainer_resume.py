"""Issue 39: a plain Hugging Face Trainer (no zeroshard) resumes a checkpoint written through
ZeroCallback (Note [regrouped state] in zeroshard/optim/regroup.py): the Trainer builds its
own AdamW with two groups (decay / no decay), and torch refused the one-group state ("different
number of parameter groups"). The ZeroOptimizer's own resume still continues bit for bit."""
from __future__ import annotations

import os

import torch

import zeroshard
from tests.support.integrations_worker import ACCUM, GLOBAL_MICRO, K, LR, STEPS, WD, TokenDataset, lr_lambda
from tests.support.dropin_worker import MAX_NORM, gpt2


def _args(out: str, **extra: object):
    from transformers import TrainingArguments
    return TrainingArguments(
        output_dir=out, per_device_train_batch_size=GLOBAL_MICRO, gradient_accumulation_steps=ACCUM,
        max_steps=STEPS, save_strategy="steps", save_steps=K, logging_steps=1, max_grad_norm=MAX_NORM,
        report_to=[], use_cpu=True, seed=0, disable_tqdm=True, dataloader_num_workers=0, save_total_limit=None,
        **extra)


def _zero_trainer(out: str):
    from transformers import Trainer
    from zeroshard.integrations.transformers import ZeroCallback
    model = gpt2()
    opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=LR, weight_decay=WD, stage=2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    return model, Trainer(model=model, args=_args(out), train_dataset=TokenDataset(True), optimizers=(opt, sched),
                          callbacks=[ZeroCallback()])


def test_plain_trainer_resumes_a_zerocallback_checkpoint(tmp_path):
    from transformers import Trainer
    model, trainer = _zero_trainer(str(tmp_path / "zero"))
    trainer.train()
    checkpoint = os.path.join(str(tmp_path / "zero"), f"checkpoint-{K}")
    saved = torch.load(os.path.join(checkpoint, "optimizer.pt"), weights_only=True)
    assert len(saved["param_groups"]) == 2  # the Trainer's grouping, each group naming its parameters

    plain = Trainer(model=gpt2(), args=_args(str(tmp_path / "plain"), learning_rate=LR, weight_decay=WD),
                    train_dataset=TokenDataset(True))
    plain.train(resume_from_checkpoint=checkpoint)  # (raised: different number of parameter groups)
    steps = {float(s["step"]) for s in plain.optimizer.state.values()}
    assert steps == {float(STEPS)}  # the saved state's K steps, then STEPS - K more
    assert [g["weight_decay"] for g in plain.optimizer.param_groups] == [WD, WD]  # what the run trained with

    # the ZeroOptimizer's own resume takes the regrouped state back, and continues exactly
    final = {n: p.detach().clone() for n, p in model.named_parameters()}
    again, trainer = _zero_trainer(str(tmp_path / "again"))
    trainer.train(resume_from_checkpoint=checkpoint)
    assert all(torch.equal(p, final[n]) for n, p in again.named_parameters())
