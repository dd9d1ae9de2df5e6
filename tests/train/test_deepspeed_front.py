"""``import zeroshard as deepspeed``: a DeepSpeed script trains as under the real DeepSpeed.

The spawned runs (tests/support/ds_front_worker.py) execute one DeepSpeed-style script with the real
DeepSpeed (CPU, gloo, torch_adam) and with zeroshard's front, stages 0-3, in one spawn per
world size. The in-process tests check the engine against torch.optim on one process, and
what the front refuses.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import warnings

import pytest
import torch

import zeroshard
import zeroshard as deepspeed
from tests.support import ds_front_worker as worker
from zeroshard.testing.launch import spawn
from zeroshard.train.schedules import WarmupLR

HAVE_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
RTOL = 1e-5


def _rel(a: dict, b: dict) -> float:
    return max(float((torch.tensor(a[k]) - torch.tensor(b[k])).abs().max() / torch.tensor(b[k]).abs().max())
               for k in b)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{world: {rank: results}}; world 2 runs first (world 1 resumes what it converted)."""
    if not HAVE_DEEPSPEED:
        pytest.skip("deepspeed is not installed (pip install deepspeed; CPU: DS_BUILD_OPS=0)")
    out = str(tmp_path_factory.mktemp("ds_front"))
    results: dict = {"out": out}
    for world in (2, 1):
        spawn(worker.run, world, out, True, threads=1)
        results[world] = {}
        for rank in range(world):
            with open(os.path.join(out, f"results-w{world}-r{rank}.json")) as f:
                results[world][rank] = json.load(f)
    return results


@pytest.mark.parametrize("world", [1, 2])
def test_script_trains_as_under_real_deepspeed(runs, world):
    for rank, res in runs[world].items():
        for stage in map(str, worker.STAGES):
            zs, ds = res["zeroshard"][stage], res["deepspeed"][stage]
            for phase in ("straight", "resumed"):
                assert zs[phase]["lrs"] == ds[phase]["lrs"], (world, rank, stage, phase)
                assert zs[phase]["global_steps"] == ds[phase]["global_steps"]
                diff = _rel(zs[phase]["weights"], ds[phase]["weights"])
                assert diff < RTOL, f"world {world} rank {rank} stage {stage} {phase}: {diff:.2e}"
                for a, b in zip(zs[phase]["norms"], ds[phase]["norms"]):
                    if b is not None:  # (DeepSpeed's stage 0 does not measure the norm)
                        assert a == pytest.approx(b, rel=RTOL)
            assert len(zs["straight"]["lrs"]) == worker.FIRST + worker.THEN


@pytest.mark.parametrize("world", [1, 2])
def test_resume_is_identical_and_returns_client_state(runs, world):
    for res in runs[world].values():
        for stage in map(str, worker.STAGES):
            zs, ds = res["zeroshard"][stage], res["deepspeed"][stage]
            assert zs["resumed"]["weights"] == zs["straight"]["weights"], f"stage {stage}: resume differs"
            assert zs["resumed"]["lrs"] == zs["straight"]["lrs"][worker.FIRST:]
            assert zs["resumed"]["client"] == ds["resumed"]["client"] == {"micro": worker.FIRST * worker.ACCUM,
                                                                          "note": "from the script"}


@pytest.mark.parametrize("world", [1, 2])
def test_converted_deepspeed_checkpoint_resumes_as_deepspeed_does(runs, world):
    """DeepSpeed wrote stage 2 and 3 checkpoints on 2 ranks; converted, zeroshard resumes them on
    ``world`` ranks and takes the steps DeepSpeed's own resume took."""
    for stage in map(str, worker.CONVERT_STAGES):
        ds = runs[2][0]["deepspeed"][stage]["resumed"]
        for rank, res in runs[world].items():
            got = res["converted"][stage]
            assert got["lrs"] == ds["lrs"] and got["global_steps"] == ds["global_steps"], (stage, world, rank)
            assert got["client"] == ds["client"]
            diff = _rel(got["weights"], ds["weights"])
            assert diff < RTOL, f"stage {stage} world {world} rank {rank}: {diff:.2e}"


def test_convert_command_writes_a_loadable_checkpoint(runs, tmp_path):
    from zeroshard.cli import main
    src = os.path.join(runs["out"], "ds-w2-stage3")
    assert main(["convert-deepspeed", src, str(tmp_path / "zs"), "--tag", f"global_step{worker.FIRST}"]) == 0
    model = worker.make_model()
    opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, stage=1, lr=1e-3)
    info = zeroshard.load_checkpoint(str(tmp_path / "zs"), model=model, optimizer=opt)
    assert info["step"] == worker.FIRST and info["extra"]["client_state"]["note"] == "from the script"
    assert info["extra"]["converted_from"]["world_size"] == 2
    assert main(["convert-deepspeed", str(tmp_path / "nowhere"), str(tmp_path / "x")]) == 1


@pytest.mark.parametrize("stage", worker.CONVERT_STAGES)
def test_convert_bf16_with_frozen_weights_and_groups(runs, tmp_path, stage):
    """fp32 masters exactly as DeepSpeed's zero_to_fp32 reconstructs them; the frozen weight, the
    groups' weight decay and Adam's step come along."""
    from zeroshard.deepspeed_compat.convert import convert_deepspeed
    path = convert_deepspeed(os.path.join(runs["out"], f"ds-w2-bf16-stage{stage}"), str(tmp_path / "zs"))
    model = worker.make_model()
    model[0].bias.requires_grad_(False)
    groups = [{"params": [model[0].weight, model[2].weight, model[4].weight]},
              {"params": [model[2].bias, model[4].bias]}]
    opt = zeroshard.ZeroOptimizer(groups, torch.optim.AdamW, stage=1, module=model, mixed_precision="bf16")
    zeroshard.load_checkpoint(path, model=model, optimizer=opt)
    want = runs[2][0]["bf16_fp32"][str(stage)]
    masters = {seg.name: u.master[seg.offset:seg.end] for u in opt.units for seg in u.layout.segments}
    assert set(masters) | {"0.bias"} == set(want)
    for name, m in masters.items():
        assert torch.equal(m, torch.tensor(want[name]).reshape(-1)), name
    assert torch.equal(model[0].bias.float(), torch.tensor(want["0.bias"]))
    assert [g["weight_decay"] for g in opt.param_groups] == [0.05, 0.0]
    assert float(opt.consolidated_state_dict()["state"][0]["step"]) == 2


def test_gathered_parameters_reads_and_writes_stage3_weights(runs):
    for stage in ("2", "3"):
        for rank, res in runs[2].items():
            g = res["gathered"][stage]
            assert g["shape"] == [16, 8], (stage, rank)
            assert g["w0"] == [0.25] and g["b2"] == [-1.0], (stage, rank, g)  # the modifier rank's values
            assert g["w4_unchanged"]
            # The next step trained from the written values (fp32 masters took them): a small move.
            assert 0 < g["moved_from_0.25"] < 0.01, (stage, rank, g)


# -- one process, no DeepSpeed needed ------------------------------------------------------------
class _Shell:
    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_restricted_unpickler_refuses_code_and_reads_tensors(tmp_path):
    import collections
    import pickle
    from zeroshard.deepspeed_compat.restricted_unpickler import load_pt
    evil = _Shell()
    evil.marker = str(tmp_path / "ran")
    torch.save({"w": torch.ones(2), "payload": evil}, tmp_path / "evil.pt")
    with pytest.raises(pickle.UnpicklingError, match=r"refusing to unpickle posix\.system"):
        load_pt(str(tmp_path / "evil.pt"))
    assert not os.path.exists(evil.marker)
    good = {"a": torch.arange(6.).view(2, 3)[:, 1:], "b": collections.OrderedDict(x=torch.Size([2])),
            "c": [torch.tensor(1, dtype=torch.int64), torch.zeros(0, dtype=torch.bfloat16)], "d": (1, "s", None)}
    good["e"] = good["a"]  # (shared storage stays shared)
    torch.save(good, tmp_path / "good.pt")
    back = load_pt(str(tmp_path / "good.pt"))
    assert torch.equal(back["a"], good["a"]) and back["b"] == good["b"] and back["d"] == good["d"]
    assert back["c"][1].dtype == torch.bfloat16 and back["e"].data_ptr() == back["a"].data_ptr()
    (tmp_path / "legacy.pt").write_bytes(pickle.dumps({"w": 1}))
    with pytest.raises(ValueError, match="zip"):
        load_pt(str(tmp_path / "legacy.pt"))

def _reference(steps: int, stage_model: torch.nn.Module) -> dict:
    """The same training with torch.optim.AdamW, clip_grad_norm_ and a WarmupLR, by hand."""
    ref = worker.make_model()
    opt = torch.optim.AdamW(ref.parameters(), lr=2e-2, betas=(0.9, 0.99), weight_decay=0.05)
    sched = WarmupLR(opt, 2e-3, 2e-2, 4, "linear")
    for micro in range(steps * worker.ACCUM):
        x, y = worker.batch(micro, 0, 1)
        (torch.nn.functional.mse_loss(ref(x), y) / worker.ACCUM).backward()
        if micro % worker.ACCUM == worker.ACCUM - 1:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.3)
            opt.step()
            sched.step()
            opt.zero_grad()
    return {n: p.detach() for n, p in ref.named_parameters()}


@pytest.mark.parametrize("stage", [0, 3])
def test_engine_matches_torch_adamw_on_one_process(tmp_path, stage):
    model = worker.make_model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (torch_adam is a noted key)
        engine, optimizer, loader, scheduler = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=worker.config(stage, 1))
    assert isinstance(engine, deepspeed.deepspeed_compat.DeepSpeedEngine) and loader is None
    assert optimizer is engine.optimizer and scheduler is engine.lr_scheduler and engine.module is model
    assert engine.gradient_accumulation_steps() == 2 and engine.train_micro_batch_size_per_gpu() == 8
    assert engine.device == torch.device("cpu")
    boundaries = []
    for micro in range(2 * worker.ACCUM):
        x, y = worker.batch(micro, 0, 1)
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        boundaries.append(engine.is_gradient_accumulation_boundary())
        engine.step()
    assert boundaries == [False, True, False, True] and engine.global_steps == 2
    assert engine.save_checkpoint(str(tmp_path), client_state={"epoch": 3, "t": torch.arange(3)})
    assert (tmp_path / "latest").read_text() == "global_step2"
    for micro in range(2 * worker.ACCUM, 4 * worker.ACCUM):
        x, y = worker.batch(micro, 0, 1)
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()
    want = _reference(4, model)
    full = zeroshard.full_state_dict(model)
    for name, ref in want.items():
        assert float((full[name] - ref).abs().max() / ref.abs().max()) < RTOL, name
    assert engine.get_global_grad_norm() > 0 and engine.get_lr() == [scheduler.get_last_lr()[0]]
    path, client = engine.load_checkpoint(str(tmp_path))
    assert path.startswith(str(tmp_path / "global_step2")) and engine.global_steps == 2
    assert client["epoch"] == 3 and torch.equal(client["t"], torch.arange(3))
    engine.eval()
    assert not model.training


def test_load_without_latest_returns_none_and_tags_are_names(tmp_path):
    model = worker.make_model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, *_ = deepspeed.initialize(model=model, config=worker.config(2, 1))
    with pytest.warns(UserWarning, match="latest"):
        assert engine.load_checkpoint(str(tmp_path)) == (None, None)
    for bad in ("../x", "a/b", ".."):
        with pytest.raises(ValueError, match="one directory name"):
            engine.save_checkpoint(str(tmp_path), tag=bad)
    (tmp_path / "latest").write_text("../../etc")
    with pytest.raises(ValueError, match="one directory name"):
        engine.load_checkpoint(str(tmp_path))


def test_unsupported_config_and_arguments_are_refused_by_name():
    model = worker.make_model()
    cfg = {**worker.config(2, 1), "activation_checkpointing": {"partition_activations": True},
           "zero_optimization": {"stage": 2, "zero_hpz_partition_size": 2}}
    with pytest.raises(ValueError) as err:
        deepspeed.initialize(model=model, config=cfg)
    assert "activation_checkpointing.partition_activations" in str(err.value)
    assert "zero_optimization.zero_hpz_partition_size" in str(err.value)
    with pytest.raises(ValueError, match="mpu"):
        deepspeed.initialize(model=model, config=worker.config(2, 1), mpu=object())
    with pytest.raises(TypeError, match="stage"):
        deepspeed.initialize(model=model, config=worker.config(2, 1), stage=2)
    with pytest.raises(AttributeError, match="Init is not supported"):
        deepspeed.zero.Init


def test_config_arguments_and_both_forms_of_initialize(tmp_path):
    parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
    path = tmp_path / "ds.json"
    cfg = worker.config(3, 1)
    path.write_text(json.dumps(cfg))
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", str(path)])
    model = worker.make_model()
    groups = [{"params": [p for n, p in model.named_parameters() if n.endswith("weight")]},
              {"params": [p for n, p in model.named_parameters() if n.endswith("bias")], "weight_decay": 0.0}]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, opt, loader, sched = deepspeed.initialize(
            args=args, model=model, model_parameters=groups,
            training_data=torch.utils.data.TensorDataset(torch.randn(20, 8), torch.randn(20, 4)))
        assert opt.stage == 3 and [g["weight_decay"] for g in opt.param_groups] == [0.05, 0.0]
        assert len(loader) == 3 and next(iter(loader))[0].shape == (8, 8)
        # zeroshard's own form: the model first, three values; param groups at stage 3 too
        model2 = worker.make_model()
        out = zeroshard.initialize(model2, cfg, model_parameters=[{"params": list(model2.parameters())}])
        assert len(out) == 3 and out[0] is model2 and out[1].stage == 3
    with pytest.raises(ValueError, match="both"):
        deepspeed.initialize(args=args, model=worker.make_model(), config=cfg)
