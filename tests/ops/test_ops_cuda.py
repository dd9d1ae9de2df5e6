"""The CUDA multi-tensor Adam kernel against torch.optim.AdamW(fused=True); skips without a GPU."""
from __future__ import annotations

import pytest
import torch

from zeroshard.ops import FusedAdam, adam_step_multi_, kernel_status

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

ATOL, RTOL = 1e-6, 1e-5
# More tensors than one launch's metadata holds (36) and tensors spanning several 64Ki chunks,
# with sizes off the 4-element vector width and one misaligned view.
SIZES = [0, 1, 3, 4, 5, 1023, 65_536, 65_537, 200_003] + [97 * k + 1 for k in range(40)]


def test_kernel_is_active() -> None:
    status = kernel_status()["cuda_adam"]
    assert status["active"], f"CUDA present but kernel inactive: {status['reason']}"


@pytest.mark.parametrize("adamw_mode", [True, False])
def test_matches_torch_fused_adamw(adamw_mode: bool) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    ours = [torch.randn(n, device="cuda", generator=gen).requires_grad_(True) for n in SIZES]
    ref = [p.detach().clone().requires_grad_(True) for p in ours]
    opt_o = FusedAdam(ours, lr=1e-3, weight_decay=0.05, adamw_mode=adamw_mode)
    cls = torch.optim.AdamW if adamw_mode else torch.optim.Adam
    opt_r = cls(ref, lr=1e-3, weight_decay=0.05, fused=True)
    for _ in range(100):
        for p, q in zip(ours, ref):
            g = torch.randn(p.shape, device="cuda", generator=gen) * 0.1
            p.grad, q.grad = g, g.clone()
        opt_o.step()
        opt_r.step()
    for p, q in zip(ours, ref):
        torch.testing.assert_close(p, q, atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(opt_o.state[p]["exp_avg_sq"], opt_r.state[q]["exp_avg_sq"], atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("lowp", [torch.bfloat16, torch.float16])
def test_lowp_grads_and_copy_out(lowp: torch.dtype) -> None:
    gen = torch.Generator(device="cuda").manual_seed(1)
    params = [torch.randn(n + 1, device="cuda", generator=gen)[1:] for n in SIZES]  # misaligned views
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    cpu = [(p.cpu(), a.cpu(), b.cpu()) for p, a, b in zip(params, m, v)]
    outs = [torch.empty(p.shape, device="cuda", dtype=lowp) for p in params]
    for step in range(1, 6):
        grads = [(torch.randn(p.shape, device="cuda", generator=gen) * 64).to(lowp) for p in params]
        kw = dict(step=step, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, adamw_mode=True,
                  grad_scale=1 / 64)
        adam_step_multi_(params, grads, m, v, out_lowps=outs, **kw)
        adam_step_multi_([c[0] for c in cpu], [g.cpu() for g in grads], [c[1] for c in cpu],
                         [c[2] for c in cpu], **kw)
    for p, o, c in zip(params, outs, cpu):
        torch.testing.assert_close(p.cpu(), c[0], atol=ATOL, rtol=RTOL)
        assert torch.equal(o, p.to(lowp)), "copy-out must equal rounding the fp32 result"
