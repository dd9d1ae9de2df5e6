"""Optimizer state is checked for what it is, not only for how many elements it has (issue
43, section 2; Note [state kinds]): every loaded entry against what the group's optimizer class
keeps -- keys and exact shapes -- in ``load_state_dict`` (sharded and consolidated) and
``load_checkpoint``; Adafactor's factored state loads."""
from __future__ import annotations

import copy
import os
from typing import Callable

import pytest
import torch

import zeroshard
from tests.support import hostile_cases as h
from zeroshard.checkpoint.checkpoint_errors import CheckpointMismatchError
from zeroshard.optim.state_kinds import expected_state


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(32, 64)
        self.b = torch.nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def build(recipe: str, stage: int = 1) -> tuple[Net, zeroshard.ZeroOptimizer]:
    torch.manual_seed(0)
    m = Net()
    if recipe == "muon":  # (Muon on the matrices, AdamW on the rest: one optimizer)
        groups = [{"params": [m.a.weight, m.b.weight], "optimizer_class": torch.optim.Muon, "lr": 0.02},
                  {"params": [m.a.bias, m.b.bias]}]
        return m, zeroshard.ZeroOptimizer(groups, torch.optim.AdamW, stage=stage, module=m)
    return m, zeroshard.ZeroOptimizer(m, torch.optim.Adafactor, stage=stage, lr=1e-2)


def train(m: Net, opt: zeroshard.ZeroOptimizer, steps: int, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        m(torch.randn(4, 32, generator=g)).square().mean().backward()
        opt.step()
        opt.zero_grad()


def test_adafactor_consolidated_round_trip_continues_bit_for_bit():
    m, opt = build("adafactor")
    train(m, opt, 2)
    sd = opt.consolidated_state_dict()
    assert tuple(sd["state"][0]["row_var"].shape) == (64, 1)  # (factored: fewer elements than the matrix)
    m2, opt2 = build("adafactor")
    m2.load_state_dict(m.state_dict())
    opt2.load_state_dict(copy.deepcopy(sd))
    train(m, opt, 2, seed=5)
    train(m2, opt2, 2, seed=5)
    for (n, a), b in zip(m.named_parameters(), m2.parameters()):
        assert torch.equal(a, b), n


def test_probe_reads_each_class_own_state():
    assert expected_state(torch.optim.Adafactor, {"lr": 1e-2}, (64, 32)) == \
        {"step": (), "row_var": (64, 1), "col_var": (1, 32)}
    assert expected_state(torch.optim.Adafactor, {}, (7,)) == {"step": (), "variance": (7,)}
    assert expected_state(torch.optim.Muon, {}, (64, 32)) == {"momentum_buffer": (64, 32)}
    assert expected_state(torch.optim.Muon, {}, (64,)) is None  # (Muon refuses vectors: not asked)
    assert expected_state(torch.optim.SGD, {"momentum": 0.0}, (5,)) == {}
    assert expected_state(torch.optim.SGD, {"momentum": 0.9}, (5,)) == {"momentum_buffer": (5,)}


def _muon_dict_cases() -> dict[str, tuple[Callable[[dict], None], list[str]]]:
    def adamw_state_for_muon(sd: dict) -> None:
        sd["state"][0] = {"step": torch.tensor(2.0), "exp_avg": torch.zeros(64, 32), "exp_avg_sq": torch.zeros(64, 32)}

    def transposed(sd: dict) -> None:
        sd["state"][0]["momentum_buffer"] = sd["state"][0]["momentum_buffer"].t().contiguous()

    def momentum_for_adamw(sd: dict) -> None:
        sd["state"][2] = {"momentum_buffer": torch.zeros(64)}
    return {"muon-given-adamw-state": (adamw_state_for_muon, ["'a.weight'", "'exp_avg'", "momentum_buffer' (64, 32)"]),
            "transposed-momentum": (transposed, ["'a.weight'", "'momentum_buffer' has shape (32, 64)", "(64, 32)"]),
            "adamw-given-momentum": (momentum_for_adamw, ["'a.bias'", "'momentum_buffer'", "'exp_avg' (64,)"])}


@pytest.mark.parametrize("case", sorted(_muon_dict_cases()))
def test_consolidated_state_of_another_kind_is_refused(case):
    m, opt = build("muon")
    train(m, opt, 2)
    sd = opt.consolidated_state_dict()
    before = opt.consolidated_state_dict()
    edit, needles = _muon_dict_cases()[case]
    edit(sd)
    with pytest.raises(ValueError) as err:
        opt.load_state_dict(sd)
    for needle in needles:
        assert needle in str(err.value), (needle, str(err.value))
    after = opt.consolidated_state_dict()  # (refused before anything was applied)
    assert all(torch.equal(after["state"][i][k], v) for i, s in before["state"].items() for k, v in s.items()
               if isinstance(v, torch.Tensor))


def test_sharded_state_of_another_kind_is_refused():
    m, opt = build("muon")
    train(m, opt, 2)
    sd = opt.state_dict()
    opt.load_state_dict(copy.deepcopy(sd))  # (the round trip loads)
    e = sd["pieces"]["a.weight"]
    e["state"]["exp_avg"] = e["state"].pop("momentum_buffer")
    with pytest.raises(ValueError, match=r"'a.weight'.*'exp_avg'.*momentum_buffer"):
        opt.load_state_dict(sd)
    m, opt = build("adafactor")
    train(m, opt, 2)
    sd = opt.state_dict()
    e = sd["pieces"]["a.weight"]["state"]
    e["row_var"], e["col_var"] = e["col_var"], e["row_var"]
    with pytest.raises(ValueError, match=r"'a.weight'.*'col_var' has shape \(64, 1\).*\(1, 32\)"):
        opt.load_state_dict(sd)


def _rename_state(step_dir: str, old: str, new: str) -> None:
    """An attacker's rename of a sliced state key in every piece, data file headers and
    checksums recomputed (tests/support/hostile_cases.py's tools)."""
    ctx = h.Ctx(os.path.dirname(step_dir), "", 1)
    b = h.body(step_dir)
    for meta in b["tensors"].values():
        for p in meta["pieces"]:
            if f"state.{old}" in p["keys"]:
                del p["keys"][f"state.{old}"]
                p["keys"][f"state.{new}"] = f"{meta_name(p)}|{p['start']}|state.{new}"
    h.write_body(step_dir, b)

    def rename(header: dict) -> None:
        for k in [k for k in header if k.endswith(f"|state.{old}")]:
            header[k[:-len(old)] + new] = header.pop(k)
    h.edit_header(ctx, h.DATA0, rename)


def meta_name(piece: dict) -> str:
    return piece["keys"]["param"].rsplit("|", 2)[0]


def _swap_scalars(step_dir: str, a: str, b: str) -> None:
    body = h.body(step_dir)
    for meta in body["tensors"].values():
        for p in meta["pieces"]:
            s = p["scalars"]
            if a in s and b in s:
                s[a], s[b] = s[b], s[a]
    h.write_body(step_dir, body)


@pytest.mark.parametrize("recipe,tamper,needles", [
    ("muon", lambda d: _rename_state(d, "momentum_buffer", "exp_avg"), ["'a.weight'", "'exp_avg'", "momentum_buffer"]),
    ("adafactor", lambda d: _swap_scalars(d, "row_var", "col_var"), ["'a.weight'", "'row_var' has shape (1, 32)", "(64, 1)"]),
])
def test_checkpoint_state_of_another_kind_is_refused(tmp_path, recipe, tamper, needles):
    m, opt = build(recipe)
    train(m, opt, 2)
    zeroshard.save_checkpoint(str(tmp_path), 2, model=m, optimizer=opt)
    step_dir = os.path.join(tmp_path, h.S2)
    m2, opt2 = build(recipe)
    zeroshard.load_checkpoint(step_dir, model=m2, optimizer=opt2)  # (untouched, it loads)
    tamper(step_dir)
    m3, opt3 = build(recipe)
    with pytest.raises(CheckpointMismatchError) as err:
        zeroshard.load_checkpoint(step_dir, model=m3, optimizer=opt3)
    for needle in needles:
        assert needle in str(err.value), (needle, str(err.value))
