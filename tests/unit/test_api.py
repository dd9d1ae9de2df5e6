"""Single-process behaviour of the public surface and the errors bad input gets."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import zeroshard
from tests.support.models import TinyNet, batch
from tests.support.asserts import assert_close_named, assert_same


def _opt(model=None, cls=torch.optim.AdamW, **kw):
    return zeroshard.ZeroOptimizer(model or TinyNet(), cls, **{"lr": 1e-3, **kw})


def test_is_a_torch_optimizer_with_the_users_param_groups():
    model = TinyNet()
    opt = _opt(model, stage=2)
    assert isinstance(opt, torch.optim.Optimizer)
    assert [id(p) for p in opt.param_groups[0]["params"]] == [id(p) for p in model.parameters()]
    assert opt.param_groups[0]["lr"] == 1e-3 and opt.defaults["lr"] == 1e-3


def test_zero_grad_keep_and_set_to_none_both_restart_accumulation():
    for set_to_none in (True, False):
        torch.manual_seed(0)
        model = TinyNet()
        opt = _opt(model, cls=torch.optim.SGD, lr=0.1)
        ref = TinyNet()
        ref.load_state_dict(model.state_dict())
        ropt = torch.optim.SGD(ref.parameters(), lr=0.1)
        for step in range(3):
            for m, o in ((model, opt), (ref, ropt)):
                m(batch(step, 4)).backward()
                o.step()
                o.zero_grad(set_to_none=set_to_none)
        assert_close_named(ref.parameters(), model.parameters(), "parameters vs torch.optim", atol=1e-6)
        for p, q in zip(model.parameters(), ref.parameters()):  # None, or zeros, as torch leaves them
            assert (p.grad is None) == (q.grad is None)
            if q.grad is not None:
                assert torch.equal(p.grad, q.grad)


def test_clip_returns_the_global_norm_like_torch():
    torch.manual_seed(0)
    model = TinyNet()
    ref = TinyNet()
    ref.load_state_dict(model.state_dict())
    opt = _opt(model, stage=1)
    model(batch(0, 4)).backward()
    ref(batch(0, 4)).backward()
    for norm_type in (2.0, 1.0, float("inf")):
        expect = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9, norm_type=norm_type)
        got = opt.clip_grad_norm_(1e9, norm_type=norm_type)
        assert got.item() == pytest.approx(expect.item(), rel=1e-5)


def test_memory_report_categories():
    rep = _opt(stage=0).memory_report()
    assert set(rep.as_dict()) == {"parameters", "gradients", "master_weights", "optimizer_states",
                                  "buffers", "offloaded", "model_states", "frozen"}  # (TinyNet's frozen layer)
    assert rep.parameters > 0 and rep.gradients > 0 and rep.master_weights == 0


# -- bad input -------------------------------------------------------------------------------
def test_an_optimizer_that_couples_all_parameters_is_refused():
    with pytest.raises(ValueError, match="elementwise"):
        _opt(cls=torch.optim.LBFGS)
    # (one that reads whole tensors takes the whole-tensor path: tests/dist/test_whole_tensor.py)
    assert isinstance(_opt(cls=torch.optim.Adafactor), zeroshard.ZeroOptimizer)
    with pytest.raises(TypeError, match="class"):
        zeroshard.ZeroOptimizer(TinyNet(), torch.optim.AdamW(TinyNet().parameters()))


def test_custom_optimizer_can_declare_itself_elementwise():
    class Sign(torch.optim.SGD):
        zeroshard_elementwise = True
    assert isinstance(_opt(cls=Sign, lr=0.1), zeroshard.ZeroOptimizer)


def test_stage3_needs_a_module():
    with pytest.raises(ValueError, match="nn.Module"):
        zeroshard.ZeroOptimizer(list(TinyNet().parameters()), torch.optim.AdamW, stage=3)


def test_parameters_on_different_devices():
    a = nn.Parameter(torch.zeros(3))
    b = nn.Parameter(torch.zeros(3, device="meta"))
    with pytest.raises(ValueError, match="different devices"):
        zeroshard.ZeroOptimizer([a, b], torch.optim.SGD, lr=0.1)


@pytest.mark.parametrize("kwargs, match", [
    (dict(stage=5), "stage=5"),
    (dict(stage="2"), "stage='2'"),
    (dict(mixed_precision="fp8"), "mixed_precision='fp8'"),
    (dict(offload_optimizer="disk"), "offload_optimizer='disk'"),
    (dict(offload_params="cpu", stage=2), "needs stage=3"),
    (dict(offload_optimizer="nvme"), "nvme_path"),
    (dict(bucket_size_mb=0), "bucket_size_mb"),
    (dict(stagee=2), "unknown option"),
    (dict(betas=(0.9, 0.99), momentumm=0.1), "momentumm"),
])
def test_unknown_or_invalid_options_name_the_problem(kwargs, match):
    with pytest.raises(ValueError, match=match):
        _opt(**kwargs)


def test_state_dict_from_a_different_model():
    torch.manual_seed(0)
    a = _opt(TinyNet())
    a_model = a.engine.module
    a_model(batch(0, 4)).backward()
    a.step()
    other = _opt(nn.Sequential(nn.Linear(15, 7), nn.Linear(7, 1)))
    with pytest.raises(ValueError, match="param"):
        other.load_state_dict(a.state_dict())
    with pytest.raises(ValueError, match="param"):
        other.load_state_dict(a.consolidated_state_dict())


def test_frozen_parameters_stay_untouched_and_unsharded():
    torch.manual_seed(0)
    model = TinyNet()
    frozen = model.frozen.weight.detach().clone()
    opt = _opt(model, stage=2)
    model(batch(0, 4)).backward()
    opt.step()
    assert torch.equal(model.frozen.weight, frozen)
    names = {seg.name for u in opt.units for seg in u.layout.segments}
    assert "frozen.weight" not in names and "fc1.weight" in names


def test_fp16_without_scaled_loss_is_an_error():
    model = TinyNet()
    opt = _opt(model, mixed_precision="fp16")
    model(batch(0, 4)).backward()
    with pytest.raises(RuntimeError, match="scale_loss"):
        opt.step()


class _SGDWithHpz(torch.optim.SGD):
    """An optimizer with an argument named like a zeroshard option."""
    zeroshard_elementwise = True

    def __init__(self, params, lr: float = 0.1, hpz: int = 7):
        super().__init__(params, lr=lr)
        self.hpz_seen = hpz


def test_optimizer_kwargs_go_to_the_inner_optimizer_only():
    """A name that is both a zeroshard option and an argument of the optimizer is refused in
    **kwargs (naming optimizer_kwargs); through optimizer_kwargs it reaches the optimizer, and the
    keywords stay zeroshard's. Today's call (inner arguments as keywords) is unchanged."""
    with pytest.raises(TypeError, match=r"\['hpz'\] is both a ZeroOptimizer option and an argument of _SGDWithHpz.*optimizer_kwargs"):
        zeroshard.ZeroOptimizer(TinyNet(), _SGDWithHpz, lr=0.1, hpz=2)
    opt = zeroshard.ZeroOptimizer(TinyNet(), _SGDWithHpz, stage=1, optimizer_kwargs={"lr": 0.2, "hpz": 3})
    assert opt.inner.hpz_seen == 3 and opt.param_groups[0]["lr"] == 0.2 and opt.engine.config.hpz != 3
    opt.close()
    with pytest.raises(TypeError, match=r"\['lr'\] given both as keywords and in optimizer_kwargs"):
        zeroshard.ZeroOptimizer(TinyNet(), torch.optim.AdamW, lr=0.1, optimizer_kwargs={"lr": 0.2})
    with pytest.raises(TypeError, match="optimizer_kwargs must be a dict"):
        zeroshard.ZeroOptimizer(TinyNet(), torch.optim.AdamW, optimizer_kwargs=[("lr", 0.2)])
    # the same training either way
    torch.manual_seed(0)
    a, b = TinyNet(), TinyNet()
    b.load_state_dict(a.state_dict())
    oa = zeroshard.ZeroOptimizer(a, torch.optim.AdamW, lr=1e-2, betas=(0.8, 0.9), stage=2)
    ob = zeroshard.ZeroOptimizer(b, torch.optim.AdamW, stage=2, optimizer_kwargs={"lr": 1e-2, "betas": (0.8, 0.9)})
    for model, opt in ((a, oa), (b, ob)):
        for step in range(3):
            model(batch(step, 4)).backward()
            opt.step()
            opt.zero_grad()
    assert_same(b.parameters(), a.parameters(), "parameters")
    oa.close()
    ob.close()
