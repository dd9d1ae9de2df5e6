"""Where one memory-tier commit spends its time (issue 45): 2 gloo ranks, the default model of
bench_peer_recovery.py (4 x Linear(2048, 2048), 100.7 MB of state per rank), a commit every step;
each phase of the tier's thread timed by wrapping it (medians over commits 3-12, rank 0, ms).
Runs on a tree before the CRC-32C kernel too (then it times the zlib crc32 pass).

    python benchmarks/profile_tier_commit.py [rows per rank, default 8]
"""
import os
import tempfile
import collections, functools, json, statistics, sys, time, uuid, shutil
import torch, torch.distributed as dist
import zeroshard
from zeroshard.resilience import memory_tier as mt
from zeroshard.testing.launch import spawn

T = collections.defaultdict(list)

def timed(name, fn):
    @functools.wraps(fn)
    def w(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            T[name].append(time.perf_counter() - t)
    return w

def _rank(rank, world, tier, out, batch):
    M = mt.MemoryTier
    M._target = timed("begin+map (_target)", M._target)
    M._stamp = timed("stamp (header, stamp, rename)", M._stamp)
    orig_ex = M._exchange
    def ex(self, *a, **k):
        t = time.perf_counter(); fin = orig_ex(self, *a, **k); T["swap start"].append(time.perf_counter() - t)
        return timed("swap wait", fin)
    M._exchange = ex
    if hasattr(mt, "checksum"):
        mt.checksum.copy_in = timed("copy+checksum (copy_in)", mt.checksum.copy_in)
    else:
        class Z:  # the old thread: copy loop, then zlib.crc32
            crc32 = staticmethod(timed("crc32 pass", __import__("zlib").crc32))
        mt.zlib = Z
    mt.dist.all_gather_object = timed("all_gather_object (failures+pacer)", dist.all_gather_object)
    M._run = timed("thread total", M._run)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(4)])
    opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-3, stage=2,
                                  redundancy=zeroshard.PeerRedundancy(path=tier, run_id="prof", every=1))
    x = torch.randn(batch, 2048)
    caller, steps = [], []
    for s in range(1, 13):
        t = time.perf_counter()
        opt.backward(model(x).square().mean()); opt.step(); opt.zero_grad()
        t1 = time.perf_counter()
        zeroshard.memory_checkpoint(s, model=model, optimizer=opt)
        caller.append(time.perf_counter() - t1); steps.append(t1 - t)
    opt.engine.memory_tier.wait()
    opt.close()
    if rank == 0:
        res = {k: round(1000 * statistics.median(v[2:]), 1) for k, v in T.items()}
        res["caller memory_checkpoint"] = round(1000 * statistics.median(caller[2:]), 1)
        res["step incl. wait for copy"] = round(1000 * statistics.median(steps[2:]), 1)
        json.dump(res, open(out, "w"), indent=1)

if __name__ == "__main__":
    tier = f"/dev/shm/zeroshard-prof-{uuid.uuid4().hex[:6]}"
    out = os.path.join(tempfile.mkdtemp(prefix="zs-prof-"), "phases.json")
    try:
        spawn(_rank, 2, tier, out, int(sys.argv[1]) if len(sys.argv) > 1 else 8)
        print(open(out).read())
    finally:
        shutil.rmtree(tier, ignore_errors=True)
