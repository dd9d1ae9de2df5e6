"""The typed engine boundary (issue 44): the facade forwards nothing by name, consumers read the
engine's typed attributes, and the typed configuration forms build the same optimizer as the
string forms, bit for bit."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import zeroshard
from tests.support.models import TinyNet, batch
from zeroshard import AutoOffload, CPUOffload, NVMeOffload, ZeroConfig
from zeroshard.optim.zero_engine import Engine
from zeroshard.optim.zero_optimizer import engine_of


def _train(steps: int = 3, **kw) -> tuple[list[torch.Tensor], zeroshard.ZeroOptimizer]:
    torch.manual_seed(0)
    model = TinyNet()
    opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-2, **kw)
    for step in range(steps):
        model(batch(step, 4)).backward()
        opt.step()
        opt.zero_grad()
    weights = [p.detach().clone() for p in model.parameters()]
    return weights, opt


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    for i, (x, y) in enumerate(zip(a, b)):
        assert torch.equal(x, y), f"parameter {i} differs: max |diff| {(x - y).abs().max().item()}"


def test_the_facade_forwards_no_engine_names():
    _, opt = _train(1)
    assert "__getattr__" not in type(opt).__dict__
    for name in ("comm", "runs", "swapper", "gatherer", "placement", "reducer", "scaler", "config", "mesh"):
        with pytest.raises(AttributeError, match=name):
            getattr(opt, name)
    # what stays for users is typed and reads the engine's own objects
    assert opt.units is opt.engine.units and opt.inner is opt.engine.inner
    assert opt.all_units == opt.engine.all_units
    opt.close()


def test_engine_of_takes_a_zero_optimizer_or_nothing():
    _, opt = _train(1)
    assert isinstance(engine_of(opt), Engine) and engine_of(opt) is opt.engine
    plain = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    assert engine_of(plain) is None and engine_of(None) is None
    opt.close()


def test_segment_index_is_the_engines():
    _, opt = _train(1)
    assert opt.segment_index() == opt.engine.segment_index()
    assert len(opt.segment_index()) >= len([p for p in opt.engine.module.parameters() if p.requires_grad])
    opt.close()


def test_typed_offload_builds_what_the_strings_build(tmp_path):
    cases = [
        (dict(stage=1, offload_optimizer="cpu"), dict(stage=1, offload=CPUOffload())),
        (dict(stage=2, offload_optimizer="nvme", nvme_path=str(tmp_path)),
         dict(config=ZeroConfig(stage=2, offload=NVMeOffload(path=str(tmp_path))))),
        (dict(stage=3, offload_optimizer="nvme", offload_params="nvme", nvme_path=str(tmp_path)),
         dict(stage=3, offload=NVMeOffload(path=str(tmp_path), params=True))),
    ]
    for strings, typed in cases:
        a, oa = _train(**strings)
        b, ob = _train(**typed)
        _same(a, b)
        assert oa.engine.config.offload_options == ob.engine.config.offload_options, (strings, typed)
        assert oa.engine.config.placement == ob.engine.config.placement
        oa.close()
        ob.close()


def test_typed_offload_round_trips_through_the_config(tmp_path):
    for typed in (CPUOffload(pin_memory=False), CPUOffload(params=True), NVMeOffload(path=str(tmp_path), buffer_mb=64.0),
                  NVMeOffload(path=str(tmp_path), params=True), AutoOffload(budget={"host": "4GiB"})):
        stage = 3 if getattr(typed, "params", False) else 2
        assert ZeroConfig(stage=stage, offload=typed).offload_options == typed
    assert ZeroConfig().offload_options is None
    assert ZeroConfig(offload="auto", memory_budget={"host": "1GiB"}).offload_options == AutoOffload(budget={"host": "1GiB"})


def test_typed_and_string_offload_together_are_refused(tmp_path):
    with pytest.raises(ValueError, match="offload_optimizer='cpu'"):
        ZeroConfig(offload=CPUOffload(), offload_optimizer="cpu")
    with pytest.raises(ValueError, match="nvme_path"):
        ZeroConfig(offload=NVMeOffload(path=str(tmp_path)), nvme_path=str(tmp_path))
    with pytest.raises(ValueError, match="needs stage=3"):  # the same rules as the strings
        ZeroConfig(stage=2, offload=CPUOffload(params=True))
    with pytest.raises(TypeError, match="NVMeOffload"):
        NVMeOffload(path=None)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        ZeroConfig(2)  # type: ignore[misc]  # (keyword-only: a positional value names no field)
    for form in (dict(offload_optimizer="cpu"), dict(offload=CPUOffload())):  # (one rule with the planner's)
        with pytest.raises(ValueError, match="stage >= 1"):
            ZeroConfig(stage=0, **form)


def test_config_object_beside_the_same_options_is_refused_naming_them():
    config = ZeroConfig(stage=3)
    with pytest.raises(ValueError, match="stage=1"):
        _train(1, config=config, stage=1)
    with pytest.raises(ValueError, match="bucket_size_mb"):
        _train(1, config=config, bucket_size_mb=3)
    with pytest.raises(TypeError, match="ZeroConfig"):
        _train(1, config={"stage": 3})
    a, oa = _train(config=dataclasses.replace(config, stage=1))
    b, ob = _train(stage=1)
    _same(a, b)
    assert oa.stage == ob.stage == 1
    oa.close()
    ob.close()


def test_add_param_group_rebuilds_from_a_config_object():
    torch.manual_seed(0)
    model = TinyNet()
    rest = [p for n, p in model.named_parameters() if p.requires_grad and not n.startswith("head")]
    head = list(model.head.parameters())
    opt = zeroshard.ZeroOptimizer(rest, torch.optim.AdamW, module=model, lr=1e-2, config=ZeroConfig(stage=1))
    model(batch(0, 4)).backward()
    opt.step()
    opt.zero_grad()
    opt.add_param_group({"params": head, "lr": 1e-3})
    assert opt.stage == 1 and opt.param_groups[-1]["lr"] == 1e-3
    model(batch(1, 4)).backward()
    opt.step()
    opt.close()


def test_cross_axis_refusals_live_in_check_composition(tmp_path):
    from zeroshard.comm.mesh import FlatMesh
    from zeroshard.comm.pipeline import PipelineParallel
    from zeroshard.comm.process_group import Comm
    from zeroshard.optim.composition import check_composition

    pp = FlatMesh(Comm(None), pp=PipelineParallel(Comm(None), 0, 2, (0, 1), True))
    check_composition(ZeroConfig(stage=2), pp)
    for config, says in ((ZeroConfig(stage=3), "stage=3 with pipeline parallelism"),
                         (ZeroConfig(stage=2, offload=NVMeOffload(path=str(tmp_path))), "NVMe offload with pipeline"),
                         (ZeroConfig(stage=3, hpz=True), "stage=3 with pipeline")):
        with pytest.raises(ValueError, match=says):
            check_composition(config, pp)
    check_composition(ZeroConfig(stage=3), FlatMesh(Comm(None)))  # (no pp, no tp: nothing to refuse)


def test_the_stage_is_one_typed_answer():
    _, opt = _train(1, stage=2)
    assert not opt.engine.shards_parameters
    with pytest.raises(RuntimeError, match="stage=2 keeps parameters whole"):
        opt.engine.stage3_gatherer
    _, opt3 = _train(1, stage=3)
    assert opt3.engine.shards_parameters
    assert opt3.engine.stage3_gatherer is opt3.engine.gatherer
