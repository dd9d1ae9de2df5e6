"""Edges of meshes and checkpoints: a mesh ZeroOptimizer cannot train correctly is refused (and
a hybrid mesh is read by its names), the frozen base a checkpoint expects is checked against
what the model holds now (however it was written), whole checkpoints unless the model is a
PEFT model over a base, ``export --base`` for the lean ones, and the CLI's exit status."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from torch import nn

import zeroshard
from zeroshard.checkpoint import frozen_base, manifest
from zeroshard.checkpoint.checkpoint_errors import CheckpointMismatchError
from zeroshard.cli import main as cli

from tests.support import mesh_refusal_worker

from tests.support import lora_worker
from tests.support.dist_results import run_ranks


# -- meshes ------------------------------------------------------------------------------------
def test_meshes_that_cannot_train_correctly_are_refused_and_dims_are_read_by_name(tmp_path):
    """dp 1 x tp 2 without DTensor parameters (each tp rank would train its own copy and both
    save as rank 0 into one root) is refused naming the fix, before the model is touched; a
    mesh without this rank says so (not torch's IndexError); a (dp_shard, dp_replicate) mesh
    shards over dp_shard, whatever its position; unknown names are refused with the accepted."""
    ranks = run_ranks(mesh_refusal_worker.mesh_worker, 2, tmp_path)
    for rank, r in enumerate(ranks):
        assert r["tp_without_dtensors"].startswith("ValueError") and "DTensor" in r["tp_without_dtensors"], r
        assert "parallelize_module" in r["tp_without_dtensors"] and "mesh['dp']" in r["tp_without_dtensors"], r
        assert r["model_intact"], r
        assert r["by_name"] == [2, 1, [[0, 1]]] and r["reversed"] == "accepted", r
        assert r["unknown_names"].startswith("ValueError") and "'ep'" in r["unknown_names"], r
        assert "dp_replicate" in r["unknown_names"] and "dp_shard" in r["unknown_names"], r
    assert ranks[0]["not_my_mesh"] == "accepted", ranks[0]
    assert ranks[1]["not_my_mesh"].startswith("ValueError") and "rank 1" in ranks[1]["not_my_mesh"], ranks[1]


# -- the frozen base ---------------------------------------------------------------------------
class Net(nn.Module):
    """A frozen "pretrained" layer (the same values for every seed) and a trained head."""

    def __init__(self, seed: int = 0, base_seed: int = 0) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(base_seed)
            self.base = nn.Linear(8, 8)
        self.base.requires_grad_(False)
        torch.manual_seed(seed)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.base(x))).square().mean()


def _trained(stage: int, seed: int = 0) -> tuple[nn.Module, zeroshard.ZeroOptimizer]:
    model = Net(seed)
    opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, stage=stage, lr=1e-2)
    model(torch.randn(4, 8, generator=torch.Generator().manual_seed(seed))).backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def _step(root: str, step: int) -> str:
    return os.path.join(root, manifest.step_dir_name(step))


@pytest.mark.parametrize("how", ["load_safetensors", "data_write"])
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_the_base_check_sees_writes_that_skip_the_version_counter(tmp_path, stage, how):
    """A lean checkpoint trained on base A, then base B written in place (load_safetensors,
    which copies through ``.data``, or ``p.data[...] = ...``): loading it is refused, and the
    next save records base B."""
    from safetensors.torch import save_file
    model, opt = _trained(stage)
    root = str(tmp_path / "ckpt")
    zeroshard.save_checkpoint(root, 1, model=model, optimizer=opt, save_frozen=False)
    other = Net(base_seed=7).base
    if how == "load_safetensors":
        values = {k: v.detach().clone() for k, v in model.state_dict().items()}
        values.update({"base.weight": other.weight.detach().clone(), "base.bias": other.bias.detach().clone()})
        save_file(values, str(tmp_path / "b.safetensors"))
        zeroshard.load_safetensors(model, str(tmp_path / "b.safetensors"))
    else:
        model.base.weight.data[...] = other.weight.detach()
    assert torch.equal(model.base.weight.detach(), other.weight.detach())
    with pytest.raises(CheckpointMismatchError, match="another base model"):
        zeroshard.load_checkpoint(_step(root, 1), model=model, optimizer=opt)
    zeroshard.save_checkpoint(root, 2, model=model, optimizer=opt, save_frozen=False)
    recorded = manifest.read(_step(root, 2))["frozen"]["tensors"]
    fresh = frozen_base.digests(model, opt, fresh=True)
    assert recorded == fresh and recorded != manifest.read(_step(root, 1))["frozen"]["tensors"]


def test_a_frozen_tensor_the_model_lacks_or_trains_is_refused_by_name(tmp_path):
    """The checkpoint expects frozen ``base.*``: a model without them, or one that trains them
    (they would come from nowhere), is refused naming them."""
    model, opt = _trained(1)
    root = str(tmp_path / "ckpt")
    zeroshard.save_checkpoint(root, 1, model=model, optimizer=opt, save_frozen=False)
    lacking = Net()
    lacking.base = nn.Identity()
    with pytest.raises(CheckpointMismatchError, match="base.weight"):
        zeroshard.load_checkpoint(root, model=lacking,
                                  optimizer=zeroshard.ZeroOptimizer(lacking, torch.optim.AdamW, stage=1, lr=1e-2))
    training = Net()
    training.base.requires_grad_(True)
    with pytest.raises(CheckpointMismatchError, match="base.weight.*trainable|trainable.*base.weight"):
        zeroshard.load_checkpoint(root, model=training,
                                  optimizer=zeroshard.ZeroOptimizer(training, torch.optim.AdamW, stage=1, lr=1e-2))


# -- whole checkpoints by default; export --base ------------------------------------------------
@pytest.mark.parametrize("stage", [1, 3])
def test_a_model_with_a_frozen_parameter_saves_whole_by_default(tmp_path, stage):
    """Not a PEFT model: the frozen weights are saved, so ``zeroshard export`` writes a whole
    model and a freshly initialised model (another base) resumes to the saved one."""
    model, opt = _trained(stage)
    root = str(tmp_path / "ckpt")
    zeroshard.save_checkpoint(root, 1, model=model, optimizer=opt)
    assert manifest.read(_step(root, 1))["frozen"]["saved"] is True
    assert cli(["export", root, str(tmp_path / "hf"), "--no-progress"]) == 0
    want = zeroshard.full_state_dict(model)
    fresh = Net(seed=3)
    fresh.base = Net(base_seed=3).base
    fresh_opt = zeroshard.ZeroOptimizer(fresh, torch.optim.AdamW, stage=stage, lr=1e-2)
    zeroshard.load_checkpoint(root, model=fresh, optimizer=fresh_opt)
    got = zeroshard.full_state_dict(fresh)
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)


def _peft_lean(tmp_path) -> tuple[nn.Module, str, str]:
    """A PEFT model's lean checkpoint (the default) and its base's Hugging Face directory."""
    base_dir = str(tmp_path / "base")
    lora_worker.base_model().save_pretrained(base_dir)
    model = lora_worker.lora_model()
    opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, stage=1, lr=1e-2)
    x = lora_worker.tokens(0)
    model(input_ids=x, labels=x).loss.backward()
    opt.step()
    root = str(tmp_path / "ckpt")
    zeroshard.save_checkpoint(root, 1, model=model, optimizer=opt)
    return model, root, base_dir


def _read_export(out: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    index = json.load(open(os.path.join(out, "model.safetensors.index.json")))
    got: dict[str, torch.Tensor] = {}
    for f in sorted(set(index["weight_map"].values())):
        got.update(load_file(os.path.join(out, f)))
    assert set(got) == set(index["weight_map"])
    return got


def test_a_peft_model_saves_lean_and_exports_whole_with_its_base(tmp_path, capsys):
    """The default keeps a PEFT model's base out; ``export --base DIR`` (and
    ``export_hf(..., base=DIR)``) fills it in from the base's safetensors, each tensor checked
    against the digest the checkpoint recorded; another base is refused naming a tensor."""
    model, root, base_dir = _peft_lean(tmp_path)
    body = manifest.read(_step(root, 1))
    assert body["frozen"]["saved"] is False and not set(body["frozen"]["tensors"]) & set(body["tensors"])
    assert cli(["export", root, str(tmp_path / "no-base"), "--no-progress"]) == 1
    assert "--base" in capsys.readouterr().err
    assert cli(["export", root, str(tmp_path / "hf"), "--base", base_dir, "--no-progress"]) == 0
    want = {k: v.detach() for k, v in model.state_dict().items()}
    for out in (str(tmp_path / "hf"), str(tmp_path / "api")):
        if out.endswith("api"):
            zeroshard.export_hf(root, out, base=base_dir)
        got = _read_export(out)
        assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    other = lora_worker.base_model()
    with torch.no_grad():
        other.model.layers[1].mlp.up_proj.weight.add_(1e-3)
    other_dir = str(tmp_path / "other")
    other.save_pretrained(other_dir)
    assert cli(["export", root, str(tmp_path / "wrong"), "--base", other_dir, "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "layers.1.mlp.up_proj" in err and "digest" in err, err
    assert not os.path.exists(str(tmp_path / "wrong" / "model.safetensors.index.json"))


# -- the command line and save's arguments -----------------------------------------------------
def _plain_root(tmp_path) -> str:
    model = nn.Sequential(nn.Linear(6, 4), nn.Linear(4, 2))
    opt = zeroshard.ZeroOptimizer(model, torch.optim.SGD, stage=1, lr=0.1)
    root = str(tmp_path / "ckpt")
    for step in (1, 2):
        zeroshard.save_checkpoint(root, step, model=model, optimizer=opt)
    return root


def test_inspect_exits_non_zero_on_an_invalid_step(tmp_path, capsys):
    root = _plain_root(tmp_path)
    data = os.path.join(_step(root, 2), "rank-00000.safetensors")
    with open(data, "r+b") as f:
        f.truncate(os.path.getsize(data) - 1)
    assert cli(["inspect", _step(root, 1)]) == 0
    assert cli(["inspect", _step(root, 2)]) == 1
    assert cli(["inspect", root]) == 1
    assert cli(["inspect", root, "--json"]) == 1
    assert "INVALID" in capsys.readouterr().out


def test_verify_reports_the_latest_step_when_it_is_a_symlink_out_of_the_root(tmp_path, capsys):
    root = _plain_root(tmp_path)
    outside = str(tmp_path / "elsewhere")
    os.makedirs(outside)
    shutil.move(_step(root, 2), os.path.join(outside, "step-00000002"))
    os.symlink(os.path.join(outside, "step-00000002"), _step(root, 2))
    assert open(os.path.join(root, manifest.LATEST)).read().strip() == "step-00000002"
    assert cli(["verify", root]) == 1
    printed = capsys.readouterr()
    assert "step-00000002" in printed.out + printed.err and "symlink" in printed.out + printed.err, printed


def test_save_checkpoint_without_model_or_optimizer_is_refused(tmp_path):
    with pytest.raises(ValueError, match="model=.*optimizer="):
        zeroshard.save_checkpoint(str(tmp_path / "ckpt"), 1, model=None, optimizer=None)
    assert not os.path.exists(str(tmp_path / "ckpt"))
