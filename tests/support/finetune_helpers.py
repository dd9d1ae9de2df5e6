"""Launching the fine-tuning example from tests: torchrun, or plain processes per rank.

``torchrun`` is what users run; plain processes (``launch_ranks``) are for the dead-rank
test, where torchrun's agent would itself stop the survivors and hide what they do alone.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from zeroshard.testing.launch import free_port
from zeroshard.train.demo import bitwise_diff, load_exported, write_corpus, write_tiny_gpt2  # noqa: F401 (tests use fh.bitwise_diff)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "examples", "finetune_causal_lm.py")
TIMEOUT = 300  # generous: CI machines are shared; a healthy run takes ~20 s

# Every run of the tests trains the same job: 10 steps of 2 ranks x 2 sequences x 2
# accumulation, checkpoints every 3 steps, dropout on (so RNG restore matters).
STEPS = 10
FLAGS = ("--max-steps", str(STEPS), "--save-interval", "3", "--keep-last", "2", "--seq-len", "32",
         "--micro-batch-size", "2", "--grad-accum", "2", "--lr", "1e-3", "--warmup-steps", "2",
         "--lr-schedule", "cosine", "--min-lr-ratio", "0.1", "--grad-clip", "1.0", "--stage", "2",
         "--no-progress", "--collective-timeout", "30")

DS_EQUIVALENT = {  # the same run as FLAGS, as a DeepSpeed config
    "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
    "zero_optimization": {"stage": 2, "overlap_comm": True, "contiguous_gradients": True},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0}},
    "scheduler": {"type": "WarmupCosineLR", "params": {
        "total_num_steps": STEPS, "warmup_num_steps": 2, "warmup_type": "linear", "warmup_min_ratio": 0.0,
        "cos_min_ratio": 0.1}},
    "bf16": {"enabled": False},
}


@dataclass(frozen=True)
class Workspace:
    root: str
    model_config: str
    data: str

    def out(self, name: str) -> str:
        return os.path.join(self.root, name)


def make_workspace(root: str) -> Workspace:
    config = write_tiny_gpt2(os.path.join(root, "tiny-gpt2"), n_embd=32, n_layer=2, n_positions=32)
    data = write_corpus(os.path.join(root, "corpus.jsonl"), documents=8)
    return Workspace(root, config, data)


def env(fault: Optional[str] = None) -> dict:
    e = {k: v for k, v in os.environ.items() if k != "ZEROSHARD_FAULT"}
    e.update(OMP_NUM_THREADS="1", PYTHONPATH=REPO + os.pathsep + e.get("PYTHONPATH", ""))
    if fault:
        e["ZEROSHARD_FAULT"] = fault
    return e


def args(ws: Workspace, output: str, extra: Sequence[str] = (), flags: Sequence[str] = FLAGS) -> list[str]:
    return ["--model-config", ws.model_config, "--data", ws.data, "--output-dir", output, *flags, *extra]


def torchrun(ws: Workspace, output: str, extra: Sequence[str] = (), fault: Optional[str] = None,
             torchrun_args: Sequence[str] = (), flags: Sequence[str] = FLAGS) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
           str(free_port()), *torchrun_args, SCRIPT, *args(ws, output, extra, flags)]
    return subprocess.run(cmd, cwd=REPO, env=env(fault), capture_output=True, text=True, timeout=TIMEOUT)


@dataclass
class RankResult:
    returncode: int
    output: str
    exited_at: float


def launch_ranks(ws: Workspace, output: str, fault: Optional[str] = None,
                 extra: Sequence[str] = ()) -> list[RankResult]:
    """The ranks as plain processes with torchrun's environment; records when each exits."""
    port = str(free_port())
    procs = []
    for rank in range(2):
        e = env(fault)
        e.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                 LOCAL_WORLD_SIZE="2")
        procs.append(subprocess.Popen([sys.executable, SCRIPT, *args(ws, output, extra)], cwd=REPO, env=e,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    exited: dict[int, float] = {}
    deadline = time.monotonic() + TIMEOUT
    while len(exited) < len(procs) and time.monotonic() < deadline:
        for i, p in enumerate(procs):
            if i not in exited and p.poll() is not None:
                exited[i] = time.monotonic()
        time.sleep(0.05)
    results = []
    for i, p in enumerate(procs):
        if p.poll() is None:  # a hang: the test fails on the return code, not by blocking CI
            p.kill()
        out, _ = p.communicate()
        results.append(RankResult(p.returncode, out, exited.get(i, float("inf"))))
    return results


def exported(output: str) -> dict[str, torch.Tensor]:
    return load_exported(os.path.join(output, "hf"))


def describe(proc: subprocess.CompletedProcess) -> str:
    return f"exit {proc.returncode}\n--- stdout ---\n{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-4000:]}"
