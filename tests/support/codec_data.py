"""Inputs and comparisons the block-codec kernel tests share (tests/ops/test_codec_kernel.py,
tests/ops/test_cuda_codec_replay.py)."""
import torch


def codec_data(n: int, block: int, non_finite: bool) -> torch.Tensor:
    """``n`` values with blocks of every magnitude (fp8 subnormals), an all-zero block (scale 0), a
    constant one, ties of the rounding and, with ``non_finite`` and room, blocks holding NaN, -NaN,
    inf and -inf."""
    g = torch.Generator().manual_seed(n + block)
    x = torch.randn(n, generator=g) * torch.logspace(-9, 3, n)
    x[: min(n, block)] = 0.0
    if n > 3 * block:
        x[2 * block:3 * block] = -2.5
    x[n // 2] = 0.5 * float(x[n // 2 + 1 if n > 1 else 0]) or 1.0
    if non_finite and n > 6 * block:
        x[3 * block + 1], x[4 * block + 3], x[5 * block] = float("nan"), float("inf"), float("-inf")
        x[5 * block + 1] = -float("nan")
    return x


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit where not NaN (-0.0 is not 0.0), NaN where the other is NaN (a NaN's
    payload is whichever operand's NaN the multiplication kept: not a value)."""
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(a.view(torch.int32)[~nan], b.view(torch.int32)[~nan])


def torch_path(codec, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The bytes the torch path (the kernels' oracle) encodes ``x`` into, and what they decode to."""
    want = torch.empty(codec.encoded_bytes(x.numel()), dtype=torch.uint8)
    codec.reference_encode(x, want)
    ref = torch.empty(x.numel())
    codec.reference_decode(want, ref)
    return want, ref
