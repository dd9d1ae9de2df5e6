"""The Hugging Face Trainer, Accelerate and Lightning with a ZeroOptimizer (issue 14), with the
real libraries: stages 0, 2, 3 at 1 process and 2, 3 at 2 processes (torchrun, gloo), on the GPT-2
of tests/support/dropin_worker.py, each against the same library with torch.optim.AdamW
(tests/support/integrations_worker.py runs every cell of a world size in one launch).

Bounds: fp32, clipping that bites on every step (max norm 0.05, gradient norms ~1). Final weights
within 1e-5 of the reference, as the largest difference over the model's largest weight (per
tensor, attention key biases are not comparable: their true gradient is zero and Adam turns any
implementation's rounding noise into full-size steps); logged grad norm and learning rate within
1e-5 relative; save at step 3 through the library, resume in a fresh run: final weights equal the
uninterrupted run's bit for bit. A rank-0-only torch.save(optimizer.state_dict()) is refused at
save time with the fix."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.support.dist_results import selected_params, together

pytest.importorskip("accelerate")
pytest.importorskip("lightning")
pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(ROOT, "tests", "support", "integrations_worker.py")
LIBS = ("trainer", "accelerate", "lightning")
STAGES = {1: (0, 2, 3), 2: (2, 3)}
CELLS = [(lib, s, w) for w in (1, 2) for lib in LIBS for s in STAGES[w]]


def _launch(world: int, directory: str) -> list[dict]:
    out = os.path.join(directory, "res")
    args = [WORKER, out, directory, ",".join(LIBS), ",".join(map(str, STAGES[world]))]
    if world > 1:
        from zeroshard.testing.launch import free_port
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world),
               "--master-addr", "127.0.0.1", "--master-port", str(free_port()), *args]
    else:
        cmd = [sys.executable, *args]
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=directory, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-6000:])
    return [json.load(open(f"{out}.rank{r}")) for r in range(world)]


@pytest.fixture(scope="module")
def results(request, tmp_path_factory) -> dict[int, list[dict]]:
    """Every selected world's launch, side by side (Note [launches side by side] in tests/support/dist_results.py)."""
    worlds = selected_params(request, "world", (1, 2))
    if 2 not in worlds and any(i.path == request.path and i.name == "test_rank0_only_save_is_refused_at_save_time"
                               for i in request.session.items):
        worlds.append(2)  # (it reads world 2's refusals)
    dirs = {w: str(tmp_path_factory.mktemp(f"integ{w}")) for w in worlds}
    return together({w: (lambda w=w: _launch(w, dirs[w])) for w in worlds})


@pytest.mark.parametrize("lib,stage,world", CELLS, ids=[f"{l}-stage{s}-world{w}" for l, s, w in CELLS])
def test_library_trains_like_adamw_and_resumes_exactly(results, lib, stage, world):
    for rank, res in enumerate(results[world]):
        cell = res[f"{lib}-stage{stage}"]
        assert "error" not in cell, cell.get("trace", cell)
        assert cell["clipped"], cell["ref_grad_norms"]
        assert cell["moved"] > 1e-2, cell
        assert cell["weight_rel"] < 1e-5, (rank, cell)
        assert cell["grad_norm_rel"] < 1e-5, (rank, cell["grad_norms"], cell["ref_grad_norms"])
        assert cell["lr_rel"] < 1e-12, (rank, cell)
        assert cell["resume_rel"] == 0.0, (rank, cell)


def test_rank0_only_save_is_refused_at_save_time(results):
    for res in results[2]:
        assert res["refusal"] == {lib: "refused" for lib in LIBS}, res["refusal"]
