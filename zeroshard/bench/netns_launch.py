"""Jobs across the nodes of a ``SlowLink``: one torchrun launcher per namespace (c10d
rendezvous on node 0's link address), and the link probe (netns_probe.py) between nodes 0 and 1.

Each launcher runs ``--nnodes N --nproc-per-node P`` with ``--local-addr`` its node's address
(all namespaces share the machine's hostname, which resolves outside them) and
``GLOO_SOCKET_IFNAME`` the link, so every rank's gloo pairs use the link's addresses: pairs in
one namespace meet on its loopback, pairs across namespaces cross the shaped link."""
from __future__ import annotations

import glob
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Sequence

from zeroshard.bench.netns_link import IFNAME, SlowLink

RDZV_PORT = 29400
PROBE_PORT = 29500
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _tail(path: str, chars: int = 3000) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-chars:]
    except OSError:
        return "(no log)"


def launch(link: SlowLink, nproc: int, module: str, args: Sequence[str], out_dir: str, timeout_s: float,
           run_id: str = "job") -> list[dict]:
    """Run ``python -m module *args`` as ``nodes x nproc`` ranks, one launcher per namespace;
    each rank writes ``out_dir/rank<R>.json``. Returns them in rank order, or raises with the
    logs' tails when a launcher fails or the job outlives ``timeout_s``."""
    os.makedirs(out_dir, exist_ok=True)
    for old in glob.glob(os.path.join(out_dir, "rank*.json")):
        os.remove(old)
    env = dict(os.environ, GLOO_SOCKET_IFNAME=IFNAME, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
               PYTHONPATH=os.pathsep.join(p for p in (_REPO, os.environ.get("PYTHONPATH", "")) if p))
    procs, logs = [], []
    endpoint = f"{link.address(0)}:{RDZV_PORT}"
    for node in range(link.spec.nodes):
        argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(link.spec.nodes),
                "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
                "--rdzv-id", run_id, "--rdzv-conf", f"is_host={int(node == 0)}", "--local-addr", link.address(node),
                "--max-restarts", "0", "--monitor-interval", "0.2", "-m", module, *args]
        log = os.path.join(out_dir, f"node{node}.log")
        logs.append(log)
        with open(log, "w") as f:
            procs.append(link.popen(node, argv, env=dict(env, ZS_NETNS_NODE=str(node)), stdout=f,
                                    stderr=subprocess.STDOUT, cwd=_REPO))
    deadline = time.monotonic() + timeout_s
    try:
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{module} across {link.spec.nodes} namespaces outlived {timeout_s:.0f} s")
            if any(p.poll() not in (None, 0) for p in procs):  # one failed: the others would wait for it
                break
            time.sleep(0.1)
        codes = [p.poll() for p in procs]
        if codes != [0] * len(procs):
            raise RuntimeError(f"launchers exited {codes}")
    except RuntimeError as exc:
        link.stop_processes()
        tails = "\n".join(f"=== node {i} ===\n{_tail(log)}" for i, log in enumerate(logs))
        raise RuntimeError(f"{exc}\n{tails}") from None
    ranks = []
    for path in sorted(glob.glob(os.path.join(out_dir, "rank*.json")), key=lambda p: int(p.rsplit("rank", 1)[1][:-5])):
        with open(path) as f:
            ranks.append(json.load(f))
    if len(ranks) != link.spec.nodes * nproc:
        raise RuntimeError(f"{len(ranks)} rank results in {out_dir}, expected {link.spec.nodes * nproc}")
    return ranks


def probe(link: SlowLink, nbytes: int = 8 << 20, pings: int = 20, timeout_s: float = 60) -> dict:
    """Round trip and bulk throughput from node 0 to node 1 over the link as shaped now:
    ``{"rtt_ms": median, "bulk_s": seconds, "gbit_s": achieved rate}`` (the bulk time less one
    round trip, so the delay does not count against the rate)."""
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "netns_probe.py")
    server = link.popen(1, [sys.executable, script, "serve", link.address(1), str(PROBE_PORT)],
                        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        sent = link.run(0, [sys.executable, script, "send", link.address(1), str(PROBE_PORT), str(pings),
                            str(nbytes)], timeout=timeout_s)
        if sent.returncode != 0:
            raise RuntimeError(f"link probe failed: {sent.stderr.strip()[-2000:]}")
        server.wait(timeout=timeout_s)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
        if server.stderr is not None:
            server.stderr.close()
        link.processes.remove(server)
    r = json.loads(sent.stdout)
    rtt = statistics.median(r["rtt_s"])
    return {"rtt_ms": rtt * 1e3, "bulk_s": r["bulk_s"], "bytes": nbytes,
            "gbit_s": nbytes * 8 / max(1e-9, r["bulk_s"] - rtt) / 1e9}
