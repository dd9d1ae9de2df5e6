"""What a person watching a run sees: a bar on rank 0, a log file per rank, a summary.

- rank 0 shows a tqdm bar (step, loss, tokens/s, memory) on a terminal, or one plain line
  every ``log_interval`` steps when stderr is not a terminal (a scheduler's log file);
- every rank appends to ``<output>/logs/rank-NNNNN.log`` (events, errors, its own memory);
- rank 0 appends one JSON object per logged step to ``<output>/logs/metrics.jsonl`` and
  writes ``<output>/logs/summary.json`` at the end (also printed).
"""
from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Optional, TextIO

import torch


def memory_bytes() -> int:
    """Peak device memory on GPU; the resident set of this process on CPU."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return int(torch.cuda.max_memory_allocated())
    try:
        import psutil
        return int(psutil.Process().memory_info().rss)
    except ImportError:  # psutil is optional: report 0 rather than fail
        return 0


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    return f"{n:.1f}TiB"


@dataclass
class RunSummary:
    status: str = "running"
    """completed | preempted | failed."""
    start_step: int = 0
    final_step: int = 0
    max_steps: int = 0
    resumed_from: Optional[str] = None
    tokens: int = 0
    """Tokens trained on in this session (all ranks)."""
    seconds: float = 0.0
    tokens_per_s: float = 0.0
    final_loss: Optional[float] = None
    peak_memory_bytes: int = 0
    checkpoints: list = field(default_factory=list)
    exported_to: Optional[str] = None
    message: str = ""


class Progress:
    def __init__(self, output_dir: str, rank: int, max_steps: int, tokens_per_step: int,
                 log_interval: int = 1, bar: Optional[bool] = None) -> None:
        self.rank, self.max_steps, self.tokens_per_step = rank, max_steps, tokens_per_step
        self.log_interval = max(1, log_interval)
        self.log_dir = os.path.join(output_dir, "logs")
        os.makedirs(self.log_dir, exist_ok=True)
        self._log: TextIO = open(os.path.join(self.log_dir, f"rank-{rank:05d}.log"), "a", encoding="utf-8")
        self._metrics: Optional[TextIO] = (open(os.path.join(self.log_dir, "metrics.jsonl"), "a", encoding="utf-8")
                                           if rank == 0 else None)
        self.summary = RunSummary(max_steps=max_steps)
        self._t0 = self._t_last = time.monotonic()
        self._bar = None
        self._use_bar = rank == 0 and (sys.stderr.isatty() if bar is None else bar)

    def start(self, step: int, resumed_from: Optional[str]) -> None:
        """Training begins (after a resume, at ``step``): starts the clocks and the bar."""
        s = self.summary
        s.start_step = s.final_step = step
        s.resumed_from = resumed_from
        self._t0 = self._t_last = time.monotonic()
        if self._use_bar:
            from tqdm import tqdm
            self._bar = tqdm(total=self.max_steps, initial=step, unit="step", dynamic_ncols=True, file=sys.stderr)

    # -- events ------------------------------------------------------------------------------
    def log(self, message: str, echo: bool = False) -> None:
        """A line in this rank's log file; ``echo`` also prints it on rank 0."""
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        self._log.write(f"{stamp} rank {self.rank}: {message}\n")
        self._log.flush()
        if echo and self.rank == 0:
            if self._bar is not None:
                self._bar.write(message, file=sys.stderr)
            else:
                print(message, file=sys.stderr, flush=True)

    def step(self, step: int, loss: float, lr: float, steps_done: int) -> None:
        """After optimizer step ``step``; ``steps_done`` counts this session's steps."""
        now = time.monotonic()
        dt, self._t_last = now - self._t_last, now
        s = self.summary
        s.final_step, s.final_loss = step, loss
        s.tokens = steps_done * self.tokens_per_step
        s.seconds = now - self._t0
        s.tokens_per_s = s.tokens / s.seconds if s.seconds > 0 else 0.0
        mem = memory_bytes()
        s.peak_memory_bytes = max(s.peak_memory_bytes, mem)
        tps = self.tokens_per_step / dt if dt > 0 else 0.0
        if self._bar is not None:
            self._bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tps:,.0f}", mem=_fmt_bytes(mem), refresh=False)
            self._bar.update(1)
        if step % self.log_interval and step != self.max_steps:
            return
        line = f"step {step}/{self.max_steps} loss {loss:.4f} lr {lr:.3g} tok/s {tps:,.0f} mem {_fmt_bytes(mem)}"
        self.log(line, echo=self._bar is None)
        if self._metrics is not None:
            self._metrics.write(json.dumps({"step": step, "loss": loss, "lr": lr, "tokens_per_s": tps,
                                            "memory_bytes": mem, "time": time.time()}) + "\n")
            self._metrics.flush()

    def finish(self, status: str, message: str = "") -> RunSummary:
        s = self.summary
        s.status, s.message = status, message
        s.seconds = time.monotonic() - self._t0
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self.rank == 0:
            with open(os.path.join(self.log_dir, "summary.json"), "w", encoding="utf-8") as f:
                json.dump(asdict(s), f, indent=2)
            loss = f"{s.final_loss:.4f}" if s.final_loss is not None else "-"
            print(f"zeroshard finetune: {status} at step {s.final_step}/{s.max_steps} "
                  f"({s.final_step - s.start_step} steps this run"
                  f"{', resumed from ' + s.resumed_from if s.resumed_from else ''}); final loss {loss}; "
                  f"{s.tokens:,} tokens in {s.seconds:.1f}s ({s.tokens_per_s:,.0f} tok/s); "
                  f"peak memory {_fmt_bytes(s.peak_memory_bytes)} on rank 0; "
                  f"checkpoints {len(s.checkpoints)}{'; exported to ' + s.exported_to if s.exported_to else ''}"
                  f"{'. ' + message if message else ''}", flush=True)
        self.log(f"finished: {status} {message}")
        return s

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        self._log.close()
        if self._metrics is not None:
            self._metrics.close()

    def as_dict(self) -> dict[str, Any]:
        return asdict(self.summary)
