"""The codecs one ZeroOptimizer's collectives use, with the state they carry between steps.

Lifecycle: built once by the assembly (zeroshard/optim/assembly.py) from ``ZeroConfig.codecs``
and handed to the gatherer, the hpZ secondary partition and the gradient reducer, which pass it
to the collectives they start (``Comm.gather_shards(full, codecs)``, ``reduce_for_shard(...,
codecs, key)``); each collective asks it for the codec of its own group's dimension. It holds
the gradient residuals (Note [gradient error feedback]) and the largest dequantization error
seen since the last ``end_step``.

Note [gradient error feedback]: with ``grad_error_feedback=True`` each rank adds, before it
encodes a gradient for a quantized reduction, what the previous encoding of the same unit on
the same link lost (``x + r`` is encoded, ``r <- (x + r) - decode(encode(x + r))``). The
residual is this rank's own (its contribution, before the sum), one fp32 tensor per unit and
quantized link, of the size of what that link reduces: the whole unit on a flat group, and
1/k of it on the inter-node level of hybrid/hpZ meshes with ``codec_links="inter_node"`` (sharded
like the gradient store there). Checkpoints save each rank's residuals, every hybrid replica's
(``state_dict``/``load_state_dict``: zeroshard/checkpoint/codec_residuals.py, Note [residuals of
every replica]) so a resume continues bit for bit on the same mesh; on another mesh (or with
another codec) the residuals start at zero with a warning, which costs one step's quantization
error, not correctness.

Note [residuals under a moving loss scale]: under fp16 the reductions carry gradients of the
loss times the loss scale, so a residual is in those units. When the scaler moves the scale
(halved after an overflow, doubled after ``loss_scale_growth_interval`` clean steps) the next
step's gradients are in the new units, and a residual left as it was would be added 2x too
large (or too small) for one step. So the step that moves the scale multiplies every residual
by new/old (``rescale``; the same where a loaded scaler state replaces the scale): a power of
two, exact in fp32, so the codec's arithmetic, itself exact under a power-of-two scaling, sees
the same values it would have seen with the new scale all along.

Note [residuals of a skipped step]: a step's reductions run during backward, before anyone knows
whether the step will be applied; when it is not (fp16's loss scaler skips it for inf/NaN
anywhere, on any rank), its sums are dropped, and so is what each residual carried into them.
Keeping the residuals those reductions left would lose that (one step's quantization error of
every finite unit), so the first use of a residual in a step keeps a copy of it as it was
(``residual``), and ``settle`` at the step drops the copies (applied) or puts them back (skipped,
a residual first made in the step removed); ``rescale`` follows. A skipped step thus leaves every
residual as before it, and training goes on as if the step had never run (tested in
tests/dist/test_quantized_collectives.py). Costs one copy of each residual per step, held
from the step's first reduction to its ``settle``.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch

from zeroshard.comm.codecs.codec_formats import Codec, make_codec
from zeroshard.comm.codecs.codec_options import CollectiveCodecs

_LOG = logging.getLogger("zeroshard.codecs")


class LinkCodecs:
    def __init__(self, options: CollectiveCodecs) -> None:
        self.options = options
        self._weights = make_codec(options.weights, options.block)
        self._grads = make_codec(options.grads, options.block)
        self.residuals: dict[str, torch.Tensor] = {}
        """Gradient residuals by ``"<unit>@<dimension>"`` (Note [gradient error feedback])."""
        self._before_step: dict[str, Optional[torch.Tensor]] = {}
        """Each residual the step in progress used, as it was before (None: made in this step);
        Note [residuals of a skipped step]."""
        self.step_error: dict[str, float] = {}
        """Largest |x - decode(encode(x))| this rank saw since the last ``end_step``, by
        ``"weights@<dimension>"`` / ``"grads@<dimension>"`` (each block's largest error, the max over blocks)."""
        self.last_step_error: dict[str, float] = {}
        self.steps = 0

    def weights(self, dimension: str) -> Optional[Codec]:
        return self._weights if self._weights is not None and self.options.applies_to(dimension) else None

    def grads(self, dimension: str) -> Optional[Codec]:
        return self._grads if self._grads is not None and self.options.applies_to(dimension) else None

    def residual(self, key: Optional[str], numel: int, device: torch.device) -> Optional[torch.Tensor]:
        """The residual of ``key`` (zeros at first), or None without error feedback."""
        if not self.options.error_feedback or key is None:
            return None
        r = self.residuals.get(key)
        if key not in self._before_step:  # (its first use in this step: Note [residuals of a skipped step])
            self._before_step[key] = r.clone() if r is not None and r.numel() == numel else r
        if r is None or r.numel() != numel:
            r = self.residuals[key] = torch.zeros(numel, dtype=torch.float32, device=device)
        return r

    def settle(self, applied: bool) -> None:
        """The step whose reductions used the residuals is applied (keep what they left) or
        skipped (put back what they were before it); Note [residuals of a skipped step]."""
        if not applied:
            for key, before in self._before_step.items():
                if before is None:
                    self.residuals.pop(key, None)
                else:
                    self.residuals[key] = before
        self._before_step = {}

    def rescale(self, old_scale: float, new_scale: float) -> None:
        """The fp16 loss scale moved from ``old_scale`` to ``new_scale``: the residuals, made of
        gradients of a loss scaled by the old one, are brought to the new one (Note [residuals
        under a moving loss scale])."""
        if new_scale != old_scale:
            factor = new_scale / old_scale
            for r in [*self.residuals.values(), *self._before_step.values()]:
                if r is not None:
                    r.mul_(factor)

    def record(self, what: str, dimension: str, error: float) -> None:
        key = f"{what}@{dimension}"
        if error > self.step_error.get(key, -1.0) or error != error:
            self.step_error[key] = error

    def end_step(self) -> None:
        """Closes a step's error statistics (logged where asked: ``log_codec_error=True``)."""
        self.steps += 1
        self.last_step_error, self.step_error = self.step_error, {}
        if self.options.log_error and self.last_step_error:
            _LOG.info("step %d: largest dequantization error %s", self.steps,
                      ", ".join(f"{k} {v:.3e}" for k, v in sorted(self.last_step_error.items())))

    # -- checkpoints (Note [gradient error feedback]) -------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().cpu().clone() for k, v in sorted(self.residuals.items())}

    def load_state_dict(self, state: dict[str, torch.Tensor], device: torch.device) -> None:
        self.residuals = {k: v.to(device=device, dtype=torch.float32).clone() for k, v in state.items()}
        self._before_step = {}
