"""Dynamic loss scaling for fp16 (the scheme of torch.amp.GradScaler).

The scale multiplies the loss so small fp16 gradients do not flush to zero. An overflow
anywhere (any rank: the optimizer agrees on the flag collectively) skips the step and
halves the scale; ``growth_interval`` clean steps in a row double it.
"""
from __future__ import annotations


class DynamicLossScaler:
    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000,
                 min_scale: float = 1.0) -> None:
        if not (growth_factor > 1.0 and 0.0 < backoff_factor < 1.0):
            raise ValueError(f"need growth_factor > 1 and 0 < backoff_factor < 1, got "
                             f"{growth_factor=}, {backoff_factor=}")
        self.scale = float(init_scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.min_scale = min_scale
        self.good_steps = 0
        self.skipped_steps = 0

    def update(self, overflow: bool) -> None:
        if overflow:
            self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            self.good_steps = 0
            self.skipped_steps += 1
            return
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.good_steps = int(state["good_steps"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
