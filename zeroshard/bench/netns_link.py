"""``SlowLink``: "nodes" on one machine as Linux network namespaces joined by a shaped link,
for ``zeroshard bench link`` (docs/design.md, "A slow link on one machine").

Two nodes are joined by one veth pair; more by one veth each to a bridge in a hub namespace.
Every node's end is called ``IFNAME`` (what ``GLOO_SOCKET_IFNAME`` names) and holds
``10.77.0.<node + 1>/24``, a private address that exists only inside the namespace. The link is
shaped on each node's egress with ``tc``: ``tbf`` for a rate alone, ``netem`` for a delay (with
its own rate); traffic between two processes of one namespace goes over its loopback, unshaped,
like the links inside a node.

Note [netns leftovers]: what a run makes is removed by ``close``, which runs on leaving the
``with`` block (an exception or Ctrl-C included), on SIGTERM and SIGHUP (the handlers turn them
into ``SystemExit`` so the block unwinds) and at interpreter exit. A run killed outright
(SIGKILL, a crash of the interpreter) leaves its namespaces behind; their names carry the
creating process's id (``zsnet-<pid>-<node>``), so the next run removes those whose creator is
gone, together with any process still inside them, and leaves a concurrent live run's alone.
Deleting a namespace removes its veth ends and their peers; the processes inside are ended
first by their ids (``ip netns pids``), as deleting the name would leave them running. A delay
line (Note [delay line] in netns_delay_line.py) runs outside the namespaces and ends with its
standard input, i.e. with the harness however it ends; its TAP devices go with it.
"""
from __future__ import annotations

import atexit
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from types import FrameType
from typing import IO, Callable, Optional, Sequence, Union

PREFIX = "zsnet-"
IFNAME = "zslink"
SUBNET = "10.77.0"
_DELAY_LINE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "netns_delay_line.py")
_NAME = re.compile(rf"^{re.escape(PREFIX)}(\d+)-(\w+)$")
_Handler = Union[Callable[[int, Optional[FrameType]], object], int, None]
_Stream = Optional[Union[int, IO[str], IO[bytes]]]


@dataclass(frozen=True)
class LinkSpec:
    """The shape of the link between nodes: ``rate_gbit`` 0 leaves it unshaped (veth speed),
    ``delay_ms`` is added to every packet leaving a node (one way; a round trip gets twice)."""

    nodes: int = 2
    rate_gbit: float = 0.0
    delay_ms: float = 0.0

    def __post_init__(self) -> None:
        if isinstance(self.nodes, bool) or not isinstance(self.nodes, int) or not 2 <= self.nodes <= 200:
            raise ValueError(f"LinkSpec(nodes={self.nodes!r}): use an integer from 2 to 200 (one address each "
                             f"in {SUBNET}.0/24)")
        for name, value in (("rate_gbit", self.rate_gbit), ("delay_ms", self.delay_ms)):
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value < 1e4:
                raise ValueError(f"LinkSpec({name}={value!r}): use a number from 0 (unshaped) up")

    def describe(self) -> str:
        rate = f"{self.rate_gbit:g} Gbit/s" if self.rate_gbit else "unshaped"
        return f"{rate}, +{self.delay_ms:g} ms" if self.delay_ms else rate

    def qdisc(self) -> list[str]:
        """The ``tc qdisc replace ... root`` arguments after ``root``: what shapes one egress."""
        if self.delay_ms:
            rate = ["rate", f"{self.rate_gbit * 1000:g}mbit"] if self.rate_gbit else []
            return ["netem", "delay", f"{self.delay_ms * 1000:.0f}us", *rate, "limit", "100000"]
        if self.rate_gbit:
            bytes_per_s = self.rate_gbit * 1e9 / 8
            # A burst of 1 ms of traffic, at least one 64 KiB GSO packet (a smaller one splits
            # every veth super-packet); 50 ms of queue before drops.
            burst = max(64 * 1024 + 4096, int(bytes_per_s / 1000))
            return ["tbf", "rate", f"{self.rate_gbit * 1000:g}mbit", "burst", str(burst), "latency", "50ms"]
        return ["pfifo_fast"]


def unavailable() -> Optional[str]:
    """Why namespaces cannot be made here (not root, no ``ip``), or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root (this process's effective uid is not 0)"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "the `ip` and `tc` commands (iproute2) are not on PATH"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"`ip netns list` failed: {probe.stderr.strip()}"
    return None


_netem: Optional[bool] = None


def netem_available() -> bool:
    """Whether this kernel has the netem qdisc (tried once, on the loopback of a scratch namespace)."""
    global _netem
    if _netem is None:
        name = f"{PREFIX}{os.getpid()}-probe"
        _run(["ip", "netns", "add", name])
        try:
            _netem = _run(["tc", "-n", name, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"],
                          check=False).returncode == 0
        finally:
            _run(["ip", "netns", "delete", name], check=False)
    return _netem


def _run(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def namespaces() -> list[str]:
    """The names ``ip netns list`` shows (each line: a name, maybe followed by an id)."""
    return [line.split()[0] for line in _run(["ip", "netns", "list"]).stdout.splitlines() if line.strip()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_namespace(name: str) -> None:
    """End the processes inside ``name`` by their ids, then delete it (its veths go with it)."""
    pids = _run(["ip", "netns", "pids", name], check=False).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    _run(["ip", "netns", "delete", name], check=False)


def clean_leftovers() -> list[str]:
    """Remove the namespaces of runs whose creating process is gone (Note [netns leftovers])."""
    removed = []
    for name in namespaces():
        m = _NAME.match(name)
        if m and not _alive(int(m.group(1))):
            remove_namespace(name)
            removed.append(name)
    return removed


class SlowLink:
    """The namespaces of one run and the shaped link between them; a context manager.

    ``popen(node, argv)`` starts a process inside a node (its own session, so ``close`` can end
    it with its children); ``shape(spec)`` changes the rate and delay in place. ``delay_line``:
    carry the link through a user-space delay line (two TAP devices, Note [delay line]) instead
    of a veth pair, for delays on a kernel without netem; None: when ``spec`` has a delay and
    the kernel no netem."""

    def __init__(self, spec: LinkSpec, delay_line: Optional[bool] = None) -> None:
        self.spec = spec
        self.delay_line = delay_line
        self._relay: Optional[subprocess.Popen] = None
        pid = os.getpid()
        self.names = [f"{PREFIX}{pid}-{i}" for i in range(spec.nodes)]
        self.hub = f"{PREFIX}{pid}-hub" if spec.nodes > 2 else None
        self.processes: list[subprocess.Popen] = []
        self._made: list[str] = []
        self._handlers: dict[int, _Handler] = {}
        self._closed = False

    def address(self, node: int) -> str:
        return f"{SUBNET}.{node + 1}"

    def __enter__(self) -> "SlowLink":
        clean_leftovers()
        self._install_handlers()
        atexit.register(self.close)
        try:
            if self.delay_line is None:
                self.delay_line = bool(self.spec.delay_ms) and not netem_available()
            if self.delay_line and self.spec.nodes != 2:
                raise ValueError(f"a delay line joins 2 nodes, not {self.spec.nodes}: without netem, delays "
                                 "need --nodes 2")
            self._create()
            self.shape(self.spec)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _create(self) -> None:
        taken = set(namespaces())
        for name in self.names + ([self.hub] if self.hub else []):
            if name in taken:  # this very process made it (an earlier link not closed): not ours to reuse
                raise RuntimeError(f"network namespace {name} exists already; close the other SlowLink of "
                                   "this process first")
            _run(["ip", "netns", "add", name])
            self._made.append(name)
            _run(["ip", "-n", name, "link", "set", "lo", "up"])  # traffic inside a node goes over it
        if self.delay_line:
            self._start_delay_line()
        elif self.hub is None:
            _run(["ip", "link", "add", IFNAME, "netns", self.names[0], "type", "veth", "peer", "name", IFNAME,
                  "netns", self.names[1]])
        else:
            _run(["ip", "-n", self.hub, "link", "add", "zsbr", "type", "bridge"])
            _run(["ip", "-n", self.hub, "link", "set", "zsbr", "up"])
            for i, name in enumerate(self.names):
                _run(["ip", "link", "add", IFNAME, "netns", name, "type", "veth", "peer", "name", f"p{i}",
                      "netns", self.hub])
                _run(["ip", "-n", self.hub, "link", "set", f"p{i}", "master", "zsbr"])
                _run(["ip", "-n", self.hub, "link", "set", f"p{i}", "up"])
        for i, name in enumerate(self.names):
            _run(["ip", "-n", name, "addr", "add", f"{self.address(i)}/24", "dev", IFNAME])
            _run(["ip", "-n", name, "link", "set", IFNAME, "up"])

    def _start_delay_line(self) -> None:
        """Two TAPs made by the delay line outside the namespaces, moved in and named ``IFNAME``."""
        taps = [f"zs{os.getpid()}t{i}" for i in range(2)]
        relay = subprocess.Popen([sys.executable, _DELAY_LINE, *taps, "0"], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        self.processes.append(relay)
        self._relay = relay
        if relay.stdout is None or relay.stdout.readline().strip() != "ready":
            relay.wait(timeout=10)
            why = relay.stderr.read().strip()[-2000:] if relay.stderr is not None else ""
            raise RuntimeError(f"the delay line did not start (exit {relay.returncode}): {why}")
        for tap, name in zip(taps, self.names):
            _run(["ip", "link", "set", tap, "netns", name])
            _run(["ip", "-n", name, "link", "set", tap, "name", IFNAME])
            _run(["ip", "-n", name, "link", "set", IFNAME, "mtu", "65000"])

    def shape(self, spec: LinkSpec) -> None:
        """Rate and delay of every node's egress (``spec.nodes`` must be this link's)."""
        if spec.nodes != self.spec.nodes:
            raise ValueError(f"shape({spec}) on a link of {self.spec.nodes} nodes: nodes must stay the same")
        qdisc = spec.qdisc()
        if self._relay is not None and self._relay.stdin is not None:  # it holds the frames; tc shapes the rate
            self._relay.stdin.write(f"{spec.delay_ms}\n")
            self._relay.stdin.flush()
            qdisc = LinkSpec(spec.nodes, spec.rate_gbit).qdisc()
        for name in self.names:
            argv = ["tc", "-n", name, "qdisc", "replace", "dev", IFNAME, "root", *qdisc]
            proc = _run(argv, check=False)
            if proc.returncode != 0 and spec.delay_ms and "unknown" in proc.stderr.lower():
                raise RuntimeError(f"tc refused the netem qdisc ({proc.stderr.strip()}): this kernel was built "
                                   "without CONFIG_NET_SCH_NETEM, so no qdisc can add a delay; build the link "
                                   "with SlowLink(..., delay_line=True) (bench link does when a delay is asked) "
                                   "or use --delays 0 (rates alone are shaped with tbf)")
            if proc.returncode != 0:
                raise RuntimeError(f"`{' '.join(argv)}` failed ({proc.returncode}): {proc.stderr.strip()}")
        self.spec = spec

    def popen(self, node: int, argv: Sequence[str], *, env: Optional[dict[str, str]] = None,
              cwd: Optional[str] = None, stdout: _Stream = None, stderr: _Stream = None) -> subprocess.Popen:
        proc = subprocess.Popen(["ip", "netns", "exec", self.names[node], *argv], start_new_session=True, env=env,
                                cwd=cwd, stdout=stdout, stderr=stderr)
        self.processes.append(proc)
        return proc

    def run(self, node: int, argv: Sequence[str], timeout: float) -> subprocess.CompletedProcess:
        return subprocess.run(["ip", "netns", "exec", self.names[node], *argv], capture_output=True, text=True,
                              timeout=timeout)

    def stop_processes(self) -> None:
        """End what ``popen`` started, with its children: SIGTERM, then SIGKILL after 5 s."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            live = [p for p in self.processes if p.poll() is None]
            for p in live:
                try:
                    os.killpg(p.pid, sig)  # (start_new_session: the group's id is the leader's pid)
                except ProcessLookupError:
                    pass
            for p in live:
                try:
                    p.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    pass
        self.processes = [p for p in self.processes if p.poll() is None]

    def close(self) -> None:
        """Idempotent: the processes, then the namespaces (with their links), then the handlers."""
        if self._closed:
            return
        self._closed = True
        try:
            self.stop_processes()
            if self._relay is not None:
                for pipe in (self._relay.stdin, self._relay.stdout, self._relay.stderr):
                    if pipe is not None:
                        pipe.close()
        finally:
            for name in reversed(self._made):
                remove_namespace(name)
            self._made = []
            self._restore_handlers()
            atexit.unregister(self.close)

    def _install_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # (signal handlers can only be set there; atexit and __exit__ still clean up)
        for sig in (signal.SIGTERM, signal.SIGHUP):
            self._handlers[sig] = signal.signal(sig, _raise_exit)

    def _restore_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, handler in self._handlers.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        self._handlers = {}


def _raise_exit(signum: int, frame: Optional[FrameType]) -> None:
    raise SystemExit(128 + signum)
