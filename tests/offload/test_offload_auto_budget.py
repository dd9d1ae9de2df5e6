"""``offload="auto"``: the budget a refusal names is one that constructs (issue 39: 366 MiB was
named, 366 MiB refused, 374 MiB fitted: the measured reserve counts 2% of the budget itself), and
a host budget of its own on a CPU-only machine is refused, not silently added to the device's."""
from __future__ import annotations

import ast
import re

import pytest
import torch

import zeroshard
from zeroshard.planner.auto_placement import Fixed, MemoryBudget, PlacementError, UnitSpec, plan_auto
from zeroshard.testing.toy import GPTConfig, TinyGPT

NAMED = re.compile(r"the smallest budget that fits is (\{[^}]*\})")


def _build(budget: object, nvme: str) -> tuple:
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab=256, d_model=64, n_layers=2, n_heads=4, seq_len=16))
    return model, zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-3, stage=3, offload="auto",
                                          memory_budget=budget, nvme_path=nvme)


def test_the_named_budget_constructs_with_a_measured_reserve(tmp_path):
    with pytest.raises(PlacementError) as exc:
        _build("1MiB", str(tmp_path))
    named = ast.literal_eval(NAMED.search(str(exc.value)).group(1))
    _, opt = _build(named, str(tmp_path))  # what the message says fits, fits
    opt.close()


@pytest.mark.parametrize("accelerator", [False, True])
def test_the_named_budget_is_rounded_up_and_fits_a_share_of_itself(accelerator):
    n = 3 << 20
    units = [UnitSpec(i, shard=4 * n + 7, master=0, grad=4 * n, moments=8 * n, master_in_shard=True)
             for i in range(5)]
    fixed = Fixed(device=12 * n + 5, host=333_333 + (1 << 20) // 50, staging=24 * n, pool=24 * n,
                  budget_share=50, share_bytes=(1 << 20) // 50)  # (planned for a 1 MiB budget)
    with pytest.raises(PlacementError) as exc:
        plan_auto(units, MemoryBudget(device=1 << 20, host=1 << 20), fixed, accelerator=accelerator, nvme=True)
    budget = MemoryBudget.parse(ast.literal_eval(NAMED.search(str(exc.value)).group(1)))
    host_budget = budget.host if accelerator else budget.device + budget.host
    share = host_budget // 50  # (as the placement plans a measured reserve: 2% of the budget it is given)
    refit = Fixed(device=fixed.device, host=fixed.host - fixed.share_bytes + share, staging=fixed.staging,
                  pool=fixed.pool, budget_share=50, share_bytes=share)
    plan_auto(units, budget, refit, accelerator=accelerator, nvme=True)


def test_a_separate_host_budget_on_a_cpu_only_model_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"device and host are one memory here.*Give one size"):
        _build({"device": "2GiB", "host": 1000}, str(tmp_path))
    _, opt = _build({"host": "2GiB"}, str(tmp_path))
    opt.close()
