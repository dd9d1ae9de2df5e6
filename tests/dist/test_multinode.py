"""Beyond one machine: two torchrun launchers on this machine act as two nodes
(``--nnodes 2 --node-rank 0|1 --nproc-per-node 2``, c10d rendezvous on 127.0.0.1), 4 gloo
ranks in all, running the fine-tuning entry point: training, checkpoints, preemption of a rank
on the second node and resume, a rank killed on the second node and restart, each ending on
the uninterrupted two-node run's parameters bit for bit."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.support import finetune_helpers as fh
from zeroshard.testing.launch import free_port


def two_nodes(ws: fh.Workspace, output: str, fault: str | None = None) -> list[subprocess.CompletedProcess]:
    endpoint = f"127.0.0.1:{free_port()}"
    procs = []
    for node in range(2):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
               "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
               "--rdzv-id", "zeroshard-test", "--local-addr", "127.0.0.1", fh.SCRIPT, *fh.args(ws, output)]
        e = fh.env(fault)
        procs.append(subprocess.Popen(cmd, cwd=fh.REPO, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    out = []
    for p in procs:
        try:
            stdout, stderr = p.communicate(timeout=fh.TIMEOUT)
        except subprocess.TimeoutExpired:
            p.kill()
            stdout, stderr = p.communicate()
        out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    return out


def _summary(output: str) -> dict:
    with open(os.path.join(output, "logs", "summary.json")) as f:
        return json.load(f)


def _describe(procs: list[subprocess.CompletedProcess]) -> str:
    return "\n".join(f"=== node {i} ===\n{fh.describe(p)}" for i, p in enumerate(procs))


@pytest.fixture(scope="module")
def ws(tmp_path_factory) -> fh.Workspace:
    return fh.make_workspace(str(tmp_path_factory.mktemp("multinode")))


@pytest.fixture(scope="module")
def reference(ws):
    out = ws.out("reference")
    procs = two_nodes(ws, out)
    assert all(p.returncode == 0 for p in procs), _describe(procs)
    text = "".join(p.stdout + p.stderr for p in procs)
    assert "4 rank(s)" in text, _describe(procs)  # one job across both launchers
    return fh.exported(out)


def test_preempted_rank_on_second_node_saves_and_rerun_resumes_bitwise(ws, reference):
    out = ws.out("preempted")
    first = two_nodes(ws, out, fault="sigterm@3:5")  # rank 3 lives on node 1
    assert all(p.returncode == 0 for p in first), _describe(first)
    assert _summary(out)["status"] == "preempted" and _summary(out)["final_step"] == 5, _summary(out)
    second = two_nodes(ws, out)
    assert all(p.returncode == 0 for p in second), _describe(second)
    summary = _summary(out)
    assert summary["status"] == "completed" and summary["resumed_from"].endswith("step-00000005"), summary
    assert fh.bitwise_diff(fh.exported(out), reference) == []


def test_rank_killed_on_second_node_stops_the_job_and_restart_resumes(ws, reference):
    out = ws.out("dead")
    first = two_nodes(ws, out, fault="sigkill@3:5")
    assert all(p.returncode != 0 for p in first), _describe(first)
    text = "".join(p.stdout + p.stderr for p in first)
    assert "another rank died" in text and "step-00000003" in text, _describe(first)
    second = two_nodes(ws, out)
    assert all(p.returncode == 0 for p in second), _describe(second)
    assert _summary(out)["resumed_from"].endswith("step-00000003"), _summary(out)
    assert fh.bitwise_diff(fh.exported(out), reference) == []


def test_two_launchers_equal_one_launcher_of_four_ranks_bitwise(ws, reference):
    """The same job from one torchrun with 4 processes: the two-node run's parameters bit for bit."""
    out = ws.out("one-launcher")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-port", str(free_port()),
           fh.SCRIPT, *fh.args(ws, out)]
    proc = subprocess.run(cmd, cwd=fh.REPO, env=fh.env(), capture_output=True, text=True, timeout=fh.TIMEOUT)
    assert proc.returncode == 0, fh.describe(proc)
    assert fh.bitwise_diff(fh.exported(out), reference) == []
