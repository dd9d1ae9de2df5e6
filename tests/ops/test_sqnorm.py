"""squared_norm_f64: the float64 sum of squares clipping sums (zeroshard/ops/sqnorm.py)."""
from __future__ import annotations

import math

import pytest
import torch

from zeroshard.ops import kernel_status, squared_norm_f64

KERNEL = kernel_status()["cpu_adam"]["active"]


def _exact(t: torch.Tensor) -> float:
    return math.fsum(float(x) ** 2 for x in t.double().tolist())


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 65536, 65537, 300_001])
def test_agrees_with_the_exact_sum(n: int) -> None:
    g = torch.randn(n, generator=torch.Generator().manual_seed(n)) * 3
    got = squared_norm_f64(g)
    assert got.dtype == torch.float64 and got.dim() == 0
    assert got.item() == pytest.approx(_exact(g), rel=1e-13, abs=0.0)


@pytest.mark.skipif(not KERNEL, reason="the CPU kernel is not built")
def test_the_bits_do_not_depend_on_the_thread_count() -> None:
    g = torch.randn(5_000_003, generator=torch.Generator().manual_seed(1))
    threads = torch.get_num_threads()
    try:
        results = set()
        for k in (1, 2, 3):
            torch.set_num_threads(k)
            results.add(squared_norm_f64(g).item())
    finally:
        torch.set_num_threads(threads)
    assert len(results) == 1, results


def test_non_finite_values_propagate() -> None:
    g = torch.ones(100_000)
    g[777] = math.inf
    assert squared_norm_f64(g).item() == math.inf
    g[778] = math.nan
    assert math.isnan(squared_norm_f64(g).item())


def test_large_finite_values_do_not_overflow() -> None:
    # A float32 sum of these is inf; their squares summed in float64 are not.
    g = torch.full((1000,), 3.0e38)
    assert torch.isinf(g.sum())
    assert squared_norm_f64(g).item() == pytest.approx(1000 * float(g[0]) ** 2, rel=1e-12)


@pytest.mark.parametrize("kind", ["strided", "bf16"])
def test_other_tensors_take_the_torch_path(kind: str) -> None:
    base = torch.randn(20_000, generator=torch.Generator().manual_seed(3))
    g = base[::2] if kind == "strided" else base.bfloat16()
    assert squared_norm_f64(g).item() == pytest.approx(_exact(g), rel=1e-12)
