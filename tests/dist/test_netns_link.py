"""The slow-link harness of ``zeroshard bench link`` (zeroshard/bench/netns_link.py): network
namespaces joined by a shaped veth, one torchrun launcher in each, and their removal on every
way out (Note [netns leftovers]). Root only: skipped where namespaces cannot be made.

- a 2 x 1 world trains a step across two namespaces with the rate applied (flat stage 3, and
  flat under ``--zero-kwargs`` bf16, which moves fewer bytes: the kwargs reach ZeroOptimizer): the measured bulk
  rate is the asked one, the step takes at least the time its counted inter-node bytes need
  at that rate; a delay on the veth needs the netem qdisc: applied when the kernel has it, else
  refused naming the kernel option and the delay line; everything is gone after the ``with`` block;
- the delay line (two TAPs and a process between them, for kernels without netem) delays each
  direction by the asked time, keeps the rate and leaves no device or process behind;
- three namespaces meet on a bridge in a hub namespace, rate applied, all removed after;
- a run killed outright leaves its namespaces (and a process in one) behind; the next start
  removes them and keeps those of a live run, which SIGTERM then removes.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from zeroshard.bench.netns_link import (PREFIX, LinkSpec, SlowLink, clean_leftovers, namespaces, netem_available,
                                        unavailable)

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=f"slow-link harness: {unavailable()}")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RATE_GBIT = 0.1


def test_two_namespaces_train_a_step_over_the_shaped_link_and_are_removed(tmp_path):
    from zeroshard.bench.netns_bench import LinkBench, configurations, run_job
    from zeroshard.bench.netns_launch import probe

    bench = LinkBench(model={"name": "tiny"}, configs=configurations(["bf16=flat"], '{"mixed_precision": "bf16"}'),
                      nodes=2, per_node=1, steps=1, rounds=1, global_batch=2, timeout_s=120)
    with SlowLink(LinkSpec(2, rate_gbit=RATE_GBIT)) as link:
        assert set(link.names) <= set(namespaces())
        shaped = probe(link, nbytes=2 << 20, pings=5)
        ranks = run_job(link, bench, str(tmp_path / "job"))
        if netem_available():
            link.shape(LinkSpec(2, rate_gbit=1.0, delay_ms=2.0))
            delayed = probe(link, nbytes=1 << 20, pings=5)
            assert delayed["rtt_ms"] >= 2 * 2.0 * 0.9, delayed  # (each direction delayed)
        else:  # a veth cannot be delayed without netem: refused, naming why and the way out
            with pytest.raises(RuntimeError, match="CONFIG_NET_SCH_NETEM.*delay_line=True"):
                link.shape(LinkSpec(2, rate_gbit=1.0, delay_ms=2.0))
        link.shape(LinkSpec(2))
        unshaped = probe(link, nbytes=2 << 20, pings=5)
    left = set(namespaces())
    assert not left & set(link.names), left
    assert all(p.poll() is not None for p in link.processes)

    assert 0.8 * RATE_GBIT <= shaped["gbit_s"] <= 1.1 * RATE_GBIT, shaped
    assert unshaped["gbit_s"] > 3 * RATE_GBIT, unshaped  # the shaping, not the machine, set the rate
    assert [r["rank"] for r in ranks] == [0, 1] and {r["node"] for r in ranks} == {0, 1}, ranks
    flat = [r["configs"]["flat"] for r in ranks]
    assert all(len(f["times"]) == 1 and f["losses"][-1] == f["losses"][-1] for f in flat), flat  # (not NaN)
    # each rank sends half of every 2-rank gather / reduce-scatter buffer over its own egress
    wire_s = flat[0]["inter_node"] / 2 * 8 / (RATE_GBIT * 1e9)
    assert flat[0]["inter_node"] > 0 and max(f["times"][0] for f in flat) >= 0.8 * wire_s, (flat, wire_s)
    # --zero-kwargs reached ZeroOptimizer: bf16 gathers move half the parameter bytes
    bf16 = ranks[0]["configs"]["bf16"]
    assert 0 < bf16["inter_node"] < flat[0]["inter_node"] and bf16["losses"][-1] == bf16["losses"][-1], bf16


def test_the_delay_line_delays_each_direction_keeps_the_rate_and_leaves_nothing():
    """Note [delay line]: the link through two TAPs and a user-space delay, for kernels without netem."""
    from zeroshard.bench.netns_launch import probe

    with SlowLink(LinkSpec(2, rate_gbit=RATE_GBIT, delay_ms=1.0), delay_line=True) as link:
        delayed = probe(link, nbytes=1 << 20, pings=20)
        link.shape(LinkSpec(2, rate_gbit=RATE_GBIT))
        undelayed = probe(link, nbytes=1 << 20, pings=20)
        relay = link.processes[0]
    assert delayed["rtt_ms"] >= 2 * 1.0 * 0.9 and undelayed["rtt_ms"] < delayed["rtt_ms"] - 1.0, (delayed, undelayed)
    assert 0.7 * RATE_GBIT <= delayed["gbit_s"] <= 1.1 * RATE_GBIT, delayed
    assert relay.poll() is not None and not set(namespaces()) & set(link.names)
    taps = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    assert f"zs{os.getpid()}t" not in taps, taps  # (the TAPs went with the delay line)


# (netns_link.py imports the standard library only: loaded by path, the holder starts without torch)
_HOLD = """
import importlib.util, sys, time
spec = importlib.util.spec_from_file_location("netns_link", sys.argv[1])
m = sys.modules["netns_link"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(m)
with m.SlowLink(m.LinkSpec(2, rate_gbit=1.0)) as link:
    link.popen(0, ["sleep", "120"])
    print(" ".join(link.names), flush=True)
    time.sleep(120)
"""


def _holder() -> tuple[subprocess.Popen, list[str]]:
    path = os.path.join(REPO, "zeroshard", "bench", "netns_link.py")
    proc = subprocess.Popen([sys.executable, "-c", _HOLD, path], stdout=subprocess.PIPE, text=True, cwd=REPO)
    assert proc.stdout is not None
    return proc, proc.stdout.readline().split()


def test_a_killed_runs_namespaces_are_removed_at_the_next_start_and_a_live_runs_kept():
    (killed, killed_names), (live, live_names) = _holder(), _holder()
    try:
        assert len(killed_names) == 2 and len(live_names) == 2 and all(n.startswith(PREFIX) for n in killed_names)
        inside = subprocess.run(["ip", "netns", "pids", killed_names[0]], capture_output=True, text=True).stdout.split()
        assert inside, "the holder's process inside node 0"
        killed.kill()
        killed.wait()
        assert set(killed_names) <= set(namespaces())  # SIGKILL: nothing could clean up
        removed = clean_leftovers()
        assert set(killed_names) <= set(removed) and not set(removed) & set(live_names), removed
        now = set(namespaces())
        assert not now & set(killed_names) and set(live_names) <= now, now
        time.sleep(0.2)
        assert not any(os.path.exists(f"/proc/{pid}") and open(f"/proc/{pid}/stat").read().split()[2] != "Z"
                       for pid in inside), inside
        live.send_signal(signal.SIGTERM)  # the handler unwinds the with block
        assert live.wait(timeout=30) == 128 + signal.SIGTERM
        assert not set(namespaces()) & set(live_names)
    finally:
        for p in (killed, live):
            if p.poll() is None:
                p.kill()
                p.wait()
        clean_leftovers()


def test_three_namespaces_meet_on_a_bridge_with_the_rate_applied_and_are_removed():
    from zeroshard.bench.netns_launch import probe

    with SlowLink(LinkSpec(3, rate_gbit=RATE_GBIT)) as link:
        assert link.hub is not None and set(link.names + [link.hub]) <= set(namespaces())
        shaped = probe(link, nbytes=1 << 20, pings=3)
        ping = link.run(0, [sys.executable, "-c", "import socket; s = socket.socket(); s.settimeout(5); "
                            f"print(s.connect_ex(('{link.address(2)}', 9)))"], timeout=30)
    assert 0.8 * RATE_GBIT <= shaped["gbit_s"] <= 1.1 * RATE_GBIT, shaped
    assert ping.stdout.strip() == "111", ping  # ECONNREFUSED: node 2 answered across the bridge
    assert not set(namespaces()) & set(link.names + [link.hub])
