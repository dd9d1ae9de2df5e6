"""Options of ``examples/finetune_causal_lm.py`` / ``zeroshard finetune``: one frozen dataclass.

The ZeRO, optimizer, schedule and batch options are turned into a DeepSpeed-style config
dict (``as_deepspeed``), so a run configured by flags and a run configured by
``--deepspeed ds_config.json`` take the same path (``zeroshard.initialize``). With
``--deepspeed``, flags given explicitly on the command line override the file.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
from dataclasses import dataclass, field, fields
from typing import Any, Optional, Sequence, Union

from zeroshard.config import Placement, check_offload
from zeroshard.resilience.redundancy_options import PeerRedundancy, pacing

_SCHEDULES = ("constant", "linear", "cosine")
_PRECISIONS = ("fp32", "bf16", "fp16")
_OPTIMIZERS = {"adamw": "AdamW", "adam": "Adam", "sgd": "SGD", "muon": "Muon", "adafactor": "Adafactor"}
_OFFLOAD = ("none", "cpu", "nvme")
_REDUNDANCY = ("none", "peer")
JSON_SUFFIXES = (".jsonl", ".json", ".ndjson")
"""Data files read as JSON documents (``--text-field`` names their text); others are plain text."""
LORA_R_MAX = 65536
"""The largest LoRA rank accepted (``--lora-r``, a ``--peft-config`` file, the planner): far
above any useful rank, low enough that a typo is refused before anything is allocated."""
MAX_PEFT_CONFIG_BYTES = 1 << 20
"""An adapter_config.json is a few KiB; anything this large is the wrong file."""


@dataclass(frozen=True)
class FinetuneConfig:
    """One fine-tuning run (see ``add_arguments`` for the command-line spelling)."""

    data: str
    """A .txt file or JSON Lines (.jsonl) file of documents."""
    output_dir: str
    """Checkpoints (``checkpoints/``), logs (``logs/``), token cache and export go here."""
    model: Optional[str] = None
    """A local Hugging Face directory: config.json + *.safetensors (+ tokenizer files)."""
    model_config: Optional[str] = None
    """A config.json (or a directory with one): random weights, for tests and from-scratch runs."""
    text_field: str = "text"
    seq_len: int = 128
    micro_batch_size: int = 1
    """Sequences per rank per forward/backward."""
    grad_accum: int = 1
    max_steps: int = 100
    """Optimizer steps of the whole run (a resumed run continues up to it)."""
    optimizer: str = "adamw"
    lr: float = 1e-4
    weight_decay: float = 0.0
    lr_schedule: str = "cosine"
    """constant | linear | cosine, after ``warmup_steps`` of linear warmup (DeepSpeed's
    WarmupLR / WarmupDecayLR / WarmupCosineLR: a warmup lasts at least 2 steps)."""
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0
    """Cosine: the final lr as a fraction of ``lr``."""
    grad_clip: float = 1.0
    """Max global gradient norm; 0 disables clipping."""
    stage: int = 2
    offload_optimizer: str = "none"
    offload_params: str = "none"
    nvme_path: Optional[str] = None
    precision: str = "fp32"
    bucket_size_mb: Optional[float] = None
    activation_checkpointing: bool = False
    save_interval: int = 50
    """Save every this many optimizer steps (and at the end, and on preemption)."""
    keep_last: int = 2
    async_save: bool = False
    seed: int = 0
    collective_timeout: float = 300.0
    """Seconds a collective may wait for a peer before this rank gives up (dead-rank detection)."""
    log_interval: int = 1
    progress_bar: Optional[bool] = None
    """None: a bar when stderr is a terminal, plain log lines otherwise."""
    export_dir: Optional[str] = None
    """Hugging Face export of the final weights (default ``<output_dir>/hf``)."""
    export: bool = True
    deepspeed: Optional[str] = None
    """A DeepSpeed JSON config; flags given explicitly override it."""
    lora_r: int = 0
    """LoRA rank (``peft``): 0 fine-tunes every weight; > 0 freezes the base and trains adapters."""
    lora_alpha: Optional[float] = None
    """LoRA scaling numerator (default 2 x ``lora_r``)."""
    lora_targets: Optional[str] = None
    """Comma-separated module names the adapters wrap (default PEFT's "all-linear")."""
    lora_dropout: float = 0.0
    peft_config: Optional[str] = None
    """A JSON file of ``peft.LoraConfig`` arguments (e.g. an ``adapter_config.json``) instead of the --lora-* flags
    (its ``inference_mode``, which PEFT writes as true, is ignored: the adapters train)."""
    redundancy: str = "none"
    """none | peer: commit every step's state to node-local shared memory with a replica on a
    buddy rank; a restart resumes from memory (Note [peer memory tier] in zeroshard/resilience/memory_tier.py)."""
    redundancy_every: Union[int, str] = "auto"
    """With ``redundancy`` peer: commit every this many steps; auto: every step while that costs
    <= 5% of a step, else every K-th (Note [commit pacing] in zeroshard/resilience/commit_pacer.py)."""
    redundancy_path: Optional[str] = None
    """With ``redundancy`` peer: the tier's tmpfs directory (default ``/dev/shm/zeroshard-<run id>``)."""
    redundancy_parity: Optional[int] = None
    """With ``redundancy`` peer: XOR parity over groups of this many ranks instead of a whole
    replica per rank (``PeerRedundancy(parity=g)``, Note [parity memory tier] in zeroshard/resilience/parity.py)."""
    explicit: frozenset = field(default_factory=frozenset)
    """Names of the options given on the command line (for precedence over ``deepspeed``)."""

    def __post_init__(self) -> None:
        if (self.model is None) == (self.model_config is None):
            raise ValueError("give exactly one of --model DIR (pretrained weights) or --model-config PATH "
                             f"(random init); got model={self.model!r}, model_config={self.model_config!r}")
        for name in ("seq_len", "micro_batch_size", "grad_accum", "max_steps", "save_interval", "keep_last",
                     "log_interval"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"--{name.replace('_', '-')}={value!r} must be a positive integer")
        for name in ("lr", "weight_decay", "min_lr_ratio", "grad_clip", "collective_timeout", "bucket_size_mb"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float)) and not isinstance(value, bool)
                                          and math.isfinite(value)):
                raise ValueError(f"--{name.replace('_', '-')}={value!r} must be a finite number")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or not 0 <= self.seed < 2**63:
            raise ValueError(f"--seed={self.seed!r} must be an int in [0, 2**63)")
        if not isinstance(self.warmup_steps, int) or isinstance(self.warmup_steps, bool):
            raise ValueError(f"--warmup-steps={self.warmup_steps!r} must be an int")
        for name in ("data", "output_dir", "text_field"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"--{name.replace('_', '-')}={getattr(self, name)!r} must be a non-empty string")
        if "text_field" in self.explicit and not self.data.endswith(JSON_SUFFIXES):
            raise ValueError(f"--text-field {self.text_field} names a field of JSON documents, but --data "
                             f"{self.data} is read as plain text (not {'/'.join(JSON_SUFFIXES)}); drop "
                             "--text-field or give JSON Lines")
        if isinstance(self.stage, bool) or self.stage not in (0, 1, 2, 3) or not isinstance(self.stage, int):
            raise ValueError(f"--stage={self.stage!r}: use 0, 1, 2 or 3")
        checks = (("lr_schedule", _SCHEDULES), ("precision", _PRECISIONS), ("optimizer", tuple(_OPTIMIZERS)),
                  ("offload_optimizer", _OFFLOAD), ("offload_params", _OFFLOAD))
        for name, allowed in checks:
            if getattr(self, name) not in allowed:
                raise ValueError(f"--{name.replace('_', '-')}={getattr(self, name)!r}: use one of {allowed}")
        if self.warmup_steps < 0 or not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"--warmup-steps={self.warmup_steps} must be >= 0 and --min-lr-ratio="
                             f"{self.min_lr_ratio} within [0, 1]")
        if self.lr_schedule == "cosine" and self.max_steps <= max(2, self.warmup_steps):
            raise ValueError(f"--lr-schedule cosine needs --max-steps ({self.max_steps}) > --warmup-steps "
                             f"(at least 2); use --lr-schedule constant for such a short run")
        if self.lr <= 0 or self.grad_clip < 0 or self.weight_decay < 0:
            raise ValueError(f"--lr={self.lr} must be > 0, --grad-clip={self.grad_clip} and --weight-decay="
                             f"{self.weight_decay} >= 0")
        if self.collective_timeout <= 0 or self.collective_timeout > 7 * 24 * 3600:
            raise ValueError(f"--collective-timeout={self.collective_timeout} must be > 0 seconds (and at most a week)")
        if self.bucket_size_mb is not None and self.bucket_size_mb <= 0:
            raise ValueError(f"--bucket-size-mb={self.bucket_size_mb} must be > 0 (MiB)")
        swaps = self.placement.state_swapped or self.placement.params_swapped
        if swaps and not self.nvme_path:
            raise ValueError("--offload-* nvme needs --nvme-path DIR for the swap files")
        if self.nvme_path and not swaps and not self.deepspeed:
            raise ValueError(f"--nvme-path {self.nvme_path} is only used by NVMe offload; add --offload-optimizer "
                             "nvme, or drop --nvme-path")
        try:  # (what the stage allows is ZeroConfig's rule: Note [one validator] in zeroshard/config.py)
            check_offload(self.stage, *(None if v == "none" else v for v in (self.offload_optimizer, self.offload_params)))
        except ValueError as exc:
            raise ValueError(f"--stage {self.stage} --offload-optimizer {self.offload_optimizer} --offload-params "
                             f"{self.offload_params}: {exc}") from None
        self._check_lora()
        self._check_redundancy()

    def _check_redundancy(self) -> None:
        if self.redundancy not in _REDUNDANCY:
            raise ValueError(f"--redundancy={self.redundancy!r}: use one of {_REDUNDANCY} (peer: each step's state "
                             "in node memory, a restart resumes from it)")
        every = self.redundancy_every
        try:
            pacing(every)
        except ValueError:
            raise ValueError(f"--redundancy-every={every!r} must be 'auto' or a positive integer (1: every step)") from None
        if self.redundancy == "none" and ("redundancy_every" in self.explicit or self.redundancy_path is not None
                                          or self.redundancy_parity is not None):
            raise ValueError("--redundancy-every/--redundancy-path/--redundancy-parity configure the memory tier: add "
                             "--redundancy peer, or drop them")
        g = self.redundancy_parity
        if g is not None and (isinstance(g, bool) or not isinstance(g, int) or g < 2):
            raise ValueError(f"--redundancy-parity={g!r} must be an int >= 2 (the ranks per XOR parity group, dividing "
                             "the world size), or left out for a whole replica per rank")
        if self.redundancy == "peer" and (self.placement.state_swapped or self.placement.params_swapped):
            raise ValueError(f"--redundancy peer keeps the training state in memory; it does not combine with "
                             f"--offload-optimizer {self.offload_optimizer} --offload-params {self.offload_params} "
                             "(NVMe: the state streams from files): use cpu offload or drop --redundancy peer")
        if self.redundancy_path is not None and (not isinstance(self.redundancy_path, str) or not self.redundancy_path):
            raise ValueError(f"--redundancy-path={self.redundancy_path!r} must be a directory (a tmpfs, e.g. /dev/shm/run1)")

    def peer_redundancy(self) -> Optional[PeerRedundancy]:
        """The ZeroOptimizer's ``redundancy=`` of this run (None: off). The run id names the output
        directory, so a rerun of this command finds its own tier and another run's is refused
        (two runs on one node under torchrun's default ``--rdzv-id`` would otherwise share one)."""
        if self.redundancy != "peer":
            return None
        run = hashlib.sha256(os.path.realpath(self.output_dir).encode()).hexdigest()[:16]
        return PeerRedundancy(path=self.redundancy_path, every=self.redundancy_every, run_id=f"finetune-{run}",
                              parity=self.redundancy_parity)

    def redundancy_summary(self) -> Optional[str]:
        """The memory tier of this run in one log line (None: off)."""
        peer = self.peer_redundancy()
        if peer is None:
            return None
        copy = (f"XOR parity over groups of {peer.parity} ranks" if peer.parity is not None
                else "a whole replica on a buddy rank")
        return f"memory tier: {copy}, commit every {getattr(peer.every, 'value', peer.every)} step(s), under {peer.root}"

    def _check_lora(self) -> None:
        if isinstance(self.lora_r, bool) or not isinstance(self.lora_r, int) or not 0 <= self.lora_r <= LORA_R_MAX:
            raise ValueError(f"--lora-r={self.lora_r!r} must be an int in [1, {LORA_R_MAX}] (or 0: no LoRA)")
        if self.lora_alpha is not None and not (isinstance(self.lora_alpha, (int, float)) and self.lora_alpha > 0
                                                and math.isfinite(self.lora_alpha)):
            raise ValueError(f"--lora-alpha={self.lora_alpha!r} must be a positive number")
        if not (isinstance(self.lora_dropout, (int, float)) and 0.0 <= self.lora_dropout < 1.0):
            raise ValueError(f"--lora-dropout={self.lora_dropout!r} must be in [0, 1)")
        if self.lora_targets is not None and not [t for t in self.lora_targets.split(",") if t.strip()]:
            raise ValueError(f"--lora-targets={self.lora_targets!r} names no module; e.g. q_proj,v_proj")
        uses_flags = self.lora_r or self.lora_alpha is not None or self.lora_targets is not None
        if self.peft_config is not None and uses_flags:
            raise ValueError("give either --peft-config FILE or the --lora-* flags, not both")
        if self.lora_r == 0 and (self.lora_alpha is not None or self.lora_targets is not None):
            raise ValueError("--lora-alpha/--lora-targets need --lora-r R > 0")
        if self.peft_config is not None and not os.path.isfile(self.peft_config):
            raise ValueError(f"--peft-config {self.peft_config!r} is not a file")

    @property
    def placement(self) -> Placement:
        """Where ``--offload-optimizer`` / ``--offload-params`` put the state ("none": on the device)."""
        return Placement(None if self.offload_optimizer == "none" else self.offload_optimizer,
                         None if self.offload_params == "none" else self.offload_params)

    @property
    def uses_lora(self) -> bool:
        return self.lora_r > 0 or self.peft_config is not None

    def lora_config(self) -> Any:
        """The ``peft.LoraConfig`` of this run (None without LoRA)."""
        if not self.uses_lora:
            return None
        try:
            from peft import LoraConfig
        except ImportError as exc:
            raise ValueError(f"--lora-r/--peft-config need the peft library (pip install peft): {exc}") from None
        if self.peft_config is not None:
            return peft_file_config(self.peft_config)
        targets = ([t.strip() for t in self.lora_targets.split(",") if t.strip()] if self.lora_targets
                   else "all-linear")
        # (peft annotates lora_alpha as an int, but only divides by it: a float alpha is honoured as given)
        return LoraConfig(r=self.lora_r, lora_alpha=self.lora_alpha or 2 * self.lora_r,  # type: ignore[arg-type]
                          target_modules=targets, lora_dropout=self.lora_dropout)

    # -- DeepSpeed form ----------------------------------------------------------------------
    def as_deepspeed(self) -> dict[str, Any]:
        """These options as a DeepSpeed config (what ``zeroshard.initialize`` reads)."""
        zero: dict[str, Any] = {"stage": self.stage,
                                "offload_optimizer": {"device": self.offload_optimizer},
                                "offload_param": {"device": self.offload_params}}
        if self.nvme_path:
            zero["offload_optimizer"]["nvme_path"] = zero["offload_param"]["nvme_path"] = self.nvme_path
        cfg: dict[str, Any] = {
            "train_micro_batch_size_per_gpu": self.micro_batch_size,
            "gradient_accumulation_steps": self.grad_accum,
            "gradient_clipping": self.grad_clip,
            "zero_optimization": zero,
            "optimizer": {"type": _OPTIMIZERS[self.optimizer],
                          "params": {"lr": self.lr, "weight_decay": self.weight_decay}},
            "bf16": {"enabled": self.precision == "bf16"},
            "fp16": {"enabled": self.precision == "fp16"},
        }
        if self.optimizer == "adam":
            cfg["optimizer"]["params"]["adam_w_mode"] = False  # plain Adam, as the flag says
        warmup = {"warmup_num_steps": self.warmup_steps, "warmup_type": "linear"}
        if self.lr_schedule == "constant" and self.warmup_steps > 0:
            cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": self.lr, **warmup}}
        elif self.lr_schedule == "linear":
            cfg["scheduler"] = {"type": "WarmupDecayLR", "params": {
                "warmup_min_lr": 0.0, "warmup_max_lr": self.lr, "total_num_steps": self.max_steps, **warmup}}
        elif self.lr_schedule == "cosine":
            cfg["scheduler"] = {"type": "WarmupCosineLR", "params": {
                "total_num_steps": self.max_steps, "warmup_min_ratio": 0.0, "cos_min_ratio": self.min_lr_ratio,
                **warmup}}
        if self.bucket_size_mb is not None:
            cfg["zero_optimization"]["reduce_bucket_size"] = int(self.bucket_size_mb * 2**20 / self.param_bytes)
        return cfg

    @property
    def param_bytes(self) -> int:
        return 4 if self.precision == "fp32" else 2

    def overrides(self) -> dict[str, Any]:
        """Explicit flags as ``zeroshard.initialize`` overrides (used with ``--deepspeed``)."""
        names = {"stage": "stage", "lr": "lr", "weight_decay": "weight_decay", "grad_clip": "gradient_clipping",
                 "grad_accum": "gradient_accumulation_steps", "micro_batch_size": "micro_batch_size",
                 "nvme_path": "nvme_path", "bucket_size_mb": "bucket_size_mb"}
        out = {names[k]: getattr(self, k) for k in names if k in self.explicit}
        if "precision" in self.explicit:
            out["mixed_precision"] = None if self.precision == "fp32" else self.precision
        for k in ("offload_optimizer", "offload_params"):
            if k in self.explicit and getattr(self, k) != "none":
                out[k] = getattr(self, k)
        if "max_steps" in self.explicit:
            out["total_num_steps"] = self.max_steps  # keeps the schedule's end at the run's end
        return out

    def auto_values(self) -> dict[str, Any]:
        """What this command line gives a DeepSpeed config's "auto" entries (the Hugging Face
        Trainer's choices: its defaults for Adam's betas and eps)."""
        return {"lr": self.lr, "weight_decay": self.weight_decay, "betas": (0.9, 0.999), "eps": 1e-8,
                "gradient_clipping": self.grad_clip, "gradient_accumulation_steps": self.grad_accum,
                "micro_batch_size": self.micro_batch_size, "total_num_steps": self.max_steps,
                "warmup_num_steps": self.warmup_steps,
                "mixed_precision": None if self.precision == "fp32" else self.precision}

    # -- command line ------------------------------------------------------------------------
    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "FinetuneConfig":
        given = {f.name: getattr(args, f.name) for f in fields(cls)
                 if f.name != "explicit" and getattr(args, f.name, None) is not None}
        return cls(**given, explicit=frozenset(given))


def _every(value: str) -> Union[int, str]:
    """``--redundancy-every``: auto or an int (the range is checked with the other options)."""
    try:
        return int(value)
    except ValueError:
        pass
    try:
        return pacing(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not auto or an integer") from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The command-line options; defaults are None so explicit flags can be told apart."""
    d = FinetuneConfig.__dataclass_fields__
    a = p.add_argument
    a("--model", help="local Hugging Face model directory (config.json + *.safetensors, tokenizer optional)")
    a("--model-config", help="config.json (or a directory holding one) to build a randomly initialised model")
    a("--data", required=True, help="training text: a .txt file or JSON Lines (.jsonl) with a text field")
    a("--text-field", help=f"JSON Lines field holding the text (default {d['text_field'].default!r})")
    a("--output-dir", required=True, help="checkpoints, logs, token cache and export; a rerun resumes from here")
    a("--seq-len", type=int, help=f"tokens per sequence (default {d['seq_len'].default})")
    a("--micro-batch-size", "--per-device-train-batch-size", dest="micro_batch_size", type=int,
      help="sequences per rank per micro-batch (default 1)")
    a("--grad-accum", "--gradient-accumulation-steps", dest="grad_accum", type=int,
      help="micro-batches per optimizer step (default 1)")
    a("--max-steps", type=int, help=f"optimizer steps of the whole run (default {d['max_steps'].default})")
    a("--optimizer", choices=sorted(_OPTIMIZERS), help="default adamw; muon: Muon on the hidden matrices, AdamW on the rest")
    a("--lr", "--learning-rate", dest="lr", type=float, help=f"peak learning rate (default {d['lr'].default})")
    a("--weight-decay", type=float, help="default 0")
    a("--lr-schedule", choices=_SCHEDULES, help="after linear warmup (default cosine)")
    a("--warmup-steps", type=int, help="linear warmup steps (default 0)")
    a("--min-lr-ratio", type=float, help="cosine floor as a fraction of --lr (default 0)")
    a("--grad-clip", "--max-grad-norm", dest="grad_clip", type=float, help="global norm clip, 0 = off (default 1)")
    a("--stage", type=int, choices=(0, 1, 2, 3), help="ZeRO stage (default 2)")
    a("--offload-optimizer", choices=_OFFLOAD, help="where optimizer state lives (default none)")
    a("--offload-params", choices=_OFFLOAD, help="stage 3: where parameter shards live (default none)")
    a("--nvme-path", help="swap directory for nvme offload")
    a("--precision", choices=_PRECISIONS, help="default fp32")
    a("--bf16", dest="precision", action="store_const", const="bf16", help="same as --precision bf16")
    a("--fp16", dest="precision", action="store_const", const="fp16", help="same as --precision fp16")
    a("--bucket-size-mb", type=float, help="gradient bucket size in MiB (default: zeroshard's)")
    a("--activation-checkpointing", "--gradient-checkpointing", dest="activation_checkpointing",
      action="store_const", const=True, help="recompute activations in backward (less memory)")
    a("--save-interval", "--save-steps", dest="save_interval", type=int, help="checkpoint every N steps (default 50)")
    a("--keep-last", "--save-total-limit", dest="keep_last", type=int, help="checkpoints kept (default 2)")
    a("--async-save", action="store_const", const=True, help="write checkpoints in the background")
    a("--seed", type=int, help="default 0")
    a("--collective-timeout", type=float,
      help="seconds a collective waits for a dead or hung peer before this rank exits with status 3; a rank "
           "with no finished step for twice this long exits too (default 300)")
    a("--log-interval", type=int, help="log every N steps (default 1)")
    a("--progress", dest="progress_bar", action="store_const", const=True, help="always show the progress bar")
    a("--no-progress", dest="progress_bar", action="store_const", const=False, help="plain log lines, no bar")
    a("--export-dir", help="Hugging Face export of the final model (default <output-dir>/hf)")
    a("--no-export", dest="export", action="store_const", const=False, help="skip the final export")
    a("--lora-r", type=int, help="LoRA rank: freeze the base and train peft adapters (default 0: full fine-tune)")
    a("--lora-alpha", type=float, help="LoRA alpha (default 2 x --lora-r)")
    a("--lora-targets", help="comma-separated modules to adapt, e.g. q_proj,v_proj (default all linear layers)")
    a("--lora-dropout", type=float, help="dropout on the adapters' input (default 0)")
    a("--peft-config", help="JSON file of peft.LoraConfig arguments, e.g. an adapter_config.json PEFT wrote (its "
                           "inference_mode is ignored: the adapters train)")
    a("--redundancy", choices=_REDUNDANCY,
      help="peer: keep each step's training state in node-local /dev/shm plus a buddy rank's copy, so a run "
           "restarted after a lost rank (torchrun --max-restarts) resumes from memory, not the disk (default none)")
    a("--redundancy-every", type=_every, help="with --redundancy peer: commit every K steps, or auto: every step "
      "while a commit costs <= 5%% of a step, else the smallest K that does (default auto)")
    a("--redundancy-path", help="with --redundancy peer: the tier's tmpfs directory (default "
                                "/dev/shm/zeroshard-finetune-<hash of --output-dir>)")
    a("--redundancy-parity", type=int, metavar="G", help="with --redundancy peer: XOR parity over groups of G ranks "
      "instead of a buddy's whole copy (1/(G-1) of the state per rank; one lost rank per group resumes from memory; "
      "G divides the world size)")
    a("--deepspeed", "--ds-config", dest="deepspeed",
      help="DeepSpeed JSON config (zero_optimization, optimizer, scheduler, fp16/bf16, batch); flags override it")


def parse(argv: Optional[Sequence[str]] = None) -> FinetuneConfig:
    parser = argparse.ArgumentParser(prog="finetune_causal_lm", description=__doc__)
    add_arguments(parser)
    return FinetuneConfig.from_args(parser.parse_args(argv))


def _peft_file_error(path: str, what: str) -> ValueError:
    return ValueError(f"--peft-config {path}: {what}")


def _read_peft_file(path: str) -> dict:
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_PEFT_CONFIG_BYTES + 1)
    except OSError as exc:
        raise _peft_file_error(path, f"cannot read it ({exc.strerror or exc})") from None
    if len(data) > MAX_PEFT_CONFIG_BYTES:
        raise _peft_file_error(path, f"over {MAX_PEFT_CONFIG_BYTES >> 20} MiB: not an adapter_config.json")
    try:
        raw = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise _peft_file_error(path, f"not UTF-8 text (byte {exc.start}); give a JSON file") from None
    except json.JSONDecodeError as exc:
        raise _peft_file_error(path, f"not valid JSON ({exc}); give a JSON object of peft.LoraConfig "
                                     "arguments, e.g. an adapter_config.json") from None
    except RecursionError:
        raise _peft_file_error(path, "nests deeper than an adapter config does") from None
    if not isinstance(raw, dict):
        raise _peft_file_error(path, f"holds a JSON {type(raw).__name__}, not a JSON object of peft.LoraConfig "
                                     "arguments")
    return raw


def _is_rank(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= LORA_R_MAX


def _is_positive(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and value > 0)


def _check_peft_values(path: str, raw: dict) -> None:
    """The fields whose bad values PEFT would take or fail on without naming them."""
    ranks = f"an int in [1, {LORA_R_MAX}]"
    if "peft_type" in raw and raw["peft_type"] not in ("LORA", None):
        raise _peft_file_error(path, f"'peft_type'={raw['peft_type']!r}: only LoRA adapters (\"LORA\") are trained "
                                     "here")
    if "r" in raw and not _is_rank(raw["r"]):
        raise _peft_file_error(path, f"'r'={raw['r']!r} must be {ranks} (the LoRA rank, as --lora-r)")
    if "lora_alpha" in raw and not _is_positive(raw["lora_alpha"]):
        raise _peft_file_error(path, f"'lora_alpha'={raw['lora_alpha']!r} must be a positive finite number")
    dropout = raw.get("lora_dropout", 0.0)
    if not (isinstance(dropout, (int, float)) and not isinstance(dropout, bool) and 0.0 <= dropout < 1.0):
        raise _peft_file_error(path, f"'lora_dropout'={dropout!r} must be a number in [0, 1)")
    targets = raw.get("target_modules")
    if not (targets is None or isinstance(targets, str)
            or (isinstance(targets, list) and all(isinstance(t, str) for t in targets))):
        raise _peft_file_error(path, f"'target_modules'={targets!r} must be a module name, a list of names or "
                                     "\"all-linear\"")
    for name, check, want in (("rank_pattern", _is_rank, ranks), ("alpha_pattern", _is_positive, "a positive number")):
        pattern = raw.get(name)
        if pattern is None:
            continue
        if not isinstance(pattern, dict):
            raise _peft_file_error(path, f"'{name}'={pattern!r} must be an object of module name -> value")
        for key, value in pattern.items():
            if not check(value):
                raise _peft_file_error(path, f"'{name}'[{key!r}]={value!r} must be {want}")


def peft_file_config(path: str) -> Any:
    """The ``peft.LoraConfig`` of a ``--peft-config`` file: LoraConfig's own arguments, as
    ``LoraConfig.save_pretrained`` / ``PeftModel.save_pretrained`` write them (an
    ``adapter_config.json``). Errors name the file and the field."""
    from peft import LoraConfig
    raw = _read_peft_file(path)
    known = set(LoraConfig.__dataclass_fields__)
    unknown = sorted(set(raw) - known)
    if unknown:
        raise _peft_file_error(path, f"{', '.join(repr(k) for k in unknown[:5])} are not peft.LoraConfig "
                                     "arguments")
    _check_peft_values(path, raw)
    # PEFT writes inference_mode=true into every adapter it saves; with it get_peft_model
    # freezes the adapters too. Fine-tuning from such a file means training them: ignored.
    kwargs = {k: v for k, v in raw.items()
              if k not in ("peft_type", "task_type", "base_model_name_or_path", "inference_mode")}
    try:
        return LoraConfig(**kwargs)
    except (TypeError, ValueError) as exc:
        raise _peft_file_error(path, " ".join(str(exc).split())[:400]) from None
