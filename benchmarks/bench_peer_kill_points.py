"""Bitwise after a SIGKILL inside a step (issue 45, Note [kill points] in zeroshard/testing/kill_points.py):
world 4 on loopback as two torchrun launchers ("two nodes", ``--nnodes 2 --nproc-per-node 2``,
each with its own tmpfs directory for the memory tier), ``redundancy="peer"`` committing every
step. For each configuration (stage 1, 2, 3; stage 2 with ``offload_optimizer="cpu"``):

- a reference job runs uninterrupted and saves every step k to disk (``ref/step-k``);
- per kill point (forward, reduce_scatter, optimizer_step mid-way, replica_copy mid-way, a
  disk save), a job whose rank ``--kill-rank`` SIGKILLs itself at that point of step
  ``--kill-step`` (``ZEROSHARD_TEST_KILL_AT``); torchrun (``--max-restarts 1``) restarts every
  worker, which resume through ``load_checkpoint`` (memory tiers first) at the same world size
  (both nodes' memory stays: the process died, not the node), and train to ``--steps``; then, in
  the same processes, the reference's disk checkpoint of the step the memory gave back is
  resumed at world 4 and trained as far. Weights, fp32 masters, moments and step counts are
  compared with ``torch.equal``.

Per cell: bitwise, the step recovered, completed steps lost (the newest step the optimizer
finished before the kill, minus the step recovered: the step in flight and a commit still in
flight are lost by design, Note [peer memory tier]), disk bytes the recovery opened (files under
the disk roots, counted by an audit hook) and the path (memory/disk, resharded or not).

    python benchmarks/bench_peer_kill_points.py [--configs s1,s2,s3,s2-offload]
        [--points forward,reduce_scatter,optimizer_step,replica_copy,save] [--steps 5 --kill-step 3]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
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


def worker(a: argparse.Namespace) -> None:
    import torch.distributed as dist

    import zeroshard
    from zeroshard.checkpoint import CheckpointError
    from tests.support.peer_worker import owned_state
    from zeroshard.testing import kill_points
    # One store serves every rendezvous round, and the nodes' restart counts differ (a node whose
    # workers were healthy restarts on the membership change without counting it): the workers
    # number the round by joining a counter (each worker once per round) and key the process
    # group by it (finetune's setup_distributed keys it by the restart count: it would mix rounds).
    world = int(os.environ["WORLD_SIZE"])
    timeout = datetime.timedelta(seconds=120)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                          timeout=timeout)
    round_ = (store.add("zeroshard-kill-bench/joins", 1) - 1) // world
    dist.init_process_group("gloo", store=dist.PrefixStore(f"zeroshard-kill-bench/round-{round_}", store),
                            rank=int(os.environ["RANK"]), world_size=world, timeout=timeout)
    rank = dist.get_rank()
    restarted = round_ > 0
    if restarted:
        kill_points.ARMED = None
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

    def resume(root: str, name: str) -> int:
        opened.clear()
        try:
            info = zeroshard.load_checkpoint(root, model=model, optimizer=opt, scheduler=sched)
        except CheckpointError:
            return 0
        with open(os.path.join(a.out, f"{name}-{rank}.json"), "w") as f:
            json.dump({**{k: info.get(k) for k in ("step", "source", "world_size", "resharded")},
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
            zeroshard.memory_checkpoint(step + 1, model=model, optimizer=opt, scheduler=sched)
            if a.save_every:
                zeroshard.save_checkpoint(os.path.join(a.ref_dir, f"step-{step + 1}"), step + 1, model=model,
                                          optimizer=opt, scheduler=sched)
            elif saving and step + 1 == a.save_at:
                zeroshard.save_checkpoint(a.load_root, step + 1, model=model, optimizer=opt, scheduler=sched)
        opt.engine.memory_tier.wait()

    start = resume(a.load_root, "resume") if restarted else 0
    train(start, saving=True)
    if not a.save_every:
        torch.save(owned_state(model, opt), os.path.join(a.out, f"final-{rank}.pt"))
        opt.close()
        model, opt, sched = _build(a.tier + "-ref", a.stage, a.offload)  # a fresh tier: the disk is read
        torch.manual_seed(100 + rank)
        ref_start = resume(os.path.join(a.ref_dir, f"step-{start}"), "ref-resume")
        train(ref_start, saving=False)
        torch.save(owned_state(model, opt), os.path.join(a.out, f"ref-final-{rank}.pt"))
    opt.close()
    dist.destroy_process_group()


# -- the driver ------------------------------------------------------------------------------
def _job(a: argparse.Namespace, out: str, tiers: list[str], extra: list[str], env: dict, restarts: int) -> tuple[int, str]:
    from zeroshard.testing.launch import free_port
    endpoint, rid = f"127.0.0.1:{free_port()}", uuid.uuid4().hex[:8]
    os.makedirs(out, exist_ok=True)
    procs = []
    for node, tier in enumerate(tiers):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
               "--max-restarts", str(restarts), "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
               "--rdzv-id", rid, "--rdzv-conf", f"is_host={int(node == 0)}", "--local-addr", "127.0.0.1",
               os.path.abspath(__file__), "--worker", "--tier", tier, "--out", out, *extra]
        log = open(os.path.join(out, f"node-{node}.log"), "w")
        procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), log))
        if node == 0:
            time.sleep(1.0)  # (node 0 hosts the rendezvous store)
    rcs = []
    for p, log in procs:
        try:
            rcs.append(p.wait(timeout=a.timeout))
        except subprocess.TimeoutExpired:
            p.kill()
            rcs.append(p.wait())
        log.close()
    text = "".join(open(os.path.join(out, f"node-{n}.log")).read() for n in range(len(tiers)))
    return max(abs(r) for r in rcs), text


def _merged(out: str, prefix: str) -> dict[str, torch.Tensor]:
    parts: dict[str, list] = {}
    for r in range(4):
        for key, t in torch.load(os.path.join(out, f"{prefix}-{r}.pt"), weights_only=True).items():
            name, start, _stop, kind = key.split("|")
            parts.setdefault(f"{name}|{kind}", []).append((int(start), t))
    return {k: torch.cat([t.reshape(-1) for _, t in sorted(v, key=lambda p: p[0])])
            if not k.split("|")[1].startswith("scalar") else sorted(v, key=lambda p: p[0])[0][1]
            for k, v in parts.items()}


def cell(a: argparse.Namespace, work: str, cfg: str, point: str, ref_dir: str, env: dict) -> dict:
    stage, offload = CONFIGS[cfg]
    out = os.path.join(work, f"{cfg}-{point}")
    tiers = [f"/dev/shm/zeroshard-kill-{uuid.uuid4().hex[:8]}-node{n}" for n in range(2)]
    spec = f"{point}:{a.kill_step}:{a.kill_rank}:{NTH[point]}"
    t0 = time.perf_counter()
    try:
        rc, log = _job(a, out, tiers, ["--stage", str(stage), *(["--offload", offload] if offload else []),
                                        "--steps", str(a.steps), "--load-root", os.path.join(out, "disk"),
                                        "--ref-dir", ref_dir, "--save-at", str(a.kill_step)],
                       {**env, "ZEROSHARD_TEST_KILL_AT": spec}, restarts=1)
    finally:
        for t in tiers:
            shutil.rmtree(t, ignore_errors=True)
            shutil.rmtree(t + "-ref", ignore_errors=True)
    row: dict = {"config": cfg, "point": spec, "rc": rc, "s": round(time.perf_counter() - t0, 1),
                 "killed": "Signals.SIGKILL" in log or "exitcode: -9" in log}
    try:
        resumed = [json.load(open(os.path.join(out, f"resume-{r}.json"))) for r in range(4)]
        a_, b_ = _merged(out, "final"), _merged(out, "ref-final")
    except (OSError, ValueError) as exc:
        row.update(bitwise=False, error=f"{type(exc).__name__}: {exc}", log_tail=log[-1500:])
        return row
    done_before = a.kill_step if point in ("replica_copy", "save") else a.kill_step - 1
    step = resumed[0]["step"]
    row.update(bitwise=a_.keys() == b_.keys() and all(a_[k].dtype == b_[k].dtype and torch.equal(a_[k], b_[k])
                                                      for k in a_),
               recovered_step=step, steps_lost=done_before - step,
               same_step_everywhere=all(r["step"] == step for r in resumed),
               disk_bytes_read=sum(r["disk_bytes_read"] for r in resumed),
               path=sorted({f"{r['source']}:{r['world_size']}->4{' resharded' if r['resharded'] else ''}"
                            for r in resumed}))
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--tier", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--load-root", help=argparse.SUPPRESS)
    ap.add_argument("--ref-dir", help=argparse.SUPPRESS)
    ap.add_argument("--save-at", type=int, default=-1, help=argparse.SUPPRESS)
    ap.add_argument("--save-every", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--stage", type=int, default=2, help=argparse.SUPPRESS)
    ap.add_argument("--offload", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of {list(CONFIGS)}")
    ap.add_argument("--points", default=",".join(NTH), help=f"comma-separated, of {list(NTH)}")
    ap.add_argument("--steps", type=int, default=5, help="steps of every run")
    ap.add_argument("--kill-step", type=int, default=3, help="the step whose point kills")
    ap.add_argument("--kill-rank", type=int, default=1, help="the rank killed (node 0's second; its buddy is on node 1)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per torchrun job")
    ap.add_argument("--keep", action="store_true", help="keep the work directory (the jobs' logs) and say where")
    a = ap.parse_args()
    if a.worker:
        return worker(a)
    for c in a.configs.split(","):
        if c not in CONFIGS:
            raise ValueError(f"--configs: {c!r} is not one of {list(CONFIGS)}")
    for p in a.points.split(","):
        if p not in NTH:
            raise ValueError(f"--points: {p!r} is not one of {list(NTH)}")
    if not 1 <= a.kill_step < a.steps:
        raise ValueError(f"--kill-step {a.kill_step} must be in [1, --steps {a.steps})")
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=repo + os.pathsep + os.environ.get("PYTHONPATH", ""))
    work = tempfile.mkdtemp(prefix="zs-kill-bench-")
    rows = []
    try:
        for cfg in a.configs.split(","):
            stage, offload = CONFIGS[cfg]
            ref_dir, out = os.path.join(work, f"{cfg}-ref-disk"), os.path.join(work, f"{cfg}-ref")
            tiers = [f"/dev/shm/zeroshard-kill-{uuid.uuid4().hex[:8]}-node{n}" for n in range(2)]
            try:
                rc, log = _job(a, out, tiers, ["--stage", str(stage), *(["--offload", offload] if offload else []),
                                                "--steps", str(a.steps), "--load-root", os.path.join(out, "none"),
                                                "--ref-dir", ref_dir, "--save-every"], env, restarts=0)
            finally:
                for t in tiers:
                    shutil.rmtree(t, ignore_errors=True)
            if rc != 0:
                raise RuntimeError(f"the reference job of {cfg} failed (rc {rc}):\n{log[-3000:]}")
            for point in a.points.split(","):
                rows.append(cell(a, work, cfg, point, ref_dir, env))
                print(json.dumps(rows[-1]), flush=True)
    finally:
        if a.keep:
            print(f"logs under {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    print("| config | kill point (point:step:rank:nth) | bitwise | step recovered | completed steps lost | "
          "disk bytes read | path |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['config']} | {r['point']} | {'yes' if r.get('bitwise') else 'NO'} | {r.get('recovered_step')} | "
              f"{r.get('steps_lost')} | {r.get('disk_bytes_read')} | {', '.join(r.get('path', [r.get('error', '')]))} |")


if __name__ == "__main__":
    main()
