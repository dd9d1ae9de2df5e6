"""Fine-tune a causal LM with the Hugging Face Trainer and a ZeroOptimizer.

    torchrun --nproc-per-node 2 examples/finetune_trainer.py --model ./my-model --data corpus.txt \
        --output-dir runs/trainer --stage 2 --max-steps 200 --save-steps 50
    # again with --resume to continue from the newest checkpoint-N

--model-config config.json builds a random model instead (no download). The only zeroshard
lines are the optimizer and the callback; the rest is the stock Trainer.
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist


class TextBlocks(torch.utils.data.Dataset):
    """The token ids of a text file, cut into blocks of ``seq_len`` (labels = inputs)."""

    def __init__(self, ids: torch.Tensor, seq_len: int) -> None:
        n = (len(ids) // seq_len) * seq_len
        if n == 0:
            raise ValueError(f"the data has {len(ids)} tokens, fewer than one block of --seq-len {seq_len}")
        self.blocks = ids[:n].view(-1, seq_len)

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.blocks[i], "labels": self.blocks[i]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="a Hugging Face model directory or name (with its tokenizer)")
    src.add_argument("--model-config", help="a config.json: random weights, bytes as tokens")
    p.add_argument("--data", required=True, help="a UTF-8 text file")
    p.add_argument("--output-dir", required=True)
    p.add_argument("--stage", type=int, default=2, choices=[0, 1, 2, 3])
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--max-steps", type=int, default=100)
    p.add_argument("--save-steps", type=int, default=50)
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --output-dir")
    a = p.parse_args()

    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments
    from transformers.trainer_utils import get_last_checkpoint

    import zeroshard
    from zeroshard.integrations.transformers import ZeroCallback

    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")  # before the optimizer
    text = open(a.data, encoding="utf-8").read()
    if a.model:
        tok = AutoTokenizer.from_pretrained(a.model)
        ids = torch.tensor(tok(text)["input_ids"], dtype=torch.long)
        model = AutoModelForCausalLM.from_pretrained(a.model)
    else:
        config = AutoConfig.from_pretrained(a.model_config)
        ids = torch.tensor(list(text.encode("utf-8")), dtype=torch.long) % config.vocab_size
        model = AutoModelForCausalLM.from_config(config)
    if torch.cuda.is_available():  # the model sits where it trains before the optimizer is built
        model.to(f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}")

    opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=a.lr, weight_decay=a.weight_decay, stage=a.stage)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: max(0.0, 1.0 - s / a.max_steps))
    args = TrainingArguments(output_dir=a.output_dir, per_device_train_batch_size=a.micro_batch_size,
                             gradient_accumulation_steps=a.grad_accum, max_grad_norm=a.max_grad_norm,
                             max_steps=a.max_steps, save_strategy="steps", save_steps=a.save_steps,
                             logging_steps=10, report_to=[], use_cpu=not torch.cuda.is_available())
    trainer = Trainer(model=model, args=args, train_dataset=TextBlocks(ids, a.seq_len), optimizers=(opt, sched),
                      callbacks=[ZeroCallback()])
    resume = get_last_checkpoint(a.output_dir) if a.resume and os.path.isdir(a.output_dir) else None
    trainer.train(resume_from_checkpoint=resume)
    trainer.save_model(os.path.join(a.output_dir, "final"))  # full weights at every stage


if __name__ == "__main__":
    main()
