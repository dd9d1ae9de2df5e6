"""``InProcessRecovery``: survivors of a lost rank keep their processes, re-form the process
group at the smaller world and go on from the memory tiers (issue 45, item 4). Lifecycle:
built -> ``start`` (joins generation 0 of the group, builds the training objects, resumes) ->
``run(step_fn)`` per step (on a lost peer: the step in flight is abandoned, the survivors agree
on who is alive, re-form the group, rebuild and recover) -> ``close``.

Note [in-process recovery]:
Torch's own pieces only: a ``TCPStore`` hosted outside the workers (by the launching parent,
as torchrun's agent hosts its store), a ``PrefixStore`` per generation of the process group,
gloo's errors and timeouts, ``destroy_process_group``/``init_process_group`` and the existing
memory-tier recovery through ``zeroshard.load_checkpoint`` (Note [peer memory tier] in
zeroshard/resilience/memory_tier.py). The protocol, generation g (g recoveries done so far):

- Detection. A SIGKILLed peer closes its sockets: the collective in flight on a survivor
  raises at once (gloo's "connection closed/reset by peer"), and a rank whose collective
  fails closes its own connections of that group, so survivors waiting on survivors raise
  too. A peer that does not answer (SIGSTOP, a hang) is detected by the group's timeout
  (``timeout_s``: the collectives', and the memory tier's side group's through
  ``ZEROSHARD_PG_TIMEOUT``, which ``start`` sets unless it is set, as ``zeroshard finetune``
  does). The failure may also
  surface in the memory tier's commit thread; the next ``memory_checkpoint`` raises it.
  Only a peer's failure counts (``is_peer_failure`` in failures.py: gloo's errors, timeouts):
  any other error of the step (a shape mismatch, an out-of-memory, Ctrl-C) is raised to the
  caller at once, as without this class; a rank that ends on it is lost to the others like a
  crashed one. (Before, every RuntimeError started a recovery, so a bug that raised on every
  rank was rebuilt and retried ``max_recoveries`` times before it surfaced.)
- Membership. Who decides is the store, first writer wins. Each member (identified by its
  rank in generation 0, stable across generations) has a heartbeat thread adding to its
  counter in the store every ``heartbeat_s``; it also writes its host identity (boot id and PID
  namespace) and PID. A rank that failed destroys its process group
  (its connections close, which ends its peers' waits) and writes ``g<g>/joined/<member>``;
  it waits until every member of generation g has joined, or is lost: on this host, its
  process is gone (no /proc entry, or a zombie: a SIGKILL is seen at once); anywhere, its
  heartbeat counter has not moved for ``dead_after_s`` (killed, stopped, or its node gone;
  5 s by default: a heartbeat thread of a live member under heavy CPU load was once not seen
  for 2 s, and a live member left out leaves), or it has not joined within ``timeout_s`` of
  this rank's join (alive but hung). Then it proposes the
  joined members with ``compare_set`` on ``g<g>/members``: the first proposal is the
  decision, every rank adopts it, and a rank not in it (it joined too late) raises instead
  of training on. New ranks are the members' order; the group of generation g+1 is
  initialised on ``PrefixStore("<prefix>/g<g+1>/pg", store)``.
  A group's connections close only when its last reference goes (``destroy_process_group``
  and ``shutdown`` leave them open while the optimizer holds the group: tried), so the failed
  rank drops its objects, and the exception's frames that hold them, and the disk saves'
  cached side groups of that world (``forget_side_groups``), and collects them at once:
  a survivor waiting on it rather than on the dead peer fails then (before this, one bench
  round waited for the 120 s collective timeout; with 4 members a survivor waiting on a live
  one in a save's side group waited out ``timeout_s``, and was left out, before the side
  groups were dropped; a later save makes the new world's side group: tested).
- Rebuild and recovery. ``build(rank, world)`` makes the model, ``ZeroOptimizer`` (with
  ``redundancy=PeerRedundancy(...)``: the same tier path and run id), scheduler and data
  loader anew at the new world (the typed engine is built whole, never patched); then
  ``zeroshard.load_checkpoint(root, ...)`` tries the memory tiers first (the N -> M reshard
  fed from memory, no disk read) and the disk otherwise, as a restarted job does. The step
  in flight is lost, and the step before it when its commit had not finished on every
  rank (Note [peer memory tier]); ``run`` returns False and ``step`` is the recovered one.
  At another world size the RNG is not restored (as a disk resume's): ``build`` seeds it
  as a fresh process would. A loss during the recovery itself (its new group, build or
  restore raise) starts the next generation's round the same way; ``recoveries`` keeps one
  record for the failure, its ``lost`` counted from the members before it and ``rounds``
  (tested: 4 members, the second lost inside the piece exchange of the first round; the
  tiers on one node still cover the state, so the second round recovers from memory).
  ``RecoveryFailed`` (left out, the store gone, ``max_recoveries`` spent) ends the worker.
  The old objects are dropped once their tier's commit thread ended (it fails on the dead
  peer at once; on a stopped one at the side group's timeout, ``ZEROSHARD_PG_TIMEOUT``): the
  wait is bounded by ``timeout_s``, past which the recovery goes on and that thread may still
  stamp or clear its own older slots when it ends (the recovery reads stamped slots only).
- The store host. The store outlives any worker, so losing rank 0 is like losing any rank.
  When the store's host itself is gone, nothing can agree: the heartbeats stop, and the
  recovery raises ``RecoveryFailed`` naming the store (the store client's broken pipe: under
  a second in the test, bounded by ``timeout_s`` where the host does not answer); the job
  restarts the way it would without this (torchrun and the memory tiers, which outlive the
  processes and are left as they were: tested, the tier report's slots all valid).
"""
from __future__ import annotations

import datetime
import gc
import json
import os
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Optional

import torch.distributed as dist
from torch import nn

from zeroshard.checkpoint import load_checkpoint
from zeroshard.checkpoint.checkpoint_errors import CheckpointError
from zeroshard.checkpoint.memory_commit import memory_checkpoint
from zeroshard.checkpoint.saver import forget_side_groups
from zeroshard.train.failures import is_peer_failure

if TYPE_CHECKING:
    from zeroshard.optim.zero_optimizer import ZeroOptimizer
    from zeroshard.resilience.memory_tier import MemoryTier


class RecoveryFailed(RuntimeError):
    """The survivors cannot go on in their processes (left out, the store gone, too many
    recoveries): the job restarts as it would without in-process recovery."""


def _host_identity() -> Optional[str]:
    """This boot of this machine and this PID namespace: members that share it can tell each
    other's death from the process table; None where that cannot be read."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            return f"{f.read().strip()}/{os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return None


def _gone(pid: int) -> bool:
    """Whether process ``pid`` (of this host identity) is dead: no entry, or a zombie."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return True


def _settle(tier: "MemoryTier") -> None:
    """Waits for a broken generation's commit thread; its error is the failure's, seen from there."""
    try:
        tier.wait()
    except RuntimeError:
        pass


@dataclass(frozen=True)
class InProcessOptions:
    """Where the store is and how long to wait (Note [in-process recovery])."""

    host: str
    """The store's host: a ``TCPStore`` server run outside the workers (the launcher's)."""
    port: int
    timeout_s: float = 60.0
    """A collective that does not complete within it fails (a stopped or hung peer); also how
    long a survivor waits for a live member to join a recovery."""
    dead_after_s: float = 5.0
    """A member whose heartbeat did not move for this long is lost (killed or stopped). A
    member on this host (same boot and PID namespace) whose process is gone is lost at once."""
    heartbeat_s: float = 0.1
    max_recoveries: int = 8
    prefix: str = "zeroshard/in-process"
    """The key space in the store (one per job)."""

    def __post_init__(self) -> None:
        if not isinstance(self.host, str) or not self.host:
            raise ValueError(f"InProcessOptions(host={self.host!r}) must name the store's host")
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 < self.port < 65536:
            raise ValueError(f"InProcessOptions(port={self.port!r}) must be a TCP port (1..65535)")
        for name in ("timeout_s", "dead_after_s", "heartbeat_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
                raise ValueError(f"InProcessOptions({name}={v!r}) must be a number of seconds > 0")
        if self.heartbeat_s * 3 > self.dead_after_s:
            raise ValueError(f"InProcessOptions(heartbeat_s={self.heartbeat_s}) must be at most a third of "
                             f"dead_after_s={self.dead_after_s}: a live member would look lost")
        if isinstance(self.max_recoveries, bool) or not isinstance(self.max_recoveries, int) or self.max_recoveries < 0:
            raise ValueError(f"InProcessOptions(max_recoveries={self.max_recoveries!r}) must be an int >= 0")


@dataclass
class Trainee:
    """What ``build`` returns and ``load_checkpoint`` restores: the training loop's objects."""

    model: nn.Module
    optimizer: "ZeroOptimizer"
    """Built with ``redundancy=PeerRedundancy(...)`` (the same path and run id every time)."""
    scheduler: object = None
    dataloader: object = None
    extra: dict = field(default_factory=dict)
    """Anything else the loop wants rebuilt with them (not restored)."""


class InProcessRecovery:
    """Runs a training loop's steps so that the survivors of a lost rank re-form the group in
    their processes and go on from the memory tiers (Note [in-process recovery])."""

    def __init__(self, options: InProcessOptions, *, rank: int, world_size: int,
                 build: Callable[[int, int], Trainee], root: str) -> None:
        if not isinstance(options, InProcessOptions):
            raise TypeError(f"options must be an InProcessOptions, got {type(options).__name__}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} must be in [0, world_size={world_size})")
        self.options, self.build, self.root = options, build, root
        self.member = rank
        """This process's rank in generation 0: its name in the store for the whole job."""
        self.members: list[int] = list(range(world_size))
        """The members of the current generation, in their rank order."""
        self.generation = 0
        self.step = 0
        """The next step to run (the steps done, as committed)."""
        self.objects: Optional[Trainee] = None
        self.recoveries: list[dict] = []
        """One record per recovery: generation, lost members, new world size, recovered step, its
        source, the error, when it began (``at``, wall clock) and its seconds: in all, agreeing
        (includes the old tier's thread ending), the new group, ``build`` and the restore (of its
        last round: ``rounds`` > 1 when a loss during a round started another)."""
        self._store: Optional[dist.TCPStore] = None
        self._beat: Optional[threading.Thread] = None
        self._stop = threading.Event()
        self._rounds = 0
        """Recovery rounds begun (``max_recoveries`` bounds them, completed or not)."""

    # -- lifecycle ---------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self.members.index(self.member)

    @property
    def world_size(self) -> int:
        return len(self.members)

    def start(self) -> Trainee:
        """Connects to the store, starts the heartbeat, joins generation 0 of the group, builds
        the objects and resumes them (memory tiers first, then the disk; none: step 0)."""
        # (the side groups the memory tier and the saver make read it: as `zeroshard finetune` does)
        os.environ.setdefault("ZEROSHARD_PG_TIMEOUT", str(self.options.timeout_s))
        self._store = self._connect()
        self._store.set(self._key("proc", self.member), json.dumps({"host": _host_identity(), "pid": os.getpid()}))
        self._beat = threading.Thread(target=self._heartbeat, args=(self._connect(),), daemon=True,
                                      name="zeroshard-heartbeat")
        self._beat.start()
        self._init_group()
        self.objects = self._build()
        try:
            self.step = int(self._load(self.objects)["step"])
        except CheckpointError:
            self.step = 0
        return self.objects

    def run(self, step_fn: Callable[[Trainee, int], None]) -> bool:
        """Runs ``step_fn(objects, step)`` (forward, backward, ``opt.step()``, ``sched.step()``)
        and commits the step to the memory tier. True when the step completed (``step`` moved
        on); False after a recovery (``objects`` are new, ``step`` is the recovered one)."""
        t = self.objects
        if t is None:
            raise RuntimeError("InProcessRecovery.run before start()")
        failure: Optional[RuntimeError] = None
        try:
            step_fn(t, self.step)
            memory_checkpoint(self.step + 1, model=t.model, optimizer=t.optimizer, scheduler=t.scheduler,
                              dataloader=t.dataloader)
        except RuntimeError as exc:  # (kept without its traceback: its frames hold the old objects)
            if not is_peer_failure(exc):
                raise  # (the step's own error, a shape mismatch or an out-of-memory: not a lost rank)
            failure = RuntimeError(f"{type(exc).__name__}: {exc}")
        if failure is None:
            self.step += 1
            return True
        del t
        before, rounds = list(self.members), self._rounds
        while True:
            try:
                self._recover(failure)
                # (one record for the rounds this failure took: lost since the step failed)
                self.recoveries[-1].update(lost=[m for m in before if m not in self.members],
                                           rounds=self._rounds - rounds)
                return False
            except RecoveryFailed:
                raise
            except RuntimeError as again:  # (a loss during the recovery: the next generation's round)
                failure = RuntimeError(f"{type(again).__name__}: {again}")

    def close(self) -> None:
        """Waits for the last commit, stops the heartbeat, leaves the group."""
        tier = self.objects.optimizer.engine.memory_tier if self.objects is not None else None
        if tier is not None:
            tier.wait()
        self._stop.set()
        if self._beat is not None:
            self._beat.join()
        if dist.is_initialized():
            dist.destroy_process_group()

    # -- the protocol --------------------------------------------------------------------------
    def _connect(self) -> dist.TCPStore:
        o = self.options
        try:
            return dist.TCPStore(o.host, o.port, is_master=False, wait_for_workers=False,
                                 timeout=datetime.timedelta(seconds=o.timeout_s))
        except (RuntimeError, OSError) as exc:
            raise RuntimeError(f"in-process recovery: the store at {o.host}:{o.port} cannot be reached ({exc}); "
                               "it must run outside the workers (Note [in-process recovery])") from exc

    def _key(self, *parts: object) -> str:
        return "/".join([self.options.prefix, *map(str, parts)])

    def _heartbeat(self, store: dist.TCPStore) -> None:
        key = self._key("beat", self.member)
        while not self._stop.wait(self.options.heartbeat_s):
            try:
                store.add(key, 1)
            except (RuntimeError, OSError):  # (the store host is gone: the members see it themselves)
                return

    def _init_group(self) -> None:
        store = self._store
        if store is None:
            raise RuntimeError("in-process recovery: no store (start() first)")
        dist.init_process_group("gloo", store=dist.PrefixStore(self._key(f"g{self.generation}", "pg"), store),
                                rank=self.rank, world_size=self.world_size,
                                timeout=datetime.timedelta(seconds=self.options.timeout_s))

    def _build(self) -> Trainee:
        t = self.build(self.rank, self.world_size)
        if not isinstance(t, Trainee):
            raise TypeError(f"build(rank, world_size) must return a zeroshard.Trainee, got {type(t).__name__}")
        if getattr(getattr(t.optimizer, "engine", None), "memory_tier", None) is None:
            raise ValueError("InProcessRecovery needs the ZeroOptimizer built with redundancy='peer' or "
                             "zeroshard.PeerRedundancy(...) (the survivors recover from the memory tiers)")
        return t

    def _load(self, t: Trainee) -> dict:
        return load_checkpoint(self.root, model=t.model, optimizer=t.optimizer, scheduler=t.scheduler,
                               dataloader=t.dataloader)

    def _recover(self, exc: RuntimeError) -> None:
        o, store = self.options, self._store
        if store is None:
            raise RecoveryFailed("in-process recovery: no store (start() first)") from exc
        if self._rounds >= o.max_recoveries:
            raise RecoveryFailed(f"in-process recovery: {o.max_recoveries} recovery rounds done, not another") from exc
        self._rounds += 1
        at, t0 = time.time(), time.monotonic()
        # Our connections of the broken group close here, which ends the peers' waits on us;
        # the old objects go, once their tier's commit thread ended (failed on the dead peer, or
        # timed out on a stopped one): it must not write into the slots the recovery reads.
        tier = self.objects.optimizer.engine.memory_tier if self.objects is not None else None
        self.objects = None
        forget_side_groups()  # (the saves' side groups of the old world hold its connections too)
        if dist.is_initialized():
            dist.destroy_process_group()
        # A group's connections close only when its last reference goes (neither destroy nor
        # shutdown closes them): a peer waiting on this rank in a collective (not on the dead
        # one) fails only then, so the old objects are collected now, the tier after its thread.
        gc.collect()
        if tier is not None:  # (bounded: a thread waiting on a stopped peer ends at the side group's timeout)
            waiter = threading.Thread(target=_settle, args=(tier,), daemon=True, name="zeroshard-old-tier")
            waiter.start()
            waiter.join(o.timeout_s)
            del waiter
        del tier
        gc.collect()
        try:
            members = self._agree(store)
        except (RuntimeError, OSError) as err:
            raise RecoveryFailed(f"in-process recovery of generation {self.generation} failed: the store at "
                               f"{o.host}:{o.port} did not answer ({err}); the step failed with: {exc}") from exc
        t1 = time.monotonic()
        lost = [m for m in self.members if m not in members]
        if self.member not in members:
            raise RecoveryFailed(f"in-process recovery: member {self.member} joined generation {self.generation}'s "
                               f"recovery after the survivors {members} decided without it; it leaves") from exc
        self.members, self.generation = members, self.generation + 1
        self._init_group()
        t2 = time.monotonic()
        self.objects = self._build()
        t3 = time.monotonic()
        info = self._load(self.objects)
        self.step = int(info["step"])
        t4 = time.monotonic()
        self.recoveries.append({"generation": self.generation, "lost": lost, "world_size": self.world_size,
                                "step": self.step, "source": info.get("source"), "error": str(exc)[:200],
                                "at": at, "seconds": t4 - t0, "agree_s": t1 - t0, "group_s": t2 - t1,
                                "build_s": t3 - t2, "restore_s": t4 - t3})
        print(f"[zeroshard] in-process recovery: member {self.member} is rank {self.rank} of {self.world_size} "
              f"(lost {lost}); resumed step {self.step} from {info.get('source') or 'disk'}", flush=True)

    def _agree(self, store: dist.TCPStore) -> list[int]:
        """The members of the next generation, decided by the first proposal (see the Note)."""
        o, g = self.options, self.generation
        store.set(self._key(f"g{g}", "joined", self.member), str(os.getpid()))
        others = [m for m in self.members if m != self.member]
        beats = {m: (self._beats(store, m), time.monotonic()) for m in others}
        here = _host_identity()
        procs = {m: json.loads(store.get(self._key("proc", m))) for m in others}
        local = {m: int(p["pid"]) for m, p in procs.items() if here is not None and p.get("host") == here}
        joined_at = time.monotonic()
        decided = self._key(f"g{g}", "members")
        while True:
            if store.check([decided]):
                break
            joined, waiting = [self.member], []
            for m in others:
                if store.check([self._key(f"g{g}", "joined", m)]):
                    joined.append(m)
                    continue
                if m in local and _gone(local[m]):
                    continue  # its process is gone: no need to wait for its heartbeat to go stale
                n, since = beats[m]
                now = time.monotonic()
                count = self._beats(store, m)
                if count != n:
                    beats[m] = (count, now)
                elif now - since >= o.dead_after_s:
                    continue  # killed or stopped
                if now - joined_at < o.timeout_s:
                    waiting.append(m)
            if not waiting:
                store.compare_set(decided, "", json.dumps(sorted(joined)))
                break
            time.sleep(min(0.02, o.heartbeat_s))
        return [int(m) for m in json.loads(store.get(decided))]

    def _beats(self, store: dist.TCPStore, member: int) -> int:
        return int(store.add(self._key("beat", member), 0))
