"""ZeRO++ hpZ (``ZeroOptimizer(..., stage=3, mesh=mesh_2d, hpz=True)``) and the bytes per
step of each sharding scope, on 4 gloo ranks acting as 2 nodes x 2 (tests/support/hpz_worker.py).

- parity: hpZ against single-process torch.optim.AdamW on the same global batch (fp32 within
  1e-5 after 8 steps, clipping on every step), and a resume that continues bit for bit;
- memory: the secondary partition costs unit numel / node size per rank, in the model dtype;
- accounting: what ``comm_report`` measures per step, collective by collective and link by
  link, equals the formulas of zeroshard/planner/traffic.py (docs/design.md, "Bytes per
  step") for flat and hybrid at stages 0-3 and hpZ; hpZ's forward and backward gathers
  cross no node boundary; the inter-node bytes fall by the factor the formulas give; and the
  planner (``estimate``) gives the measured figures for the three stage-3 configurations.
"""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from tests.support import hpz_worker as hw
from tests.support.dist_results import run_ranks
from zeroshard.planner import Choice, Hardware, ModelShape, Workload, estimate
from zeroshard.planner.traffic import Topology, measured_links, step_traffic

NODES, PER_NODE = hw.NODES, hw.PER_NODE
CONFIGS = [(s, st, "fp32") for s in ("flat", "hybrid") for st in (0, 1, 2, 3)] + [("hpz", 3, "fp32")]
CONFIGS += [(s, 3, "bf16") for s in ("flat", "hybrid", "hpz")]  # (b = 2 != g = 4: the formulas keep them apart)


@pytest.mark.parametrize("collectives", ["emulated", "native"])
def test_hpz_trains_like_torch_and_resumes_bitwise(tmp_path, monkeypatch, collectives):
    """``native``: the reduce-scatter / all-gather path NCCL takes (separate output buffers at
    both levels of Note [hpZ slice order]), run on gloo; ``emulated``: gloo's default."""
    import zeroshard
    monkeypatch.setenv("ZEROSHARD_COLLECTIVES", collectives)
    ckpt = str(tmp_path / "ckpt")
    ranks = run_ranks(hw.parity_worker, NODES * PER_NODE, tmp_path, ckpt)
    for r in ranks:
        assert r["steps"] >= 8 and r["diff"] < 1e-5 and r["loss_rel"] < 1e-6, r
        assert r["resume_equal"] and r["moments_equal"] and r["moments_diff"] < 1e-6, r
        assert r["written_loss"] == pytest.approx(r["ref_written_loss"], rel=1e-6), r
        units = r["units"]
        assert r["secondary"] == sum(u["padded"] // PER_NODE * u["elsize"] for u in units), r
        assert r["parameters"] == sum(u["padded"] // (NODES * PER_NODE) * u["elsize"] for u in units), r
    # the checkpoint an hpZ run writes is an ordinary one: it loads at world 1, stage 1
    model = hw.gpt2()
    opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-2, stage=1)
    zeroshard.load_checkpoint(ckpt, model=model, optimizer=opt)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_hpz_refuses_what_it_cannot_do():
    import zeroshard
    from zeroshard.config import ZeroConfig
    with pytest.raises(ValueError, match="needs stage=3"):
        ZeroConfig(stage=2, hpz=True)
    with pytest.raises(ValueError, match="offload_params='nvme'"):
        ZeroConfig(stage=3, hpz=True, offload_optimizer="nvme", offload_params="nvme", nvme_path="/tmp")
    with pytest.raises(TypeError, match="hpz"):
        ZeroConfig(stage=3, hpz="yes")
    with pytest.raises(ValueError, match="2-D DeviceMesh"):
        zeroshard.ZeroOptimizer(torch.nn.Linear(2, 2), torch.optim.AdamW, stage=3, hpz=True)


@pytest.mark.parametrize("scope,stage", [("flat", 3), ("hybrid", 2), ("hybrid", 3), ("hpz", 3)])
def test_a_layer_used_on_one_node_only_steps_alike_everywhere(tmp_path, scope, stage):
    """Whether a parameter got a gradient is agreed by every rank, across nodes too: under
    hybrid sharding the replicas' flags are combined as well (they were not: the replica that
    never used the layer left it unchanged while the other stepped it)."""
    ranks = run_ranks(hw.branch_worker, NODES * PER_NODE, tmp_path, scope, stage)
    init = hw.Branchy()
    for r in ranks:
        assert r == ranks[0]
    # stepped with the average over all ranks (zeros from the first node), as DDP and torch.optim
    want = init.b.weight.detach() - 0.1 * 2.0 * PER_NODE / (NODES * PER_NODE)
    assert torch.allclose(torch.tensor(ranks[0]["b.weight"]), want.flatten(), atol=1e-6), ranks[0]


@pytest.fixture(scope="module")
def traffic(tmp_path_factory):
    d = tmp_path_factory.mktemp("traffic")
    return run_ranks(hw.traffic_worker, NODES * PER_NODE, d, CONFIGS)


def _topo(scope: str) -> Topology:
    return Topology(nodes=NODES, gpus_per_node=PER_NODE, scope=scope)


def _formula(scope: str, stage: int, res: dict):
    units = res["units"]
    return step_traffic(stage, _topo(scope), [(u["numel"], u["root"]) for u in units], units[0]["elsize"],
                        n_tensors=sum(u["tensors"] for u in units))


def _measured(res: dict) -> Counter:
    """(collective, link) -> bytes of one step (both phases)."""
    out: Counter = Counter()
    for report in res["phases"].values():
        for key, entry in report.items():
            link = "intra" if measured_links({key: entry}, NODES)["intra_node"] else "inter"
            out[(key.split("@")[0], link)] += entry["bytes"]
    return out


@pytest.mark.parametrize("scope,stage,precision", CONFIGS, ids=[f"{s}-stage{st}-{p}" for s, st, p in CONFIGS])
def test_bytes_per_step_equal_the_formulas(traffic, scope, stage, precision):
    for r in traffic:
        res = r[f"{scope}-{stage}" + ("" if precision == "fp32" else f"-{precision}")]
        f = _formula(scope, stage, res)
        want: Counter = Counter()
        for kind, link, nbytes in f.kinds:
            want[(kind, link)] += nbytes
        assert _measured(res) == want, (res["phases"], f)
        total = Counter()
        for report in res["phases"].values():
            total.update(measured_links(report, NODES))
        assert (total["intra_node"], total["inter_node"]) == (f.intra_node, f.inter_node)


def test_hpz_gathers_stay_inside_the_node_and_cross_once_per_step(traffic):
    for r in traffic:
        res = r["hpz-3"]
        fwd_bwd, step = res["phases"]["forward_backward"], res["phases"]["step"]
        gathers = {k: v for k, v in fwd_bwd.items() if k.startswith("all_gather")}
        assert gathers and all(v["dimension"] == "shard" for v in gathers.values()), fwd_bwd
        assert measured_links(gathers, NODES)["inter_node"] == 0
        # the secondary rebuild: 1/k of every unit, across nodes, at the step
        psi = sum(u["padded"] for u in res["units"])
        assert step["all_gather@replicate"]["bytes"] == psi // PER_NODE * 4, step
        assert res["memory"]["secondary"] == psi // PER_NODE * 4


def test_inter_node_bytes_fall_by_the_formula_factor(traffic):
    for r in traffic:
        inter = {}
        for scope in ("flat", "hybrid", "hpz"):
            total = Counter()
            for report in r[f"{scope}-3"]["phases"].values():
                total.update(measured_links(report, NODES))
            inter[scope] = total["inter_node"]
        f_flat, f_hpz = _formula("flat", 3, r["flat-3"]), _formula("hpz", 3, r["hpz-3"])
        assert inter["flat"] / inter["hpz"] == f_flat.inter_node / f_hpz.inter_node
        # closed form k(g + 2b)/(g + b) = 3 at k = 2 in fp32, less the root unit's one gather
        units = r["flat-3"]["units"]
        psi, root = sum(u["padded"] for u in units), sum(u["padded"] for u in units if u["root"])
        assert inter["flat"] / inter["hpz"] == pytest.approx(PER_NODE * (12 * psi - 4 * root) / (8 * psi), rel=1e-3)
        assert inter["hybrid"] < inter["hpz"] < inter["flat"]


@pytest.mark.parametrize("scope", ["flat", "hybrid", "hpz"])
def test_planner_estimate_equals_comm_report(traffic, scope):
    """``zeroshard estimate``'s per-step bytes for this model's shape (its exact block size)
    at 2 nodes x 2 equal the measured ones, less the flag bytes (a byte per parameter tensor,
    which a shape does not know); the memory estimate includes hpZ's secondary partition."""
    res = traffic[0][f"{scope}-3"]
    units = res["units"]
    blocks = [u for u in units if not u["root"]]
    shape = ModelShape(n_params=sum(u["numel"] for u in units), n_layers=len(blocks), d_model=32, vocab=64,
                       block_numel=blocks[0]["numel"])
    e = estimate(Choice(3), shape, Hardware(gpu_memory=2**40, n_gpus=PER_NODE, nodes=NODES, accelerator=False),
                 Workload(mixed_precision=None, scope=scope))
    flags = Counter()
    for report in res["phases"].values():
        flags.update(measured_links({k: v for k, v in report.items() if k.split("@")[0] == "grad_flags"}, NODES))
    total = Counter()
    for report in res["phases"].values():
        total.update(measured_links(report, NODES))
    assert e.traffic.intra_node == total["intra_node"] - flags["intra_node"]
    assert e.traffic.inter_node == total["inter_node"] - flags["inter_node"]
    psi = sum(u["numel"] for u in units)
    assert e.gpu_states.secondary == (4 * psi // PER_NODE if scope == "hpz" else 0)
    assert abs(res["memory"].get("secondary", 0) - e.gpu_states.secondary) <= 4 * 16 * NODES * len(units)  # (padding)


def test_nccl_device_script_parses():
    """benchmarks/multinode_nccl_check.py (the lent-GPU check; its gloo fallback runs the same
    checks on the CPU in about 90 s here, too long for the suite) starts and explains itself."""
    import os
    import subprocess
    import sys
    script = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "multinode_nccl_check.py")
    done = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "--backend" in done.stdout, done.stderr
