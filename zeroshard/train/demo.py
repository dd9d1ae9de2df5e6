"""The preemption demo: train -> checkpoint -> kill -> resume -> export, on 2 CPU ranks.

    python -m zeroshard.train.demo [--workdir DIR] [--nproc 2] [--steps 60]

It writes a tiny GPT-2 config and a text corpus, starts ``torchrun --nproc-per-node 2
examples/finetune_causal_lm.py``, sends SIGTERM to the ranks once a few checkpoints exist
(what a scheduler does at preemption), runs the *same* command again (it resumes by
itself), loads the exported model with ``transformers`` and evaluates it on a sample, and
(unless ``--no-compare``) trains the same job without interruption to show that the final
parameters are equal bit for bit. Each phase prints its command and how long it took.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Iterator, Optional, Sequence

WORDS = ("the model learns to predict the next token from the text it has seen so far and each rank "
         "holds only its own shard of the optimizer state while gradients are reduced in buckets "
         "during backward a checkpoint stores every piece once so a preempted job resumes exactly").split()


def write_tiny_gpt2(directory: str, n_embd: int = 64, n_layer: int = 2, n_positions: int = 128) -> str:
    """A GPT-2 config small enough for CPU tests (byte vocabulary + one end-of-text id)."""
    from transformers import GPT2Config
    os.makedirs(directory, exist_ok=True)
    GPT2Config(vocab_size=257, n_positions=n_positions, n_embd=n_embd, n_layer=n_layer, n_head=4,
               bos_token_id=256, eos_token_id=256).save_pretrained(directory)
    return os.path.join(directory, "config.json")


def write_corpus(path: str, documents: int = 200, seed: int = 0) -> str:
    """JSON Lines of pseudo-sentences, deterministic for a seed."""
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(documents):
            words = [rng.choice(WORDS) for _ in range(rng.randint(20, 60))]
            f.write(json.dumps({"text": " ".join(words).capitalize() + "."}) + "\n")
    return path


def finetune_command(nproc: int, model_config: str, data: str, output_dir: str, extra: Sequence[str] = ()) -> list[str]:
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                          "examples", "finetune_causal_lm.py")
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port",
            str(_free_port()), script, "--model-config", model_config, "--data", data, "--output-dir", output_dir,
            *extra]


def _free_port() -> int:
    from zeroshard.testing.launch import free_port
    return free_port()


def _children(pid: int) -> list[int]:
    try:
        import psutil
        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except Exception:  # noqa: BLE001 - psutil missing or the process is gone
        return []


def _latest_step(output_dir: str) -> int:
    import zeroshard
    latest = zeroshard.latest_checkpoint(os.path.join(output_dir, "checkpoints"))
    return int(os.path.basename(latest).split("-")[1]) if latest else 0


def run_demo(workdir: str, nproc: int = 2, steps: int = 200, kill_after_step: int = 80, compare: bool = True) -> dict:
    os.makedirs(workdir, exist_ok=True)
    config = write_tiny_gpt2(os.path.join(workdir, "tiny-gpt2"))
    data = write_corpus(os.path.join(workdir, "corpus.jsonl"))
    out = os.path.join(workdir, "run")
    for stale in (out, os.path.join(workdir, "uninterrupted")):  # the demo's own outputs of an earlier run
        shutil.rmtree(stale, ignore_errors=True)
    args = ["--max-steps", str(steps), "--save-interval", "20", "--keep-last", "2", "--seq-len", "64",
            "--micro-batch-size", "4", "--lr", "3e-3", "--warmup-steps", "10", "--log-interval", "20",
            "--no-progress", "--collective-timeout", "60"]
    cmd = finetune_command(nproc, config, data, out, args)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    figures: dict = {}
    from zeroshard.ops._loader import REGISTRY
    REGISTRY.cpu()  # compiled here on a first run (progress lines), so the ranks find it cached
    print("$ " + shlex.join(cmd), flush=True)

    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, env=env)
    while proc.poll() is None and _latest_step(out) < kill_after_step:
        time.sleep(0.5)
    workers = _children(proc.pid)
    print(f"\n--- SIGTERM to the {len(workers)} ranks after step {_latest_step(out)} was checkpointed ---", flush=True)
    # Signalled itself, torchrun forwards SIGTERM to the ranks (they save and exit 0) but then
    # exits 1 with a traceback; signalling the ranks keeps the demo's output readable.
    for pid in workers:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    proc.wait(timeout=300)
    figures["first_run_s"] = round(time.monotonic() - t0, 1)
    figures["preempted_at_step"] = _latest_step(out)
    print(f"--- first run exited ({proc.returncode}) after {figures['first_run_s']}s; newest checkpoint: step "
          f"{figures['preempted_at_step']} ---\n\n$ (same command again)", flush=True)

    t1 = time.monotonic()
    subprocess.run(cmd, env=env, check=True)
    figures["resume_run_s"] = round(time.monotonic() - t1, 1)

    from transformers import AutoConfig, AutoModelForCausalLM
    import torch
    hf = os.path.join(out, "hf")
    trained = AutoModelForCausalLM.from_pretrained(hf).eval()
    torch.manual_seed(0)
    untrained = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(hf)).eval()
    sample = torch.tensor([list(" ".join(WORDS[:40]).encode())[:64]])
    with torch.no_grad():
        losses = [m(input_ids=sample, labels=sample).loss.item() for m in (untrained, trained)]
    figures["eval_loss_untrained_vs_exported"] = [round(x, 3) for x in losses]
    with open(os.path.join(out, "logs", "summary.json")) as f:
        summary = json.load(f)
    print(f"\n--- exported model {hf} loads with transformers: loss on a sample {losses[1]:.3f} "
          f"(an untrained model of the same config: {losses[0]:.3f})")
    if compare:
        ref = os.path.join(workdir, "uninterrupted")
        print("\n$ (the same job without interruption, for comparison)", flush=True)
        _run_quietly_with_progress(finetune_command(nproc, config, data, ref, args), env, ref, steps)
        diff = bitwise_diff(load_exported(hf), load_exported(os.path.join(ref, "hf")))
        figures["bitwise_equal_to_uninterrupted"] = not diff
    figures["total_s"] = round(time.monotonic() - t0, 1)
    loss = summary["final_loss"]
    print(f"--- demo: {json.dumps(figures)}; final summary: step {summary['final_step']}, loss "
          f"{'-' if loss is None else format(loss, '.3f')}, resumed from {summary['resumed_from']}")
    return figures


def _run_quietly_with_progress(cmd: list[str], env: dict, output_dir: str, steps: int,
                               every_s: float = 10.0) -> None:
    """Runs ``cmd`` with its output hidden, printing a line every ``every_s`` seconds so the
    terminal never sits silent for the length of a training run."""
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while True:
            try:
                proc.wait(timeout=every_s)
                break
            except subprocess.TimeoutExpired:
                print(f"    ... {time.monotonic() - t0:.0f} s, checkpointed step {_latest_step(output_dir)} "
                      f"of {steps}", flush=True)
    finally:
        if proc.poll() is None:  # interrupted (Ctrl-C): do not leave the job running
            proc.kill()
            proc.wait()
    if proc.returncode:
        raise subprocess.CalledProcessError(proc.returncode, cmd)


def load_exported(hf_dir: str) -> dict:
    """Every tensor of a Hugging Face safetensors directory, by name."""
    from safetensors.torch import load_file
    return {k: v for f in sorted(os.listdir(hf_dir)) if f.endswith(".safetensors")
            for k, v in load_file(os.path.join(hf_dir, f)).items()}


def bitwise_diff(a: dict, b: dict) -> list[str]:
    """Names whose bytes differ between two tensor dicts (or that only one has)."""
    import torch
    diff = sorted(set(a) ^ set(b))
    for k in sorted(set(a) & set(b)):
        x, y = a[k].contiguous(), b[k].contiguous()
        if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x.view(-1).view(torch.uint8),
                                                                       y.view(-1).view(torch.uint8)):
            diff.append(k)
    return diff


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", help="where to write, kept afterwards (default: a temporary directory, removed "
                                     "at the end)")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--no-compare", dest="compare", action="store_false",
                   help="skip the uninterrupted run that checks the resumed weights bit for bit")
    a = p.parse_args(argv)
    with demo_dir(a.workdir) as where:
        run_demo(where, a.nproc, a.steps, min(80, a.steps // 2), a.compare)
    return 0


@contextlib.contextmanager
def demo_dir(given: Optional[str]) -> Iterator[str]:
    """``given``, kept; or a temporary directory, removed afterwards (also on failure)."""
    if given:
        yield given
        return
    where = tempfile.mkdtemp(prefix="zeroshard-demo-")
    try:
        yield where
    finally:
        shutil.rmtree(where, ignore_errors=True)
        print(f"demo: removed its temporary directory {where} (--workdir DIR keeps the files)", flush=True)


if __name__ == "__main__":
    sys.exit(main())
