"""Ported from PyTorch's test/test_optim.py (TestOptimRenewed over optim_db); see tests/support/conformance/cases.py."""
from __future__ import annotations

import io
from typing import Callable

import torch

import zeroshard
from tests.support.conformance.common import GLOBAL, _close, _local, _pair, _step_both, case
from tests.support.models import TinyNet, batch


# -- torch: TestOptimRenewed --------------------------------------------------------------------
CONFIGS = {
    "sgd_momentum_nesterov": (torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)),
    "sgd_dampening_maximize": (torch.optim.SGD, dict(lr=0.05, momentum=0.5, dampening=0.3, maximize=True)),
    "adam_amsgrad": (torch.optim.Adam, dict(lr=1e-2, amsgrad=True, weight_decay=0.1)),
    "adam_decoupled": (torch.optim.Adam, dict(lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True)),
    "adam_maximize": (torch.optim.Adam, dict(lr=1e-2, maximize=True)),
    "adamw_tensor_lr": (torch.optim.AdamW, dict(lr=torch.tensor(1e-2), weight_decay=0.2)),
    "adagrad_lr_decay": (torch.optim.Adagrad, dict(lr=0.05, lr_decay=0.01, initial_accumulator_value=0.1)),
    "rmsprop_centered": (torch.optim.RMSprop, dict(lr=1e-3, centered=True, momentum=0.5)),
    "adamax": (torch.optim.Adamax, dict(lr=1e-2, weight_decay=0.1)),
    "nadam_decoupled": (torch.optim.NAdam, dict(lr=1e-2, decoupled_weight_decay=True, weight_decay=0.1)),
    "radam": (torch.optim.RAdam, dict(lr=1e-2, weight_decay=0.1)),
    "adadelta": (torch.optim.Adadelta, dict(lr=0.5, rho=0.8)),
    "asgd": (torch.optim.ASGD, dict(lr=1e-2, t0=1)),
    "rprop": (torch.optim.Rprop, dict(lr=1e-3)),
}


def _correctness(config: str) -> Callable[[int, int], None]:
    def check(rank: int, world: int) -> None:
        cls, kw = CONFIGS[config]
        for stage in (1, 2, 3):
            model, ref = _pair()
            opt = zeroshard.ZeroOptimizer(model, cls, stage=stage, **kw)
            ropt = cls(ref.parameters(), **kw)
            for step in range(3):
                _step_both(model, opt, ref, ropt, step, rank, world)
            _close(model, ref, stage, atol=1e-4)
    check.__name__ = f"torch_correctness_{config}"
    return check


for _name in CONFIGS:
    case(f"torch: TestOptimRenewed.test_correctness ({_name} from optim_db's inputs)")(_correctness(_name))


@case("torch: TestOptimRenewed.test_param_groups_weight_decay / test_param_groups_lr")
def torch_param_groups_lr_weight_decay(rank: int, world: int) -> None:
    def groups(m):
        return [{"params": [p for p in m.parameters() if p.dim() >= 2], "weight_decay": 0.3},
                {"params": [p for p in m.parameters() if p.dim() < 2], "lr": 3e-3, "amsgrad": True}]
    for stage in (0, 1, 2):
        model, ref = _pair()
        opt = zeroshard.ZeroOptimizer(groups(model), torch.optim.AdamW, lr=1e-2, stage=stage)
        ropt = torch.optim.AdamW(groups(ref), lr=1e-2)
        for step in range(3):
            _step_both(model, opt, ref, ropt, step, rank, world)
        _close(model, ref, stage)


@case("torch: TestOptimRenewed.test_step_is_noop_when_params_have_no_grad")
def torch_step_noop_without_grad(rank: int, world: int) -> None:
    model, _ = _pair()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-2, weight_decay=0.5)
    opt.step()
    opt.step()
    for k, v in model.state_dict().items():
        if not torch.equal(v, before[k]):
            raise AssertionError(f"{k} moved without a gradient")


@case("torch: TestOptimRenewed.test_load_nontensor_step")
def torch_load_nontensor_step(rank: int, world: int) -> None:
    model, ref = _pair()
    ropt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    ref(batch(0, 4)).backward()
    ropt.step()
    sd = ropt.state_dict()
    for s in sd["state"].values():
        s["step"] = s["step"].item()
    model.load_state_dict(ref.state_dict())
    opt = zeroshard.ZeroOptimizer(model, torch.optim.Adam, lr=1e-2, stage=2)
    opt.load_state_dict(sd)
    ropt.load_state_dict(sd)
    _step_both(model, opt, ref, ropt, 1, rank, world)
    _close(model, ref)


@case("torch: TestOptimRenewed.test_step_pre_hook / test_step_post_hook / test_step_all_hooks")
def torch_step_hooks(rank: int, world: int) -> None:
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
    calls: list[str] = []
    model, _ = _pair()
    opt = zeroshard.ZeroOptimizer(model, torch.optim.Adam, lr=1e-2)
    handles = [register_optimizer_step_pre_hook(lambda o, a, k: calls.append("global_pre")),
               register_optimizer_step_post_hook(lambda o, a, k: calls.append("global_post")),
               opt.register_step_pre_hook(lambda o, a, k: calls.append("pre")),
               opt.register_step_post_hook(lambda o, a, k: calls.append("post"))]
    try:
        for step in range(2):
            model(_local(batch(step, GLOBAL), rank, world)).backward()
            opt.step()
    finally:
        for h in handles:
            h.remove()
    expect = ["global_pre", "pre", "post", "global_post"] * 2
    if calls != expect:
        raise AssertionError(f"hook calls {calls}, expected {expect}")


@case("torch: TestOptimRenewed.test_state_dict_pre_hook / post_hook / test_load_state_dict_pre_hook_and_prepend")
def torch_state_dict_hooks(rank: int, world: int) -> None:
    model, _ = _pair()
    opt = zeroshard.ZeroOptimizer(model, torch.optim.SGD, lr=0.1, momentum=0.9)
    seen: list[str] = []
    opt.register_state_dict_pre_hook(lambda o: seen.append("pre"))
    opt.register_state_dict_post_hook(lambda o, sd: {**sd, "tag": 7})
    opt.register_load_state_dict_pre_hook(lambda o, sd: {k: v for k, v in sd.items() if k != "tag"})
    opt.register_load_state_dict_post_hook(lambda o: seen.append("loaded"))
    sd = opt.state_dict()
    opt.load_state_dict(sd)
    if sd.get("tag") != 7 or seen != ["pre", "loaded"]:
        raise AssertionError(f"tag={sd.get('tag')} seen={seen}")


@case("torch: TestOptimRenewed.test_save_load_equality_with_weights_only")
def torch_weights_only_round_trip(rank: int, world: int) -> None:
    model, ref = _pair()
    opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-2, stage=2)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    _step_both(model, opt, ref, ropt, 0, rank, world)
    sd = opt.consolidated_state_dict(to_rank=None)
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    plain = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    plain.load_state_dict(loaded)  # loadable by torch.optim itself
    for (_, a), (_, b) in zip(sorted(plain.state_dict()["state"].items()), sorted(ropt.state_dict()["state"].items())):
        if not torch.allclose(a["exp_avg"], b["exp_avg"], atol=1e-6):
            raise AssertionError("exp_avg differs after the weights-only round trip")


@case("torch: TestOptimRenewed.test_param_group_with_lrscheduler_is_preserved")
def torch_scheduler_state_preserved(rank: int, world: int) -> None:
    model, ref = _pair()
    opt = zeroshard.ZeroOptimizer(model, torch.optim.SGD, lr=0.1, momentum=0.9, stage=1)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    scheds = [torch.optim.lr_scheduler.StepLR(o, 1, gamma=0.5) for o in (opt, ropt)]
    for step in range(3):
        _step_both(model, opt, ref, ropt, step, rank, world)
        for s in scheds:
            s.step()
    if opt.param_groups[0]["lr"] != ropt.param_groups[0]["lr"]:
        raise AssertionError(f"lr {opt.param_groups[0]['lr']} vs {ropt.param_groups[0]['lr']}")
    _close(model, ref)


@case("torch: TestOptimRenewed.test_optimizer_can_be_printed / test_defaults_changed_to_foreach (repr, defaults)")
def torch_printable_and_defaults(rank: int, world: int) -> None:
    opt = zeroshard.ZeroOptimizer(TinyNet(), torch.optim.Adam, lr=1e-2)
    text = repr(opt)
    if "ZeroOptimizer" not in text or opt.defaults["lr"] != 1e-2:
        raise AssertionError(text)


@case("torch: TestOptimRenewed.test_errors (invalid hyperparameters raise ValueError)")
def torch_errors(rank: int, world: int) -> None:
    bad = [dict(lr=-1.0), dict(lr=1e-2, betas=(1.0, 0.99)), dict(lr=1e-2, eps=-1.0),
           dict(lr=1e-2, betas=(0.9, torch.tensor(0.99)))]
    for kw in bad:
        try:
            zeroshard.ZeroOptimizer(TinyNet(), torch.optim.Adam, **kw)
        except ValueError:
            continue
        raise AssertionError(f"{kw} was accepted")
    named = list(TinyNet().named_parameters())
    try:
        zeroshard.ZeroOptimizer(named[:1] + [p for _, p in named[1:]], torch.optim.SGD, lr=0.1)
    except ValueError:
        return
    raise AssertionError("mixed named and unnamed params were accepted")


@case("torch: TestOptimRenewed.test_param_names (state_dict param_names)")
def torch_param_names(rank: int, world: int) -> None:
    model, ref = _pair()
    opt = zeroshard.ZeroOptimizer(list(model.named_parameters()), torch.optim.AdamW, lr=1e-2)
    ropt = torch.optim.AdamW(list(ref.named_parameters()), lr=1e-2)
    got = opt.consolidated_state_dict(to_rank=None)["param_groups"][0].get("param_names")
    if got != ropt.state_dict()["param_groups"][0]["param_names"]:
        raise AssertionError(f"param_names {got}")


@case("torch: TestOptimRenewed.test_state_dict_deterministic (opt.state per parameter)")
def torch_state_per_param(rank: int, world: int) -> None:
    model, ref = _pair()
    opt = zeroshard.ZeroOptimizer(model, torch.optim.Adam, lr=1e-2, stage=0)
    ropt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    _step_both(model, opt, ref, ropt, 0, rank, world)
    for p, q in zip(model.parameters(), ref.parameters()):
        if q in ropt.state and not torch.allclose(opt.state[p]["exp_avg_sq"], ropt.state[q]["exp_avg_sq"],
                                                  atol=1e-7):
            raise AssertionError("opt.state[p] differs from torch")


@case("torch: TestOptimRenewed.test_zero_grad / set_to_none semantics")
def torch_zero_grad(rank: int, world: int) -> None:
    model, _ = _pair()
    opt = zeroshard.ZeroOptimizer(model, torch.optim.SGD, lr=0.1, stage=1)
    model(_local(batch(0, GLOBAL), rank, world)).backward()
    opt.zero_grad(set_to_none=False)
    if not all(p.grad is not None and not p.grad.any() for p in model.parameters() if p.requires_grad):
        raise AssertionError("set_to_none=False must leave zeros")
    opt.zero_grad()
    if any(p.grad is not None for p in model.parameters()):
        raise AssertionError("set_to_none=True must leave None")


@case("torch: TestOptimRenewed.test_deepcopy_copies_all_public_attrs (refused with a clear error)")
def torch_deepcopy_refused(rank: int, world: int) -> None:
    import copy
    opt = zeroshard.ZeroOptimizer(TinyNet(), torch.optim.SGD, lr=0.1)
    try:
        copy.deepcopy(opt)
    except TypeError as exc:
        if "state_dict" in str(exc):
            return
    raise AssertionError("deepcopy neither worked nor gave the documented refusal")


# -- torch: test_complex (optim_db's complex inputs) ----------------------------------------------
class ComplexNet(torch.nn.Module):
    """A real embedding into complex parameters of odd sizes (5: the slice boundaries of 2 ranks
    fall inside them) and a real scale."""

    def __init__(self) -> None:
        super().__init__()
        from tests.support.models import VOCAB
        self.emb = torch.nn.Embedding(VOCAB, 6)
        self.cw = torch.nn.Parameter(torch.randn(6, 5, dtype=torch.complex64) * 0.3)
        self.cb = torch.nn.Parameter(torch.randn(5, dtype=torch.complex64) * 0.1)
        self.scale = torch.nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x).to(torch.complex64) @ self.cw + self.cb
        return (h.abs() ** 2).mean() * self.scale.mean() + h.real.mean() - 0.5 * h.imag.mean()


def _close_complex(model, ref, stage: int, atol: float) -> None:
    got = zeroshard.full_state_dict(model, rank0_only=False) if stage == 3 else model.state_dict()
    for k, v in ref.state_dict().items():
        if got[k].dtype != v.dtype or got[k].shape != v.shape:
            raise AssertionError(f"{k}: {got[k].dtype}{tuple(got[k].shape)} vs torch's {v.dtype}{tuple(v.shape)}")
        diff = (got[k] - v).abs().max().item()
        if diff > atol:
            raise AssertionError(f"{k}: max diff {diff:.3g} > {atol}")


def _complex(config: str) -> Callable[[int, int], None]:
    """torch's test_complex: an optimizer steps a complex parameter as its real view. Here the
    ZeRO-sharded complex parameters against torch's optimizer over the same complex ones, and the
    moments of consolidated_state_dict() complex like torch's."""
    def check(rank: int, world: int) -> None:
        cls, kw = CONFIGS[config]
        for stage in (3,):  # (sharded parameters and gradients; stages 0-2, offload: tests/dist/test_complex_params.py)
            model, ref = _pair(cls=ComplexNet)
            opt = zeroshard.ZeroOptimizer(model, cls, stage=stage, **kw)
            ropt = cls(ref.parameters(), **kw)
            for step in range(3):
                _step_both(model, opt, ref, ropt, step, rank, world)
            _close_complex(model, ref, stage, atol=1e-4)
            got, want = opt.consolidated_state_dict(to_rank=None)["state"], ropt.state_dict()["state"]
            for i, entry in want.items():
                for k, v in entry.items():
                    g = got[i][k]
                    if isinstance(v, torch.Tensor) and (g.dtype != v.dtype or g.shape != v.shape):
                        raise AssertionError(f"state {i}.{k}: {g.dtype}{tuple(g.shape)} vs torch's "
                                             f"{v.dtype}{tuple(v.shape)}")
            opt.close()
    check.__name__ = f"torch_complex_{config}"
    return check


for _name in CONFIGS:
    case(f"torch: TestOptimRenewed.test_complex ({_name})")(_complex(_name))


class _SplitNet(ComplexNet):
    """ComplexNet with each complex parameter as two real ones (torch's test_complex_2d)."""

    def __init__(self, of: ComplexNet) -> None:
        super().__init__()
        del self.cw, self.cb
        self.emb.load_state_dict(of.emb.state_dict())
        self.scale = torch.nn.Parameter(of.scale.detach().clone())
        self.cw_re, self.cw_im = (torch.nn.Parameter(t.detach().clone()) for t in (of.cw.real, of.cw.imag))
        self.cb_re, self.cb_im = (torch.nn.Parameter(t.detach().clone()) for t in (of.cb.real, of.cb.imag))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x).to(torch.complex64) @ torch.complex(self.cw_re, self.cw_im) + torch.complex(self.cb_re,
                                                                                                    self.cb_im)
        return (h.abs() ** 2).mean() * self.scale.mean() + h.real.mean() - 0.5 * h.imag.mean()


@case("torch: TestOptimRenewed.test_complex_2d (a complex parameter steps as its real and imaginary parts)")
def torch_complex_2d(rank: int, world: int) -> None:
    for cls, kw in (CONFIGS["adam_amsgrad"], CONFIGS["sgd_momentum_nesterov"], CONFIGS["rmsprop_centered"]):
        for stage in (2, 3):
            torch.manual_seed(0)
            model = ComplexNet()
            ref = _SplitNet(model)
            opt = zeroshard.ZeroOptimizer(model, cls, stage=stage, **kw)
            ropt = cls(ref.parameters(), **kw)
            for step in range(3):
                _step_both(model, opt, ref, ropt, step, rank, world)
            got = zeroshard.full_state_dict(model, rank0_only=False) if stage == 3 else model.state_dict()
            for name in ("cw", "cb"):
                want = torch.complex(getattr(ref, f"{name}_re"), getattr(ref, f"{name}_im")).detach()
                diff = (got[name] - want).abs().max().item()
                if diff > 1e-4:
                    raise AssertionError(f"{cls.__name__} stage {stage} {name}: max diff {diff:.3g}")
            opt.close()
