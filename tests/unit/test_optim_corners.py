"""Issue 39 section 3: the corners of torch.optim a drop-in optimizer must match (single
process; the multi-rank cases run in tests/support/corners_worker.py). Each failed before its fix."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import zeroshard
from tests.support.group_state_optim import DistanceAdapted
from tests.support.dist_results import run_ranks
from tests.support.models import TinyNet, batch


def _pair(seed: int = 0) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(seed)
    model, ref = TinyNet(), TinyNet()
    ref.load_state_dict(model.state_dict())
    return model, ref


def _maxdiff(a: nn.Module, b: nn.Module) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a.parameters(), b.parameters()))


def _train(pairs, steps: int = 3, first: int = 0) -> None:
    for step in range(first, first + steps):
        for model, opt in pairs:
            opt.zero_grad()
            model(batch(step, 4)).backward()
            opt.step()


# -- 1. values the inner optimizer keeps in its param groups --------------------------------------
@pytest.mark.parametrize("stage", (0, 1, 2, 3))
def test_group_values_written_by_step_persist_and_show(stage, tmp_path):
    model, ref = _pair()
    opt = zeroshard.ZeroOptimizer(model, DistanceAdapted, lr=0.5, stage=stage)
    ropt = DistanceAdapted(ref.parameters(), lr=0.5)
    _train([(model, opt), (ref, ropt)], steps=4)
    assert opt.param_groups[0]["k"] == ropt.param_groups[0]["k"] == 4  # a key the step adds shows
    assert opt.param_groups[0]["d"] == pytest.approx(ropt.param_groups[0]["d"], rel=1e-5)
    assert ropt.param_groups[0]["d"] > 1e-3  # (d grew: the test exercises what it claims)
    assert _maxdiff(model, ref) < 1e-5  # was reset to d0 before every step
    # a checkpoint keeps them: a fresh optimizer resumes with the saved d and k
    zeroshard.save_checkpoint(str(tmp_path), model=model, optimizer=opt, step=4)
    torch.manual_seed(1)
    again = TinyNet()
    opt2 = zeroshard.ZeroOptimizer(again, DistanceAdapted, lr=0.5, stage=stage)
    zeroshard.load_checkpoint(str(tmp_path), model=again, optimizer=opt2)
    assert opt2.param_groups[0]["k"] == 4
    assert opt2.param_groups[0]["d"] == opt.param_groups[0]["d"]
    _train([(again, opt2), (ref, ropt)], steps=2, first=4)
    assert _maxdiff(again, ref) < 1e-5
    assert opt2.param_groups[0]["k"] == 6


# -- 8. torch's refusals, with torch's types and messages (cases of torch's own test_errors) --------
def _p() -> nn.Parameter:
    return nn.Parameter(torch.randn(1, 1))


_P1, _P2 = _p(), _p()
_TORCH_ERRORS = [  # (class, params or None, kwargs, torch's error type, torch's regex): optim_db's error inputs
    (torch.optim.AdamW, None, dict(lr=torch.tensor([0.001, 0.001])), ValueError, "Tensor lr must be 1-element"),
    (torch.optim.SGD, None, dict(lr=torch.tensor([0.001, 0.001])), ValueError, "Tensor lr must be 1-element"),
    (torch.optim.Adam, _P1, {}, TypeError, "params argument given to the optimizer should be an iterable of Tensors"),
    (torch.optim.Adam, [{"params": _P1}, {"params": _P1}], {}, ValueError,
     "some parameters appear in more than one parameter group"),
    (torch.optim.Adam, [("weight", _P1), _P2], {}, ValueError,
     "all optimizer params should be with/without names. Some param names are missing"),
    (torch.optim.Adam, [{"params": [_P1], "lr": 1e-2}, {"params": [("weight", _P2)]}], {}, ValueError,
     "all optimizer param groups should be with/without names. cannot add param group with names"),
    (torch.optim.Adam, None, dict(lr=1e-2, betas=(1.0, 0.0)), ValueError, "Invalid beta parameter at index 0: 1.0"),
    (torch.optim.AdamW, None, dict(lr=1e-2, weight_decay=-1), ValueError, "Invalid weight_decay value: -1"),
    (torch.optim.SGD, None, dict(lr=1e-2, momentum=-0.5), ValueError, "Invalid momentum value: -0.5"),
    (torch.optim.Adadelta, None, dict(lr=1e-2, rho=1.1), ValueError, "Invalid rho value: 1.1"),
    (torch.optim.Adagrad, None, dict(lr=1e-2, lr_decay=-0.5), ValueError, "Invalid lr_decay value: -0.5"),
    (torch.optim.NAdam, None, dict(lr=1e-2, momentum_decay=-0.2), ValueError, "Invalid momentum_decay value: -0.2"),
    (torch.optim.Rprop, None, dict(lr=1e-2, etas=(1.0, 0.5)), ValueError, "Invalid eta values: 1.0, 0.5"),
    (torch.optim.Adam, None, dict(lr=torch.tensor(0.01), foreach=True), ValueError,
     "lr as a Tensor is not supported for capturable=False and foreach=True"),
]


@pytest.mark.parametrize("cls,params,kwargs,error,regex", _TORCH_ERRORS,
                         ids=[f"{c[0].__name__}-{c[4][:24]}" for c in _TORCH_ERRORS])
def test_refusals_are_torchs(cls, params, kwargs, error, regex):
    params = [_p()] if params is None else params
    with pytest.raises(error, match=regex):
        cls(params, **kwargs)  # (the case is torch's: it holds there)
    with pytest.raises(error, match=regex):
        zeroshard.ZeroOptimizer(params, cls, **kwargs)


def test_refusal_still_names_the_argument():
    with pytest.raises(ValueError, match=r"Invalid weight_decay value: -1 \(weight_decay=-1 must be"):
        zeroshard.ZeroOptimizer([_p()], torch.optim.AdamW, lr=1e-2, weight_decay=-1)


# -- stage 3 corners ---------------------------------------------------------------------------
class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.side = nn.Linear(4, 4)
        self.empty = nn.Linear(4, 0)  # zero-element parameters (a head pruned to nothing)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x)) + self.side(x) + self.empty(x).sum()


class _ReturnsBias(nn.Module):
    """A Megatron-style layer: the bias goes back to the caller, who adds it (fused later)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4, bias=False)
        self.bias = nn.Parameter(torch.randn(4))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.lin(x), self.bias


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Block() for _ in range(2)])
        self.layers = nn.ModuleList([_ReturnsBias() for _ in range(2)])
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        for layer in self.layers:
            out, bias = layer(x)
            x = torch.tanh(out + bias)
        return self.head(x).pow(2).mean()


def _net_pair() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    model, ref = _Net(), _Net()
    ref.load_state_dict(model.state_dict())
    return model, ref


def _stage3_train(model, opt, ref, ropt, steps: int = 3, dtype=torch.float32) -> None:
    for i in range(steps):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(i))
        for m, o, d in ((model, opt, dtype), (ref, ropt, torch.float32)):
            o.zero_grad()
            m(x.to(d)).backward()
            o.step()


def _full_diff(model, opt, ref) -> float:
    full = zeroshard.full_state_dict(model, rank0_only=False)
    return max((full[k].float() - v).abs().max().item() for k, v in ref.state_dict().items() if v.numel())


def test_stage3_module_returning_its_parameter_trains_like_torch():
    # (the caller's `out + bias` read released memory: SIGSEGV, no Python error)
    model, ref = _net_pair()
    opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-2, stage=3)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    _stage3_train(model, opt, ref, ropt)
    assert _full_diff(model, opt, ref) < 1e-6
    assert not any(h for p in model.parameters() for h in getattr(p, "_backward_hooks", None) or {})


def test_stage3_mixed_precision_casts_zero_element_parameters():
    model, ref = _net_pair()  # (the forward failed: mat1 and mat2 must have the same dtype)
    opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-2, stage=3, mixed_precision="bf16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    _stage3_train(model, opt, ref, ropt, dtype=torch.bfloat16)
    assert _full_diff(model, opt, ref) < 1e-2  # (bf16 compute; Adam moved each weight ~3e-2)


def _left_out_groups(model: nn.Module) -> list[dict]:
    """Groups that leave the blocks' ``side`` layers out (trainable, yet not trained)."""
    kept = [p for n, p in model.named_parameters() if ".side." not in n and not n.startswith("head")]
    return [{"params": kept}, {"params": list(model.head.parameters()), "lr": 1e-3}]


@pytest.mark.parametrize("stage", (0, 2, 3))
def test_param_groups_may_leave_trainable_parameters_out(stage, tmp_path):
    model, ref = _net_pair()  # (stage 3 refused: "trainable parameter(s) ... are in no param group")
    opt = zeroshard.ZeroOptimizer(_left_out_groups(model), torch.optim.AdamW, lr=1e-2, stage=stage, module=model)
    ropt = torch.optim.AdamW(_left_out_groups(ref), lr=1e-2)
    before = ref.blocks[0].side.weight.detach().clone()
    _stage3_train(model, opt, ref, ropt)
    assert torch.equal(ref.blocks[0].side.weight, before)  # (torch leaves them alone)
    assert _full_diff(model, opt, ref) < 1e-6
    zeroshard.save_checkpoint(str(tmp_path), 3, model=model, optimizer=opt)
    torch.manual_seed(5)
    again = _Net()
    opt2 = zeroshard.ZeroOptimizer(_left_out_groups(again), torch.optim.AdamW, lr=1e-2, stage=stage, module=again)
    zeroshard.load_checkpoint(str(tmp_path), model=again, optimizer=opt2)
    assert _full_diff(again, opt2, ref) < 1e-6


@pytest.mark.parametrize("stage", (0, 1, 2))
def test_zero_element_parameters_leave_their_neighbours_alone(stage):
    # (their segment starts where the next parameter's does: the next one's gradient was added to
    # an unwritten bucket, or its update undone)
    model, ref = _net_pair()
    opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-2, stage=stage)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    _stage3_train(model, opt, ref, ropt)
    assert _full_diff(model, opt, ref) < 1e-6


# -- 2. a parameter with no gradient this step is not stepped (torch: .grad is None) -------------
_FROZEN_CASES = [dict(stage=0), dict(stage=1), dict(stage=2), dict(stage=3),
                 dict(stage=2, offload_optimizer="cpu"), dict(stage=3, offload_optimizer="cpu")]


@pytest.mark.parametrize("options", _FROZEN_CASES, ids=[str(sorted(o.items())) for o in _FROZEN_CASES])
def test_parameter_frozen_for_some_steps_is_not_stepped(options):
    model, ref = _pair()
    opt = zeroshard.ZeroOptimizer(model, torch.optim.Adam, lr=1e-2, **options)
    ropt = torch.optim.Adam([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
    for step in range(6):
        frozen = step in (1, 2, 3)  # fc1 frozen between steps, as progressive unfreezing does
        for m, o in ((model, opt), (ref, ropt)):
            m.fc1.requires_grad_(not frozen)
            o.zero_grad()
            m(batch(step, 4)).backward()
            o.step()
        if step == 2:  # while frozen, torch does not count its steps
            fc1 = dict(model.named_parameters())["fc1.weight"]
            assert float(opt.state[fc1]["step"]) == float(ropt.state[ref.fc1.weight]["step"]) == 1
    assert _maxdiff(model, ref) < 1e-5  # (was ~1e-3: the skipped steps counted in the bias correction)
    got, want = opt.consolidated_state_dict(), ropt.state_dict()  # per parameter, as torch's
    assert sorted(float(s["step"]) for s in got["state"].values()) == \
        sorted(float(s["step"]) for s in want["state"].values())


# -- at 2 gloo ranks (tests/support/corners_worker.py; one spawn for all) ----------------------------------
def test_two_ranks_unused_module_fresh_optimizer_and_frozen_steps(tmp_path):
    """Stage 3: save_checkpoint after a step with a module never called in forward saves what
    exists (was refused, suggesting to free disk space); a new optimizer over a model whose
    previous one was collected builds and loads a checkpoint (was "Attempted to access the data
    pointer on an invalid python storage"); a parameter frozen for some steps matches torch at
    stages 1-3."""
    from tests.support.corners_worker import run
    out = run_ranks(run, 2, str(tmp_path), str(tmp_path))
    assert out == [{}, {}]


def test_torchs_refusal_check_leaves_the_users_groups_alone():
    """Asking torch's constructor whether it refuses the arguments must not fill its defaults into
    the user's group dicts (a Muon group would get AdamW's weight_decay: every Muon parity case
    drifted by 6% when it did)."""
    from zeroshard.optim.torch_refusals import torch_refusal
    w = torch.nn.Parameter(torch.zeros(4, 4))
    groups = [{"params": [w], "optimizer_class": torch.optim.Muon, "lr": 0.02}]
    assert torch_refusal(torch.optim.AdamW, groups, {"lr": 1e-3}) is None
    assert groups == [{"params": [w], "optimizer_class": torch.optim.Muon, "lr": 0.02}]
