"""LoRA fine-tuning with the real ``peft`` library on a ``transformers`` Llama: frozen weights
partitioned at stage 3 (Note [frozen units] in zeroshard/stages/stage3/frozen.py) and
checkpoints that hold what trains (Note [frozen weights in checkpoints]).

Parity: adapter weights after 8 steps (clipping on) against plain PEFT + torch.optim.AdamW
on one process with the same global batch — fp32 within 1e-5; a bf16 base (PEFT keeps the
adapters in fp32 over it) within the bound of tests/dist/test_parity.py, 1 bf16 ulp of the value
+ 1e-3 — and every base weight unchanged bit for bit.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("peft")

from tests.support import lora_worker as w  # noqa: E402
from tests.support.asserts import assert_same  # noqa: E402
from tests.support.dist_results import run_ranks, selected_params, together  # noqa: E402

CELLS = ([(s, d, None) for s in (0, 1, 2, 3) for d in ("fp32", "bf16")]
         + [(3, d, o) for o in ("cpu", "nvme") for d in ("fp32", "bf16")]
         + [(3, "fp32", None, True), (3, "bf16", "nvme", True)])  # with activation checkpointing


@pytest.fixture(scope="module")
def launched(request, tmp_path_factory):  # (world 1 beside world 2: Note [launches side by side])
    worlds = selected_params(request, "results", (1, 2))
    dirs = {world: tmp_path_factory.mktemp(f"lora{world}") for world in worlds}
    return together({world: (lambda world=world: run_ranks(w.worker, world, dirs[world], CELLS, str(dirs[world])))
                     for world in worlds})


@pytest.fixture(scope="module", params=[1, 2], ids=["world1", "world2"])
def results(request, launched):
    return request.param, launched[request.param]


@pytest.mark.parametrize("cell", CELLS, ids=[w.Cell(*c).key for c in CELLS])
def test_lora_adapters_match_plain_peft_and_the_base_stays_bitwise(results, cell):
    world, ranks = results
    key = w.Cell(*cell).key
    stage, dtype, offload = cell[:3]
    for rank, r in enumerate(ranks):
        res = r[key]
        assert "error" not in res, res.get("error")
        print(f"world {world} rank {rank} {key}: adapter max|diff| {res['adapter_diff']:.2e}, bf16 bound excess "
              f"{res['ulp_excess']:.2e}, base weights changed {len(res['base_changed'])}, frozen bytes in memory "
              f"{res['frozen_bytes']} / on NVMe {res['frozen_offloaded']} of {res['frozen_whole_bytes']}")
        assert res["adapter_moved"] > 1e-2, f"{key}: the adapters did not train"
        if dtype == "fp32":
            assert res["adapter_diff"] < 1e-5, res
        else:
            assert res["ulp_excess"] <= 0.0, res
        assert res["base_changed"] == [], res
        whole = res["frozen_whole_bytes"]
        if stage == 3:  # the base is partitioned: each rank holds its share, in memory or in the swap file
            held = res["frozen_offloaded"] if offload == "nvme" else res["frozen_bytes"]
            assert abs(held - whole / world) <= 0.05 * whole / world, res
            if offload == "nvme":
                assert res["frozen_bytes"] == 0, res
        else:
            assert res["frozen_bytes"] == whole, res


def test_frozen_base_per_rank_is_a_quarter_at_world_4(tmp_path):
    ranks = run_ranks(w.memory_worker, 4, tmp_path, str(tmp_path))
    for r in ranks:
        print(f"world 4: frozen base {r['whole']} B, per rank {r['frozen']} B in memory ({r['frozen'] / r['whole']:.4f}),"
              f" with offload_params='nvme' {r['frozen_nvme_resident']} B in memory and {r['frozen_nvme_file']} B in "
              f"the swap file; peak gathered {r['peak_gathered_frozen']} B, after backward {r['after_backward_gathered']}")
        quarter = r["whole"] / 4
        assert abs(r["frozen"] - quarter) <= 0.05 * quarter, r
        assert r["frozen_nvme_resident"] == 0, r
        assert abs(r["frozen_nvme_file"] - quarter) <= 0.05 * quarter, r
        # gathered in forward and backward, then released: never the whole base at once
        assert r["peak_gathered_frozen"] < 0.6 * r["whole"], r
        assert r["after_backward_gathered"] == 0, r


@pytest.mark.parametrize("spec", [(0, "fp32", None), (2, "bf16", None), (3, "fp32", "nvme"), (3, "bf16", "cpu")],
                         ids=lambda s: w.Cell(*s).key)
def test_lora_checkpoint_holds_what_trains_resumes_bitwise_and_checks_the_base(tmp_path, spec):
    ranks = run_ranks(w.ckpt_worker, 2, tmp_path, spec, str(tmp_path))
    print(f"{w.Cell(*spec).key}: checkpoint {ranks[0]['lean_bytes']} B (save_frozen=True: {ranks[0]['full_bytes']} B);"
          f" refused: {ranks[0]['refused'][:160]}")
    for r in ranks:
        assert r["lean"] == [], r  # resumed from what trains: bit for bit the uninterrupted run
        assert r["full_other_base"] == [], r  # save_frozen=True restores the base it was trained on
        assert r["lean_bytes"] < 0.5 * r["full_bytes"], r
        assert r["refused"] is not None and "another base model" in r["refused"], r
        assert "layers.1.mlp.up_proj" in r["refused"], r  # names the tensor that differs


def test_lora_checkpoint_resumes_at_another_world_size(tmp_path):
    for sub in ("a", "b"):
        (tmp_path / sub).mkdir()
    run_ranks(w.ckpt_worker, 2, tmp_path / "a", (3, "fp32", None), str(tmp_path))
    ranks = run_ranks(w.resume_worker, 1, tmp_path / "b", (3, "fp32", None), str(tmp_path))
    assert ranks[0]["diff"] == [], ranks[0]  # loaded at world 1: the saved state, bit for bit
    assert ranks[0]["final_diff"] < 1e-5, ranks[0]  # and trains on as the world-2 run did
    assert ranks[0]["refused"] is not None and "another base model" in ranks[0]["refused"]
    assert os.path.isdir(tmp_path / "lean")


@pytest.mark.parametrize("world", [1, 2])
def test_meta_start_loads_the_base_from_hf_files_and_inits_adapters_as_peft(tmp_path, world):
    base_dir = tmp_path / "base"
    w.base_model().save_pretrained(base_dir)
    ranks = run_ranks(w.meta_worker, world, tmp_path, str(base_dir), 3)
    for r in ranks:
        assert r["missing_non_adapter"] == [], r
        assert r["base_differs"] == [], r  # every base weight from the files, bit for bit
        assert r["lora_B_zero"] and r["lora_A_nonzero"] and 0 < r["lora_A_bound"] <= 0.125, r
        assert r["adapter_diff"] < 1e-5, r
        assert r["base_changed"] == [], r


@pytest.mark.parametrize("spec", [(3, "fp32", None), (3, "bf16", "nvme"), (2, "fp32", None)],
                         ids=lambda s: w.Cell(*s).key)
def test_exports_load_with_peft_and_from_pretrained(tmp_path, spec):
    r = run_ranks(w.export_worker, 2, tmp_path, spec, str(tmp_path))[0]
    print(f"{w.Cell(*spec).key}: merged vs PEFT merge_and_unload max|diff| {r['merged_diff']:.2e}, logits "
          f"{r['logits_diff']:.2e}, {r['shards']} shards")
    assert r["adapter_diff"] == [], r  # PeftModel.from_pretrained gives the trained adapters bit for bit
    assert r["merged_keys_differ"] == [], r
    assert r["shards"] > 1, r  # streamed into several shards
    # merged by PEFT's merge_and_unload vs streamed here: the same additions, rounding alike
    assert r["merged_diff"] <= (1e-6 if spec[1] == "fp32" else 2 ** -7), r
    assert r["logits_diff"] < (1e-4 if spec[1] == "fp32" else 0.1), r


def test_finetune_cli_lora_stage3_exports_resumes_bitwise_and_saves_only_adapters(tmp_path):
    """``finetune --lora-r`` at stage 3 (2 ranks, torchrun) from a pretrained directory, i.e. the
    meta-device start: SIGTERM at step 5 and the same command resume bit for bit; checkpoints
    hold the adapters; the adapter loads with PEFT and the merged export with from_pretrained."""
    import torch
    from peft import PeftModel
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.support import finetune_helpers as fh
    ws = fh.make_workspace(str(tmp_path))
    weights = str(tmp_path / "pretrained")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(ws.model_config)).save_pretrained(weights)
    flags = [f if f != "2" or prev != "--stage" else "3" for prev, f in zip(("",) + fh.FLAGS, fh.FLAGS)]
    lora = ["--lora-r", "4", "--lora-targets", "c_attn,c_fc", "--model", weights]

    def run(out: str, fault=None):
        cmd_args = ["--data", ws.data, "--output-dir", out, *flags, *lora]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
               str(fh.free_port()), fh.SCRIPT, *cmd_args]
        return subprocess.run(cmd, cwd=fh.REPO, env=fh.env(fault), capture_output=True, text=True, timeout=fh.TIMEOUT)

    ref_out, out = str(tmp_path / "ref"), str(tmp_path / "preempted")
    proc = run(ref_out)
    assert proc.returncode == 0, fh.describe(proc)
    first = run(out, fault="sigterm@1:5")
    assert first.returncode == 0, fh.describe(first)
    second = run(out)
    assert second.returncode == 0, fh.describe(second)
    from safetensors.torch import load_file
    a = load_file(os.path.join(ref_out, "hf", "adapter", "adapter_model.safetensors"))
    b = load_file(os.path.join(out, "hf", "adapter", "adapter_model.safetensors"))
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    step = os.path.join(out, "checkpoints", "step-00000010")
    data_bytes = sum(os.path.getsize(os.path.join(step, f)) for f in os.listdir(step) if f.endswith(".safetensors"))
    base_bytes = os.path.getsize(os.path.join(weights, "model.safetensors"))
    # adapters with their fp32 moments only (this tiny model's RNG and manifest JSON are as big)
    assert data_bytes < 0.3 * base_bytes, (data_bytes, base_bytes)
    base = AutoModelForCausalLM.from_pretrained(weights)
    peft_model = PeftModel.from_pretrained(base, os.path.join(ref_out, "hf", "adapter"))
    moved = max(float(v.abs().max()) for k, v in a.items() if "lora_B" in k)
    assert moved > 0, "the adapters did not train"
    want = peft_model.merge_and_unload().state_dict()
    merged = AutoModelForCausalLM.from_pretrained(os.path.join(ref_out, "hf")).state_dict()
    assert set(merged) == set(want)
    assert max(float((merged[k] - want[k]).abs().max()) for k in want) < 1e-6


def test_peft_config_file_is_read_as_peft_writes_it(tmp_path):
    from peft import LoraConfig

    from zeroshard.train.finetune_config import FinetuneConfig
    LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj"], lora_dropout=0.1).save_pretrained(str(tmp_path))
    cfg = FinetuneConfig(data="d.txt", output_dir=str(tmp_path / "o"), model_config="c.json",
                         peft_config=str(tmp_path / "adapter_config.json"))
    lora = cfg.lora_config()
    assert (lora.r, lora.lora_alpha, set(lora.target_modules), lora.lora_dropout) == (8, 16, {"q_proj"}, 0.1)
    flags = FinetuneConfig(data="d.txt", output_dir=str(tmp_path / "o"), model_config="c.json", lora_r=4,
                           lora_targets="q_proj, v_proj").lora_config()
    assert (flags.r, flags.lora_alpha, set(flags.target_modules)) == (4, 8, {"q_proj", "v_proj"})


def test_export_hf_refuses_a_checkpoint_without_its_base_and_close_hands_the_base_back(tmp_path):
    import torch
    import torch.distributed as dist

    import zeroshard
    from zeroshard.testing.launch import free_port
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        model = w.lora_model()
        before = {k: v.clone() for k, v in model.state_dict().items()}
        opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-2, stage=3)
        zeroshard.save_checkpoint(str(tmp_path / "lean"), 1, model=model, optimizer=opt)
        zeroshard.save_checkpoint(str(tmp_path / "full"), 1, model=model, optimizer=opt, save_frozen=True)
        with pytest.raises(ValueError, match="holds only what trains"):
            zeroshard.export_hf(str(tmp_path / "lean"), str(tmp_path / "hf-lean"))
        zeroshard.export_hf(str(tmp_path / "full"), str(tmp_path / "hf-full"))
        opt.close()  # every parameter, frozen ones too, whole again and usable without the optimizer
        after = model.state_dict()
        assert_same(after, before, "state dict after close")
        model(input_ids=w.tokens(0), labels=w.tokens(0)).loss.backward()
    finally:
        dist.destroy_process_group()


def test_planner_counts_lora_exactly_and_predicts_what_the_run_holds(tmp_path):
    import torch
    import torch.distributed as dist

    import zeroshard
    from zeroshard.testing.launch import free_port
    from zeroshard.planner.estimate import Choice, Hardware, Workload, estimate
    from zeroshard.planner.model_shape import ModelShape
    from zeroshard.planner.peft_shape import lora_counts
    w.llama_config().save_pretrained(str(tmp_path))
    total, trainable = lora_counts(str(tmp_path), 4, list(w.TARGETS))
    model = w.lora_model()
    assert (total, trainable) == (sum(p.numel() for p in model.parameters()),
                                  sum(p.numel() for p in model.parameters() if p.requires_grad))
    shape = ModelShape.from_hf_config(str(tmp_path))
    shape = type(shape)(**{**shape.__dict__, "n_params": total})
    work = Workload(mixed_precision=None, trainable_fraction=trainable / total)
    hw = Hardware(gpu_memory=2**34, n_gpus=1, accelerator=False)
    predicted = estimate(Choice(3), shape, hw, work).gpu_states
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-2, stage=3)
        model(input_ids=w.tokens(0), labels=w.tokens(0)).loss.backward()
        opt.step()
        measured = opt.memory_report()
        opt.close()
    finally:
        dist.destroy_process_group()
    assert abs(predicted.frozen - measured.frozen) <= 0.05 * measured.frozen, (predicted, measured)
    for field in ("parameters", "gradients", "optimizer_states"):  # padding to the alignment quantum aside
        got, want = getattr(measured, field), getattr(predicted, field)
        assert abs(got - want) <= 0.1 * want, (field, predicted, measured)
    quarter = estimate(Choice(3), shape, Hardware(gpu_memory=2**34, n_gpus=4, accelerator=False), work).gpu_states
    assert quarter.frozen == (total - trainable) * 4 // 4  # fp32 frozen bytes divided by the 4 ranks
