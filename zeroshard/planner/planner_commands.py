"""``zeroshard estimate``: which stage/offload choice fits a model on given hardware."""
from __future__ import annotations

import argparse
from dataclasses import replace
import json
import sys

from zeroshard.cli import Command
from zeroshard.planner.activation_mix import mixed_for_estimate
from zeroshard.planner.activation_plan import for_estimate
from zeroshard.planner.estimate import Hardware, Workload, plan
from zeroshard.planner.model_shape import ModelShape
from zeroshard.planner.optimizer_state import OPTIMIZERS, optimizer_bytes_per_param
from zeroshard.planner.traffic import Topology
from zeroshard.planner.report import plan_markdown
from zeroshard.planner.sizes import parse_bytes, parse_count


def _add_arguments(p: argparse.ArgumentParser) -> None:
    model = p.add_mutually_exclusive_group(required=True)
    model.add_argument("--params", help="trainable parameter count, e.g. 124M or 7B")
    model.add_argument("--hf-config", help="a Hugging Face config.json (or its directory)")
    p.add_argument("--layers", type=int, default=0, help="with --params: transformer blocks (default: assumed)")
    p.add_argument("--hidden", type=int, default=0, help="with --params: d_model (default: assumed)")
    p.add_argument("--vocab", type=int, default=50257, help="with --params: vocabulary size")
    p.add_argument("--gpu-memory", required=True, help="memory per GPU, e.g. 80GB")
    p.add_argument("--gpus", type=int, default=1, help="GPUs per node")
    p.add_argument("--nodes", type=int, default=1, help="nodes of --gpus GPUs each")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree inside a node")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages (across nodes where it divides --nodes)")
    p.add_argument("--scope", choices=("flat", "hybrid", "hpz"), default="flat",
                   help="data-parallel sharding: one flat group, hybrid (shard in the node, replicate "
                        "across), or hpz (stage 3 with a secondary partition in the node)")
    p.add_argument("--cpu-memory", default="0", help="CPU memory of the node, e.g. 512GB")
    p.add_argument("--nvme", default="0", help="free NVMe space for offload, e.g. 2TB")
    p.add_argument("--batch", "--micro-batch", dest="batch", type=int, default=1,
                   help="micro-batch per GPU (sequences)")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--loss-chunk", type=int, default=0,
                   help="tokens per chunk of a chunked loss (zeroshard.chunked_cross_entropy); 0: the full logits")
    p.add_argument("--checkpoint-granularity", choices=("block", "half"), default="block",
                   help="what one checkpoint covers: a block, or its attention and MLP halves apart")
    p.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="bf16")
    p.add_argument("--optim-bytes", type=float, default=None, help="optimizer bytes per parameter (Adam: 8)")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw",
                   help="counts its state: adamw/adam 8 bytes/param, sgd 4, muon (Muon's recipe) and adafactor by "
                        "the model's matrices (default adamw; --optim-bytes overrides)")
    p.add_argument("--usable", type=float, default=0.9, help="usable share of GPU/CPU memory")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--trainable-fraction", type=float, default=None,
                   help="share of the parameters that train, e.g. 0.01 for LoRA (the rest is frozen)")
    p.add_argument("--lora-r", type=int, default=None, help="with --hf-config: LoRA rank (counts the adapters exactly)")
    p.add_argument("--lora-targets", default=None, help="with --lora-r: comma-separated modules (default all linear)")
    p.add_argument("--peft-config", default=None, help="with --hf-config: a JSON file of peft.LoraConfig arguments")


def _run(a: argparse.Namespace) -> int:
    try:
        if a.hf_config:
            shape = ModelShape.from_hf_config(a.hf_config)
        else:
            shape = ModelShape.from_params(parse_count(a.params), n_layers=a.layers, d_model=a.hidden, vocab=a.vocab)
        shape = replace(shape, loss_chunk=a.loss_chunk, checkpoint_parts=2 if a.checkpoint_granularity == "half" else 1)
        hw = Hardware(parse_bytes(a.gpu_memory), a.gpus, parse_bytes(a.cpu_memory), parse_bytes(a.nvme), a.usable,
                      nodes=a.nodes)
        shape, fraction = _trainable(a, shape)
        optim_bytes = a.optim_bytes if a.optim_bytes is not None else optimizer_bytes_per_param(shape, a.optimizer)
        w = Workload(a.batch, a.seq_len, None if a.precision == "fp32" else a.precision, optim_bytes,
                     tp=a.tp, scope=a.scope, trainable_fraction=fraction, pp=a.pp)
        Topology(hw.nodes, hw.n_gpus, w.tp, w.scope, w.pp)  # (tp and pp must divide the ranks)
    except (ValueError, TypeError) as exc:
        print(f"zeroshard estimate: {exc}", file=sys.stderr)
        return 2
    result = plan(shape, hw, w)
    acts = for_estimate(result)  # (per block: keep / checkpoint / offload; Note [planning activations])
    if "device_left" in acts:  # (blocks not checkpointed by the model: Note [mixed activation plans])
        acts["not_checkpointed"] = mixed_for_estimate(shape, max(1, shape.n_layers // w.pp), w.micro_batch, w.seq_len,
                                                      w.param_bytes, acts)
    if a.json:
        best = result.recommended
        rows = [{"config": e.choice.label, "gpu_model_states": e.gpu_states.model_states,
                 "gpu_buffers": e.gpu_states.buffers, "gpu_frozen": e.gpu_states.frozen,
                 "activations": e.activations, "gpu_total": e.gpu_total,
                 "cpu_total": e.cpu_total, "nvme_total": e.nvme_total,
                 "checkpoint_async_cpu": e.checkpoint_async_cpu, "fits": e.fits, "why_not": e.why_not,
                 "gpu_secondary": e.gpu_states.secondary,
                 "intra_node_bytes_per_step": e.traffic.intra_node if e.traffic is not None else None,
                 "inter_node_bytes_per_step": e.traffic.inter_node if e.traffic is not None else None}
                for e in result.estimates]
        print(json.dumps({"params": shape.n_params, "trainable_fraction": w.trainable_fraction, "rows": rows,
                          "nodes": a.nodes, "gpus_per_node": a.gpus, "tp": a.tp, "pp": a.pp, "scope": a.scope,
                          "recommended": best.choice.label if best else None, "activation_plan": acts}, indent=1))
    else:
        print(plan_markdown(result))
        print(f"\nActivations at --micro-batch {w.micro_batch} x --seq-len {w.seq_len} with {acts['config']}: "
              + (acts.get("summary") or acts.get("error", "")))
        mixed = acts.get("not_checkpointed")
        if mixed is not None:
            print("Blocks not checkpointed by the model (PlannedActivations(checkpointed=False)): "
                  + (mixed.get("summary") or mixed.get("error", "")))
    return 0


def _trainable(a: argparse.Namespace, shape: ModelShape) -> tuple[ModelShape, float]:
    """The shape over all parameters and the trainable share, from --trainable-fraction or a
    LoRA configuration counted on the meta device."""
    lora = a.lora_r is not None or a.peft_config is not None
    if lora and a.trainable_fraction is not None:
        raise ValueError("give --trainable-fraction or --lora-r/--peft-config, not both")
    if a.lora_targets is not None and a.lora_r is None:
        raise ValueError("--lora-targets needs --lora-r")
    if not lora:
        return shape, 1.0 if a.trainable_fraction is None else a.trainable_fraction
    if not a.hf_config:
        raise ValueError("--lora-r/--peft-config count the adapters on the model: give --hf-config (or "
                         "--params with --trainable-fraction)")
    from dataclasses import replace as _replace

    from zeroshard.planner.peft_shape import lora_counts
    config = None
    if a.peft_config is not None:
        from zeroshard.train.finetune_config import FinetuneConfig
        config = FinetuneConfig(data="-", output_dir="-", model_config="-", peft_config=a.peft_config).lora_config()
    targets = [t.strip() for t in a.lora_targets.split(",") if t.strip()] if a.lora_targets else None
    total, trainable = lora_counts(a.hf_config, a.lora_r, targets, config)
    return _replace(shape, n_params=total), trainable / total


COMMANDS = {"estimate": Command("plan which ZeRO stage/offload fits a model on given hardware",
                                _add_arguments, _run)}
