"""Bitwise after a SIGKILL inside a step (issue 45, Note [kill points] in zeroshard/testing/kill_points.py):
world 4 on loopback as two torchrun launchers ("two nodes", ``--nproc-per-node 2`` each, c10d
rendezvous, each with its own tmpfs directory for the memory tier), ``redundancy="peer"``
committing every step. For each configuration (stage 1, 2, 3; stage 2 with ``offload_optimizer="cpu"``):

- a reference job runs uninterrupted at world 4 and saves every step k to disk (``ref/step-k``);
- per kill point (forward, reduce_scatter, optimizer_step mid-way, replica_copy mid-way, a
  disk save), a job whose rank ``--kill-rank`` SIGKILLs itself at that point of step
  ``--kill-step`` (``ZEROSHARD_TEST_KILL_AT``), and then, by ``--lose``:

  - ``node`` (the default, the issue's case): the whole of node B goes with it, in the same
    instant (``kill_points.ON_KILL``): its torchrun agent and its other worker are SIGKILLed and
    its tier directory is deleted (the node's memory is gone). Node A's launcher
    (``--nnodes 1:2``, ``--max-restarts 1``, short rendezvous timeouts) re-forms at world 2
    alone; its restarted workers resume through ``load_checkpoint`` from node A's tier alone
    (its own slots and the replicas of node B's ranks, which the ring over nodes put there),
    resharding 4 -> 2, and train to ``--steps``; then, in the same processes, the reference's
    disk checkpoint of the step the memory gave back is resumed at world 2 and trained as far.
    Node B's launcher starts first with ``--nnodes 2:2`` (it waits for node A's store and can
    never start alone) and ``--local-addr 127.0.0.2``, so node A (127.0.0.1) is ranks 0-1
    whatever the agents' pids.
  - ``process``: only the process dies; torchrun (``--nnodes 2``, ``--max-restarts 1``)
    restarts every worker on both nodes, which resume from the tiers at world 4 (both nodes'
    memory stays), then the reference resumed at world 4.

  Weights, fp32 masters, moments and step counts are compared with ``torch.equal``.
- ``--scale-up`` instead: node A alone at world 2 commits step ``--kill-step`` and waits; node B
  (an empty tier) joins, the launcher restarts both at world 4, which go on from node A's tier;
  against the uninterrupted world-2 run's disk save of that step resumed at world 4.

Per cell: bitwise, the step recovered, completed steps lost (the newest step the optimizer
finished before the kill, minus the step recovered: the step in flight and a commit still in
flight are lost by design, Note [peer memory tier]), disk bytes the recovery opened (files under
the disk roots, counted by an audit hook), the path (memory/disk, world sizes), and the wall
from the kill to the restarted workers' start (the launcher's rendezvous and spawn, ``import torch``), to their
``load_checkpoint`` returning, and to their first step completed. Every launcher has a timeout;
every worker dumps its threads' stacks (faulthandler) and exits if it runs past ``--hang-after``.

    python benchmarks/bench_peer_kill_points.py [--lose node|process | --scale-up] [--configs s1,s2,s3,s2-offload]
        [--points forward,reduce_scatter,optimizer_step,replica_copy,save] [--steps 5 --kill-step 3] [--pg-timeout 60]
"""
from __future__ import annotations

import argparse
import datetime
import faulthandler
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid

import torch

NTH = {"forward": 1, "reduce_scatter": 2, "optimizer_step": 1, "replica_copy": 2, "save": 2}
"""Which hit of the point in the step: mid-way (after the first bucket / unit / tensor; a save:
this rank's data file written, the step not yet committed)."""
CONFIGS = {"s1": (1, None), "s2": (2, None), "s3": (3, None), "s2-offload": (2, "cpu")}


# -- the worker (run by torchrun) ------------------------------------------------------------
def _build(tier: str, stage: int, offload: str | None):
    import zeroshard
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Dropout(0.2),
                                torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
    opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-2, stage=stage, bucket_size_mb=0.004,
                                  offload_optimizer=offload,
                                  redundancy=zeroshard.PeerRedundancy(path=tier, run_id="kill-bench", every=1))
    return model, opt, torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (from /proc: torchrun starts each worker in its own session)."""
    kids = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                kids.append(int(d))
    return kids


def _lose_node(a: argparse.Namespace, rank: int) -> None:
    """``kill_points.ON_KILL``: notes the kill, then (``--lose node``) takes this node down with
    this process: its agent first (so it cannot react to a worker's death), its other workers,
    its tier directory (the node's memory). The caller SIGKILLs this process next."""
    with open(os.path.join(a.out, "kill.json"), "w") as f:
        json.dump({"rank": rank, "node": a.node_index, "t": time.time()}, f)
    if a.lose == "node":
        agent = os.getppid()
        others = [p for p in _children(agent) if p != os.getpid()]
        os.kill(agent, signal.SIGKILL)
        for p in others:
            os.kill(p, signal.SIGKILL)
        shutil.rmtree(a.tier, ignore_errors=True)


def worker(a: argparse.Namespace) -> None:
    t_start = time.time()
    # A hang (a restarted worker waiting on a peer that will never answer) ends with every
    # thread's stack in the node's log, not with the driver's timeout alone.
    faulthandler.dump_traceback_later(a.hang_after, exit=True)
    import torch.distributed as dist

    import zeroshard
    from zeroshard.checkpoint import CheckpointError
    from tests.support.peer_worker import save_owned
    from zeroshard.testing import kill_points
    # One store serves every rendezvous round, and the nodes' restart counts differ (a node whose
    # workers were healthy restarts on the membership change without counting it): the workers
    # number the round by joining a counter (each worker once per round) and key the process
    # group by it (finetune's setup_distributed keys it by the restart count: it would mix rounds).
    # (After a node is lost the survivors' restart count says it: their store may be a new one.)
    # (--scale-up runs without the agent's store, TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: rank 0
    # hosts a fresh one each round.)
    world = int(os.environ["WORLD_SIZE"])
    timeout = datetime.timedelta(seconds=float(os.environ.get("ZEROSHARD_PG_TIMEOUT", "120")))
    host = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "False" and os.environ["RANK"] == "0"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=host,
                          timeout=timeout)
    round_ = (store.add("zeroshard-kill-bench/joins", 1) - 1) // world
    dist.init_process_group("gloo", store=dist.PrefixStore(f"zeroshard-kill-bench/round-{round_}", store),
                            rank=int(os.environ["RANK"]), world_size=world, timeout=timeout)
    rank = dist.get_rank()
    restarted = round_ > 0 or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0 or (
        a.grow_at > 0 and world > 2)
    if restarted:
        kill_points.ARMED = None
    else:
        kill_points.ON_KILL = lambda: _lose_node(a, rank)
    model, opt, sched = _build(a.tier, a.stage, a.offload)
    if kill_points.ARMED is not None:  # the forward point: mid-forward, after the first block
        model[3].register_forward_pre_hook(lambda *_: kill_points.hit("forward"))
    gen = torch.Generator().manual_seed(123)
    xs, ys = torch.randn(512, 16, generator=gen), torch.randn(512, 8, generator=gen)
    torch.manual_seed(100 + rank)
    roots = tuple(os.path.realpath(r) + os.sep for r in (a.load_root, a.ref_dir) if r)
    opened: list[str] = []
    sys.addaudithook(lambda event, args: opened.append(str(args[0])) if event == "open" and args and isinstance(
        args[0], (str, bytes, os.PathLike)) and os.path.realpath(os.fsdecode(args[0])).startswith(roots) else None)
    times = {"start": t_start}

    def resume(root: str, name: str) -> int:
        opened.clear()
        try:
            info = zeroshard.load_checkpoint(root, model=model, optimizer=opt, scheduler=sched)
        except CheckpointError:
            return 0
        times.setdefault("loaded", time.time())
        with open(os.path.join(a.out, f"{name}-{rank}.json"), "w") as f:
            json.dump({**{k: info.get(k) for k in ("step", "source", "world_size", "resharded", "bytes_received")},
                       "disk_bytes_read": sum(os.path.getsize(p) for p in set(opened) if os.path.isfile(p))}, f)
        return int(info["step"])

    def train(start: int, saving: bool) -> None:
        world = dist.get_world_size()
        for step in range(start, a.steps):
            i = (step * world + rank) * 4 % 512
            loss = ((model(xs[i:i + 4]) - ys[i:i + 4]) ** 2).mean()
            opt.backward(loss)
            opt.step()
            sched.step()
            opt.zero_grad()
            if restarted and "first_step" not in times:
                times["first_step"] = time.time()
                with open(os.path.join(a.out, f"times-{rank}.json"), "w") as f:
                    json.dump(times, f)
            zeroshard.memory_checkpoint(step + 1, model=model, optimizer=opt, scheduler=sched)
            if a.save_every:
                zeroshard.save_checkpoint(os.path.join(a.ref_dir, f"step-{step + 1}"), step + 1, model=model,
                                          optimizer=opt, scheduler=sched)
            elif saving and step + 1 == a.save_at:
                zeroshard.save_checkpoint(a.load_root, step + 1, model=model, optimizer=opt, scheduler=sched)
            if step + 1 == a.grow_at and not restarted:  # (--scale-up: wait, committed, for node B)
                opt.engine.memory_tier.wait()
                dist.barrier()
                if rank == 0:
                    with open(os.path.join(a.out, "grow.json"), "w") as f:
                        json.dump({"t": time.time()}, f)
                while True:  # (until the launcher, seeing node B wait, restarts the workers at world 4)
                    time.sleep(0.1)
        opt.engine.memory_tier.wait()

    start = resume(a.load_root, "resume") if restarted else 0
    train(start, saving=True)
    if not a.save_every:
        save_owned(model, opt, os.path.join(a.out, f"final-{rank}.safetensors"))
        opt.close()
        model, opt, sched = _build(a.tier + "-ref", a.stage, a.offload)  # a fresh tier: the disk is read
        torch.manual_seed(100 + rank)
        ref_start = resume(os.path.join(a.ref_dir, f"step-{start}"), "ref-resume")
        train(ref_start, saving=False)
        save_owned(model, opt, os.path.join(a.out, f"ref-final-{rank}.safetensors"))
    opt.close()
    dist.destroy_process_group()
    faulthandler.cancel_dump_traceback_later()


# -- the driver ------------------------------------------------------------------------------
def _kill_tree(pid: int) -> None:
    """SIGKILLs a launcher's workers (each in its own session), then the launcher (a timeout)."""
    for p in _children(pid):
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _job(a: argparse.Namespace, out: str, tiers: list[str], extra: list[str], env: dict, restarts: int,
         mode: str = "same") -> tuple[int, str, list[int]]:
    """Launchers as nodes; (the worst exit status, their logs, each one's). ``mode``: "same",
    two nodes ``--nnodes 2``; "single", node A alone ``--nnodes 1``; "lose", node A (index 0,
    the store host, 127.0.0.1) elastic 1:2 with short rendezvous timeouts and node B (127.0.0.2)
    2:2 started first, node B's tier directory deleted once its launcher ends if its dying
    worker has not done it; "grow", node A 1:2 alone, node B 1:2 started once node A's workers
    wrote ``grow.json`` (the addresses order the nodes: node A is ranks 0-1 whatever the pids)."""
    from zeroshard.testing.launch import free_port
    endpoint, rid = f"127.0.0.1:{free_port()}", uuid.uuid4().hex[:8]
    os.makedirs(out, exist_ok=True)
    order = {"same": [0, 1], "single": [0], "lose": [1, 0], "grow": [0, 1]}[mode]
    elastic = mode in ("lose", "grow")
    procs: dict[int, tuple[subprocess.Popen, object]] = {}
    deadline = time.monotonic() + a.timeout
    for node in order:
        conf = f"is_host={int(node == 0)}"
        if elastic:  # (a lost node's heartbeat is missed within 2 s; then 5 s for anyone else to join.
            # Growing, 5 s: a heartbeat late by 2 s at load let node B drop node A and start alone.)
            conf += (",join_timeout=120,last_call_timeout=5,keep_alive_interval=1,keep_alive_max_attempt="
                     f"{5 if mode == 'grow' else 2}")
        nnodes = {"same": "2", "single": "1", "lose": "2:2" if node else "1:2", "grow": "1:2"}[mode]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", nnodes, "--nproc-per-node", "2",
               "--max-restarts", str(restarts), "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
               "--rdzv-id", rid, "--rdzv-conf", conf, "--local-addr", f"127.0.0.{node + 1}" if elastic else "127.0.0.1",
               os.path.abspath(__file__), "--worker", "--tier", tiers[node], "--out", out, "--node-index", str(node),
               "--lose", a.lose, "--hang-after", str(a.hang_after), *extra]
        if mode == "grow" and node == 1:  # (node B joins once node A committed the step to grow at)
            while not os.path.exists(os.path.join(out, "grow.json")) and procs[0][0].poll() is None \
                    and time.monotonic() < deadline:
                time.sleep(0.1)
        log = open(os.path.join(out, f"node-{node}.log"), "w")
        procs[node] = (subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), log)
        if node == order[0] and mode != "grow":
            time.sleep(1.0)  # (node 0 hosts the rendezvous store; node B, first, waits for it)
    rcs = {}
    for node in order:
        p, log = procs[node]
        try:
            rcs[node] = p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _kill_tree(p.pid)
            rcs[node] = p.wait()
            with open(os.path.join(out, f"node-{node}.log"), "a") as f:
                f.write(f"\n[driver] node {node}'s launcher ran past --timeout {a.timeout} s: killed with its workers\n")
        log.close()
        if mode == "lose" and node == 1:
            shutil.rmtree(tiers[1], ignore_errors=True)
    text = "".join(f"=== node {n}\n" + open(os.path.join(out, f"node-{n}.log")).read() for n in sorted(procs))
    return max(abs(r) for r in rcs.values()), text, [rcs[n] for n in sorted(procs)]


def cell(a: argparse.Namespace, work: str, cfg: str, point: str, ref_dir: str, env: dict) -> dict:
    """One kill point (``point`` of ``NTH``) or, with ``point`` "grow", the scale-up: node A alone
    at world 2 commits step ``--kill-step`` and waits, node B joins, the launcher restarts both
    at world 4, which recover from node A's tier alone (node B's is empty)."""
    from safetensors.torch import load_file

    from tests.support.peer_worker import merged
    stage, offload = CONFIGS[cfg]
    grow, node_lost = point == "grow", a.lose == "node" and point != "grow"
    world = 4 if grow else 2 if node_lost else 4
    out = os.path.join(work, f"{cfg}-{point}")
    tiers = [f"/dev/shm/zeroshard-kill-{uuid.uuid4().hex[:8]}-node{n}" for n in range(2)]
    spec = "grow" if grow else f"{point}:{a.kill_step}:{a.kill_rank}:{NTH[point]}"
    t0 = time.perf_counter()
    extra = ["--stage", str(stage), *(["--offload", offload] if offload else []), "--steps", str(a.steps),
             "--load-root", os.path.join(out, "disk"), "--ref-dir", ref_dir]
    extra += ["--grow-at", str(a.kill_step)] if grow else ["--save-at", str(a.kill_step)]
    job_env = {**env, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"} if grow else {**env, "ZEROSHARD_TEST_KILL_AT": spec}
    try:
        rc, log, rcs = _job(a, out, tiers, extra, job_env, restarts=1,
                            mode="grow" if grow else "lose" if node_lost else "same")
    finally:
        b_memory_left = os.path.exists(tiers[1])
        for t in tiers:
            shutil.rmtree(t, ignore_errors=True)
            shutil.rmtree(t + "-ref", ignore_errors=True)
    row: dict = {"config": cfg, "lose": "none (scale-up)" if grow else a.lose, "point": spec, "rc": rcs,
                 "s": round(time.perf_counter() - t0, 1),
                 "killed": "Signals.SIGKILL" in log or "exitcode: -9" in log or -9 in rcs}
    if "Timeout (0:" in log:  # (a worker's faulthandler dump: where it hung)
        row["hang"] = log[log.index("Timeout (0:"):][:1500]
    try:
        with open(os.path.join(out, "grow.json" if grow else "kill.json")) as f:
            event = json.load(f)
        resumed = [json.load(open(os.path.join(out, f"resume-{r}.json"))) for r in range(world)]
        times = [json.load(open(os.path.join(out, f"times-{r}.json"))) for r in range(world)]
        a_, b_ = merged(out, world), merged(out, world, "ref-final")
        if node_lost and event["node"] != 1:
            raise ValueError(f"rank {event['rank']} was on node {event['node']} (the store host), not node B")
    except (OSError, ValueError, KeyError) as exc:
        row.update(bitwise=False, error=f"{type(exc).__name__}: {exc}", log_tail=log[-3000:])
        return row
    done_before = a.kill_step if grow or point in ("replica_copy", "save") else a.kill_step - 1
    step = resumed[0]["step"]
    row.update(bitwise=a_.keys() == b_.keys() and all(a_[k].dtype == b_[k].dtype and torch.equal(a_[k], b_[k])
                                                      for k in a_),
               killed_rank=event.get("rank"), recovered_step=step, steps_lost=done_before - step,
               same_step_everywhere=all(r["step"] == step for r in resumed),
               disk_bytes_read=sum(r["disk_bytes_read"] for r in resumed),
               # (each rank's bytes received over the process group, against its owned pieces' bytes)
               received=[(r.get("bytes_received"), sum(t.numel() * t.element_size() for t in load_file(
                   os.path.join(out, f"final-{i}.safetensors")).values())) for i, r in enumerate(resumed)],
               ref_disk_bytes_read=sum(json.load(open(os.path.join(out, f"ref-resume-{r}.json")))["disk_bytes_read"]
                                       for r in range(world)),  # (the audit sees a disk load)
               node_b_memory_left=b_memory_left if node_lost else None,
               path=sorted({f"{r['source']}:{r['world_size']}->{world}{' resharded' if r['resharded'] else ''}"
                            for r in resumed}),
               relaunch_s=round(min(t["start"] for t in times) - event["t"], 2),
               loaded_s=round(max(t["loaded"] for t in times) - event["t"], 2),
               first_step_s=round(max(t["first_step"] for t in times) - event["t"], 2))
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--tier", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--node-index", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--load-root", help=argparse.SUPPRESS)
    ap.add_argument("--ref-dir", help=argparse.SUPPRESS)
    ap.add_argument("--save-at", type=int, default=-1, help=argparse.SUPPRESS)
    ap.add_argument("--save-every", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--stage", type=int, default=2, help=argparse.SUPPRESS)
    ap.add_argument("--offload", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--grow-at", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--lose", choices=("node", "process"), default="node",
                    help="node: node B (the killed rank's) goes whole, memory included, and node A goes on at "
                    "world 2; process: only the process dies, every worker restarts at world 4")
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of {list(CONFIGS)}")
    ap.add_argument("--points", default=",".join(NTH), help=f"comma-separated, of {list(NTH)}")
    ap.add_argument("--steps", type=int, default=5, help="steps of every run")
    ap.add_argument("--kill-step", type=int, default=3, help="the step whose point kills")
    ap.add_argument("--kill-rank", type=int, default=None,
                    help="the rank killed (default: --lose node 3, node B's second, its buddy rank 1 on node A; "
                    "--lose process 1, node A's second, its buddy rank 3 on node B)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per torchrun job (both launchers)")
    ap.add_argument("--hang-after", type=float, default=240.0,
                    help="seconds after which a worker dumps its threads' stacks and exits (a hang)")
    ap.add_argument("--pg-timeout", type=float, default=60.0,
                    help="ZEROSHARD_PG_TIMEOUT of the workers (seconds; their process groups', the tier's and the "
                    "save's side groups': how long a survivor waits in a group creation for a lost peer)")
    ap.add_argument("--scale-up", action="store_true",
                    help="instead of the kill points: per config, node A alone at world 2 commits step --kill-step, "
                    "node B joins, both go on at world 4 from node A's tier; against the world-2 disk save resumed")
    ap.add_argument("--keep", action="store_true", help="keep the work directory (the jobs' logs) and say where")
    a = ap.parse_args()
    if a.worker:
        return worker(a)
    if a.kill_rank is None:
        a.kill_rank = 3 if a.lose == "node" else 1
    for c in a.configs.split(","):
        if c not in CONFIGS:
            raise ValueError(f"--configs: {c!r} is not one of {list(CONFIGS)}")
    for p in a.points.split(","):
        if p not in NTH:
            raise ValueError(f"--points: {p!r} is not one of {list(NTH)}")
    if not 1 <= a.kill_step < a.steps:
        raise ValueError(f"--kill-step {a.kill_step} must be in [1, --steps {a.steps})")
    if a.lose == "node" and a.kill_rank not in (2, 3):
        raise ValueError(f"--kill-rank {a.kill_rank}: with --lose node the rank must be on node B (2 or 3; "
                         "node A, ranks 0-1, hosts the store and goes on)")
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=repo + os.pathsep + os.environ.get("PYTHONPATH", ""),
               ZEROSHARD_PG_TIMEOUT=str(a.pg_timeout))
    work = tempfile.mkdtemp(prefix="zs-kill-bench-")
    rows = []
    try:
        for cfg in a.configs.split(","):
            stage, offload = CONFIGS[cfg]
            ref_dir, out = os.path.join(work, f"{cfg}-ref-disk"), os.path.join(work, f"{cfg}-ref")
            tiers = [f"/dev/shm/zeroshard-kill-{uuid.uuid4().hex[:8]}-node{n}" for n in range(2)]
            try:
                rc, log, _ = _job(a, out, tiers, ["--stage", str(stage), *(["--offload", offload] if offload else []),
                                                   "--steps", str(a.steps), "--load-root", os.path.join(out, "none"),
                                                   "--ref-dir", ref_dir, "--save-every"], env, restarts=0,
                                  mode="single" if a.scale_up else "same")
            finally:
                for t in tiers:
                    shutil.rmtree(t, ignore_errors=True)
            if rc != 0:
                raise RuntimeError(f"the reference job of {cfg} failed (rc {rc}):\n{log[-3000:]}")
            for point in ["grow"] if a.scale_up else a.points.split(","):
                rows.append(cell(a, work, cfg, point, ref_dir, env))
                print(json.dumps(rows[-1]), flush=True)
    finally:
        if a.keep:
            print(f"logs under {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    print("| config | kill point (point:step:rank:nth) | bitwise | step recovered | completed steps lost | "
          "disk bytes read | path | kill -> relaunched / loaded / first step (s) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['config']} | {r['point']} | {'yes' if r.get('bitwise') else 'NO'} | {r.get('recovered_step')} | "
              f"{r.get('steps_lost')} | {r.get('disk_bytes_read')} | {', '.join(r.get('path', [r.get('error', '')]))} | "
              f"{r.get('relaunch_s')} / {r.get('loaded_s')} / {r.get('first_step_s')} |")


if __name__ == "__main__":
    main()
