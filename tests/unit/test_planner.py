"""The planner (``zeroshard estimate``) without processes: formulas, placement of offloaded
bytes, fitting, recommendation, input parsing and the command line."""
from __future__ import annotations

import json

import pytest

from zeroshard import zero_formula
from zeroshard.planner import Choice, Hardware, ModelShape, Workload, all_choices, estimate, parse_bytes, parse_count, plan
from zeroshard.planner.planner_commands import COMMANDS

GB = 10**9
SHAPE = ModelShape.from_params(1_000_000_000)
BIG = Hardware(gpu_memory=10**15, n_gpus=8, cpu_memory=10**15, nvme=10**15)


@pytest.mark.parametrize("stage", (0, 1, 2, 3))
@pytest.mark.parametrize("precision", (None, "bf16"))
def test_model_states_follow_the_zero_formula(stage: int, precision: str | None) -> None:
    w = Workload(mixed_precision=precision)
    e = estimate(Choice(stage), SHAPE, BIG, w)
    f = zero_formula(stage, SHAPE.n_params, 8, param_bytes=w.param_bytes, mixed_precision=precision is not None)
    assert e.gpu_states.model_states == f.model_states
    assert e.cpu_total == e.nvme_total == 0


def test_offload_moves_optimizer_state_and_keeps_the_total() -> None:
    w = Workload(mixed_precision="bf16")
    on_gpu = estimate(Choice(2), SHAPE, BIG, w)
    cpu = estimate(Choice(2, "cpu"), SHAPE, BIG, w)
    nvme = estimate(Choice(2, "nvme"), SHAPE, BIG, w)
    assert cpu.gpu_states.optimizer_states == cpu.gpu_states.master_weights == cpu.gpu_states.gradients == 0
    # the states leave the GPU and land on the host; the gradient slice goes with them
    assert cpu.gpu_states.model_states + cpu.cpu_per_rank == on_gpu.gpu_states.model_states
    # moments, gradient slice and fp32 master go to the swap files; the host keeps buffers only
    g = on_gpu.gpu_states
    assert nvme.nvme_per_rank == g.optimizer_states + g.gradients + g.master_weights
    assert nvme.cpu_per_rank < cpu.cpu_per_rank / 10
    full = estimate(Choice(3, "cpu", "cpu"), SHAPE, BIG, w)
    assert full.gpu_states.model_states == 0 and full.gpu_states.buffers > 0


def test_checkpointing_shrinks_activations() -> None:
    w = Workload(micro_batch=8, seq_len=2048)
    plain = estimate(Choice(2), SHAPE, BIG, w).activations
    ckpt = estimate(Choice(2, activation_checkpointing=True), SHAPE, BIG, w).activations
    assert ckpt < plain / 3


def test_recommends_the_fastest_choice_that_fits() -> None:
    shape = ModelShape.from_params(7_000_000_000, n_layers=32, d_model=4096)
    hw = Hardware(gpu_memory=80 * GB, n_gpus=8, cpu_memory=1000 * GB, nvme=4000 * GB)
    p = plan(shape, hw, Workload(micro_batch=1, seq_len=2048))
    best = p.recommended
    assert best is not None and best.fits
    assert not any(e.fits for e in p.estimates if e.choice.relative_cost < best.choice.relative_cost)
    tied = [e for e in p.estimates if e.fits and e.choice.relative_cost == best.choice.relative_cost]
    assert best.gpu_total == min(e.gpu_total for e in tied)  # ties: the most headroom (stage 2 over 0/1)
    assert not next(e for e in p.estimates if e.choice == Choice(0)).fits  # 16 bytes/param > 80 GB
    tiny = Hardware(gpu_memory=GB, n_gpus=1, cpu_memory=GB)
    assert plan(shape, tiny, Workload()).recommended is None


def test_choices_are_the_valid_combinations() -> None:
    choices = all_choices()
    assert len(choices) == len(set(choices))
    assert Choice(3, "cpu", "cpu") in choices and Choice(0, activation_checkpointing=True) in choices
    with pytest.raises(ValueError, match="needs stage=3"):
        Choice(2, None, "cpu")
    with pytest.raises(ValueError, match="stage >= 1"):
        Choice(0, "cpu")


def test_bad_inputs_name_the_fix() -> None:
    assert parse_bytes("80GB") == 80 * GB and parse_bytes("1GiB") == 2**30
    assert parse_count("124M") == 124_000_000 and parse_count("7B") == 7 * GB
    with pytest.raises(ValueError, match="'80GB'"):
        parse_bytes("eighty")
    with pytest.raises(ValueError, match="124M"):
        parse_count("12X")
    with pytest.raises(ValueError, match="gpu-memory"):
        Hardware(gpu_memory=0)
    with pytest.raises(ValueError, match="mixed_precision"):
        Workload(mixed_precision="fp8")
    with pytest.raises(ValueError, match="n_layers"):
        ModelShape(n_params=10, n_layers=0, d_model=8)


def test_shape_from_a_hugging_face_config(tmp_path) -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_embd=64, n_layer=3, n_head=4, vocab_size=500, n_positions=128)
    cfg.save_pretrained(tmp_path)
    shape = ModelShape.from_hf_config(str(tmp_path))
    model = transformers.GPT2LMHeadModel(cfg)
    assert shape.n_params == sum(p.numel() for p in model.parameters())
    assert (shape.n_layers, shape.d_model, shape.n_heads, shape.vocab) == (3, 64, 4, 500)
    with pytest.raises(ValueError, match="config.json"):
        ModelShape.from_hf_config(str(tmp_path / "missing"))


def _cli(argv: list[str]) -> int:
    import argparse

    p = argparse.ArgumentParser()
    COMMANDS["estimate"].add_arguments(p)
    return COMMANDS["estimate"].run(p.parse_args(argv))


def test_estimate_command(capsys) -> None:
    assert _cli(["--params", "1.3B", "--gpu-memory", "24GB", "--gpus", "4", "--cpu-memory", "256GB",
                 "--nvme", "1TB", "--batch", "2", "--seq-len", "1024"]) == 0
    out = capsys.readouterr().out
    assert "recommended (fastest that fits)" in out and "| stage 3 + optim→nvme |" in out
    assert _cli(["--params", "1.3B", "--gpu-memory", "24GB", "--gpus", "4", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["params"] == 1_300_000_000 and len(data["rows"]) == len(all_choices())
    assert _cli(["--params", "lots", "--gpu-memory", "24GB"]) == 2
    assert "cannot read 'lots'" in capsys.readouterr().err


def test_topology_scopes_and_tensor_parallelism() -> None:
    """Nodes x GPUs, TP degree and sharding scope: per-step bytes by link follow
    zeroshard/planner/traffic.py (checked against comm_report in tests/dist/test_hpz.py)."""
    from zeroshard.planner.traffic import Topology
    w = lambda scope, tp=1: Workload(mixed_precision="bf16", scope=scope, tp=tp)  # noqa: E731
    hw = Hardware(gpu_memory=10**15, n_gpus=8, nodes=4)
    flat, hybrid, hpz = (estimate(Choice(3), SHAPE, hw, w(s)) for s in ("flat", "hybrid", "hpz"))
    assert hybrid.traffic.inter_node < hpz.traffic.inter_node < flat.traffic.inter_node
    # k (g + 2b) / (g + b) with g = 4 (fp32 gradients), b = 2 (bf16), k = 8, less the root's one gather
    assert flat.traffic.inter_node / hpz.traffic.inter_node == pytest.approx(8 * 8 / 6, rel=0.05)
    assert flat.traffic.intra_node == 0 and hpz.traffic.intra_node == hybrid.traffic.intra_node > 0
    # hpZ holds the secondary partition (p·Ψ/k) on top of flat stage 3's states; hybrid shards over k
    assert hpz.gpu_states.secondary == 2 * SHAPE.n_params // 8
    assert hpz.gpu_states.model_states == flat.gpu_states.model_states + hpz.gpu_states.secondary
    assert hybrid.gpu_states.model_states > flat.gpu_states.model_states
    one_node = estimate(Choice(3), SHAPE, Hardware(gpu_memory=10**15, n_gpus=8), w("hpz"))
    assert one_node.traffic.inter_node == 0
    tp2 = estimate(Choice(3), SHAPE, hw, w("flat", tp=2))  # half the blocks per rank, half the dp ranks
    assert tp2.traffic.inter_node < flat.traffic.inter_node
    assert all(e.choice.stage == 3 for e in plan(SHAPE, hw, w("hpz")).estimates)
    with pytest.raises(ValueError, match="tp=3 must divide"):
        Topology(nodes=2, gpus_per_node=8, tp=3)
    with pytest.raises(ValueError, match="scope="):
        Workload(scope="mics")
    with pytest.raises(ValueError, match="scope='hpz'"):
        estimate(Choice(2), SHAPE, hw, w("hpz"))


def test_estimate_command_nodes_tp_scope(capsys) -> None:
    assert _cli(["--params", "7B", "--gpu-memory", "80GB", "--gpus", "8", "--nodes", "4", "--tp", "2",
                 "--scope", "hpz", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["nodes"], data["gpus_per_node"], data["tp"], data["scope"]) == (4, 8, 2, "hpz")
    assert all(r["config"].startswith("stage 3") and r["inter_node_bytes_per_step"] > 0 for r in data["rows"])
    # the secondary partition stays on the GPU under offload_params too (its collectives run there)
    assert len({r["gpu_secondary"] for r in data["rows"]}) == 1 and data["rows"][0]["gpu_secondary"] > 0
    assert _cli(["--params", "7B", "--gpu-memory", "80GB", "--gpus", "8", "--nodes", "2", "--scope", "hybrid"]) == 0
    out = capsys.readouterr().out
    assert "inter-node" in out and "mesh=mesh_2d" in out
    assert _cli(["--params", "7B", "--gpu-memory", "80GB", "--gpus", "8", "--tp", "3"]) == 2
    assert "tp=3 must divide" in capsys.readouterr().err
