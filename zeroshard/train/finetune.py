"""Fine-tuning a Hugging Face causal LM with zeroshard: the whole workflow in one command.

    torchrun --nproc-per-node 2 examples/finetune_causal_lm.py \\
        --model-config tiny-gpt2/config.json --data corpus.txt --output-dir run1 --max-steps 200

(``zeroshard finetune ...`` / ``python -m zeroshard.train.finetune ...`` are the same.)
Started again with the same arguments it resumes from the newest valid checkpoint under
``--output-dir`` with no flag: after SIGTERM/SIGUSR1 (saved at the next step boundary,
exit 0), after a crash, or when restarted by ``torchrun --max-restarts``. A rank that
dies makes the others exit with status 3 and a message instead of hanging.
"""
from __future__ import annotations

import argparse
import datetime
import faulthandler
import os
import shutil
import traceback
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

import zeroshard
from zeroshard.cli import Command, add_debug_flag, one_line_usage, report_error
from zeroshard.data import ResumableSampler
from zeroshard.optim.zero_optimizer import ZeroOptimizer
from zeroshard.train import faults
from zeroshard.train.finetune_config import FinetuneConfig, add_arguments
from zeroshard.train.failures import (EXIT_PEER_FAILURE, StepWatchdog, end_process, exit_now, fence_stopped_peers,
                                      fenced_note, is_peer_failure, peer_failure_message)
from zeroshard.train.initialize_from_config import initialize
from zeroshard.train.loop import LoopSettings, TrainLoop
from zeroshard.train.model_loading import build_model, finish_weights, max_positions, save_model_files
from zeroshard.train.preemption import PreemptionHandler
from zeroshard.train.progress import Progress
from zeroshard.train.text_data import load_blocks, load_tokenizer


def setup_distributed(timeout_s: float) -> torch.device:
    """Joins the torchrun job (if launched by one) with collectives that time out."""
    device = torch.device("cpu")
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1 or dist.is_initialized():
        return device
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is not None and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # torchrun's static rendezvous keeps one store across --max-restarts, so a restarted
        # job would read the dead workers' gloo/NCCL addresses from it and fail to connect:
        # give every attempt its own key space.
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                              is_master=False, timeout=timeout)
        dist.init_process_group(backend, store=dist.PrefixStore(f"zeroshard/attempt-{attempt}", store),
                                rank=int(os.environ["RANK"]), world_size=world, timeout=timeout)
    else:
        dist.init_process_group(backend, timeout=timeout)
    return device


def release_memory_tier(opt: ZeroOptimizer) -> None:
    """Removes this node's memory tier of a completed run (``--redundancy peer``): it holds two
    steps of every local rank's state in tmpfs, which outlives the processes."""
    tier = opt.engine.memory_tier
    if tier is None:
        return
    tier.wait()
    if dist.is_initialized():
        dist.barrier()  # (every rank's commit thread is done with its slots and its buddy's)
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        shutil.rmtree(tier.root, ignore_errors=True)


def _hf_loss(device: torch.device):
    def loss_fn(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        ids = batch[0].to(device, non_blocking=True).long()  # blocks are int32 (text_data)
        return model(input_ids=ids, labels=ids).loss
    return loss_fn


def train(cfg: FinetuneConfig) -> int:
    """Runs (or resumes) the fine-tuning described by ``cfg`` on this rank; the exit status."""
    os.environ.setdefault("ZEROSHARD_PG_TIMEOUT", str(cfg.collective_timeout))  # checkpoint side group too
    device = setup_distributed(cfg.collective_timeout)
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    progress: Optional[Progress] = None
    loop: Optional[TrainLoop] = None
    root = os.path.join(cfg.output_dir, "checkpoints")
    try:
        if os.path.exists(cfg.output_dir) and not os.path.isdir(cfg.output_dir):
            raise ValueError(f"--output-dir {cfg.output_dir!r} exists and is not a directory; give a directory "
                             "(created if missing)")
        model, source = build_model(cfg.model, cfg.model_config, cfg.stage, cfg.seed, cfg.activation_checkpointing,
                                    cfg.lora_config())
        positions = max_positions(model)
        if positions is not None and cfg.seq_len > positions:
            raise ValueError(f"--seq-len {cfg.seq_len} is longer than the model's {positions} positions "
                             "(max_position_embeddings in its config.json); use --seq-len <= "
                             f"{positions}")
        if cfg.stage != 3:
            model.to(device)
        ds = cfg.deepspeed if cfg.deepspeed else cfg.as_deepspeed()
        overrides = cfg.overrides() if cfg.deepspeed else {}
        result = initialize(model, ds, auto=cfg.auto_values(), redundancy=cfg.peer_redundancy(), **overrides)
        model, opt, sched = result
        plan = result.plan
        finish_weights(model, source, cfg.seed)
        micro = plan.micro_batch_size or cfg.micro_batch_size
        accum = plan.gradient_accumulation_steps
        tokenizer = load_tokenizer(source.tokenizer_dir, model.config.vocab_size, model.config.eos_token_id)
        blocks = load_blocks(cfg.data, tokenizer, cfg.seq_len, os.path.join(cfg.output_dir, "cache"), cfg.text_field)
        if len(blocks) < world * micro:
            raise ValueError(f"{cfg.data} gives {len(blocks)} blocks of {cfg.seq_len} tokens, fewer than one global "
                             f"micro-batch ({world} ranks x {micro}); add text or lower --seq-len/--micro-batch-size")
        sampler = ResumableSampler(len(blocks), shuffle=True, seed=cfg.seed)
        # Own generator: a DataLoader otherwise draws from the global RNG whenever an iterator
        # starts, which a resumed run does at another step than the original (bitwise resume).
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(blocks), batch_size=micro,
                                             sampler=sampler, drop_last=True, generator=torch.Generator())
        tokens_per_step = micro * accum * world * cfg.seq_len
        # A DeepSpeed config's steps_per_print sets the log interval unless --log-interval was given.
        log_every = plan.steps_per_print if plan.steps_per_print and "log_interval" not in cfg.explicit \
            else cfg.log_interval
        progress = Progress(cfg.output_dir, rank, cfg.max_steps, tokens_per_step, log_every, cfg.progress_bar)
        settings = LoopSettings(max_steps=cfg.max_steps, checkpoint_root=root, grad_accum=accum,
                                grad_clip=plan.gradient_clipping, save_interval=cfg.save_interval,
                                keep_last=cfg.keep_last, async_save=cfg.async_save)
        run_facts = {"world_size": world, "global_batch": micro * accum * world, "seq_len": cfg.seq_len,
                     "blocks": len(blocks)}
        with PreemptionHandler() as preemption:
            loop = TrainLoop(settings, model, opt, sched, loader, sampler, _hf_loss(device), progress, preemption,
                             fault=faults.from_env(), extra=run_facts)
            progress.log(f"{world} rank(s), {opt!r}, {len(blocks)} blocks x {cfg.seq_len} tokens, global batch "
                         f"{micro * accum * world} sequences ({micro} x {accum} accumulation x {world} ranks)",
                         echo=True)
            if (tier_line := cfg.redundancy_summary()) is not None:
                progress.log(tier_line, echo=True)
            resumed = loop.resume()
            progress.start(loop.step, resumed)
            # Armed only now: loading a checkpoint may take long, a step boundary must not.
            if world > 1:
                loop.watchdog = StepWatchdog(2 * cfg.collective_timeout, rank, progress.log).start()
            status = loop.run()
            if loop.watchdog is not None:
                loop.watchdog.stop()
        progress.log(f"model state on rank {rank}: {opt.memory_report()}", echo=True)
        if status == "completed":  # the disk holds the last step: the tier's node memory is given back
            release_memory_tier(opt)
        if status == "completed" and cfg.export:
            out = cfg.export_dir or os.path.join(cfg.output_dir, "hf")
            if cfg.uses_lora:  # (collectives: the checkpoints hold only the adapters)
                zeroshard.save_adapter(model, os.path.join(out, "adapter"))
                zeroshard.export_merged(model, out)
            elif rank == 0:
                latest = zeroshard.latest_checkpoint(root)
                if latest is None:  # (a completed run saved its last step)
                    raise RuntimeError(f"the run completed but {root!r} holds no valid checkpoint to export")
                zeroshard.export_hf(latest, out)
            if rank == 0:
                save_model_files(model, tokenizer, out)
                progress.summary.exported_to = out
        message = "" if status == "completed" else "run the same command again to resume"
        progress.finish(status, message)
        if dist.is_initialized():
            dist.destroy_process_group()
        return 0
    except Exception as exc:  # noqa: BLE001 - turned into an exit status with a message
        step = loop.step + 1 if loop is not None else 0  # the step in progress
        log = progress.log if progress is not None else None
        if world > 1 and is_peer_failure(exc):
            exit_now(EXIT_PEER_FAILURE, peer_failure_message(rank, step, exc, zeroshard.latest_checkpoint(root),
                                                             cfg.collective_timeout)
                     + fenced_note(fence_stopped_peers()), log)
        if log is not None:
            log(f"failed at step {step}: {traceback.format_exc()}")
        raise
    finally:
        if progress is not None:
            progress.close()


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The command line of ``examples/finetune_causal_lm.py``: an error is one line on stderr
    and exit status 1 (``--debug``: the traceback), as ``zeroshard finetune``."""
    parser = one_line_usage(argparse.ArgumentParser(prog="finetune_causal_lm", description=__doc__))
    add_debug_flag(parser)
    add_arguments(parser)
    args = parser.parse_args(argv)
    if getattr(args, "debug", False):
        return train(FinetuneConfig.from_args(args))
    try:
        return train(FinetuneConfig.from_args(args))
    except Exception as exc:  # noqa: BLE001 - one line; --debug shows the traceback
        return report_error("finetune", exc)


COMMANDS = {
    "finetune": Command(
        help="fine-tune a Hugging Face causal LM on a text file (launch with torchrun; reruns resume)",
        add_arguments=add_arguments,
        run=lambda args: train(FinetuneConfig.from_args(args)), one_line_errors=True),
}


if __name__ == "__main__":
    faulthandler.enable()  # a native crash prints every thread's Python stack
    end_process(main())
