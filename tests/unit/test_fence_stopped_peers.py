"""Note [fencing a stopped peer] (zeroshard/train/failures.py): a survivor SIGKILLs a stopped sibling
only when it is a rank of the same job; a stopped process of anything else its parent runs (a shell's
Ctrl-Z'd job beside ranks started by hand) is left alone."""
from __future__ import annotations

import json
import os
import subprocess
import sys

PARENT = r"""
import json, os, signal, subprocess, sys, time
job = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999", "TORCHELASTIC_RUN_ID": "fence-test"}
def start(extra):
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env={**os.environ, **extra})
peer = start({**job, "RANK": "1"})
other_run = start({**job, "TORCHELASTIC_RUN_ID": "another", "RANK": "1"})
unrelated = start({})
time.sleep(0.3)
for p in (peer, other_run, unrelated):
    os.kill(p.pid, signal.SIGSTOP)
time.sleep(0.2)
out = subprocess.run([sys.executable, "-c", "from zeroshard.train.failures import fence_stopped_peers; "
                      "print(fence_stopped_peers())"], env={**os.environ, **job, "RANK": "0"},
                     capture_output=True, text=True, timeout=60)
fenced = eval(out.stdout.strip().splitlines()[-1]) if out.stdout.strip() else out.stderr
time.sleep(0.2)
alive = {name: p.poll() is None for name, p in (("peer", peer), ("other_run", other_run), ("unrelated", unrelated))}
for p in (peer, other_run, unrelated):
    if p.poll() is None:
        p.kill()
    p.wait()
print(json.dumps({"fenced": fenced, "peer_pid": peer.pid, "alive": alive}))
"""


def test_only_stopped_ranks_of_the_same_job_are_fenced():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    for k in ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "RANK"):
        env.pop(k, None)
    out = subprocess.run([sys.executable, "-c", PARENT], env=env, capture_output=True, text=True, timeout=120)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["fenced"] == [got["peer_pid"]], (got, out.stderr[-2000:])
    assert got["alive"] == {"peer": False, "other_run": True, "unrelated": True}, got
