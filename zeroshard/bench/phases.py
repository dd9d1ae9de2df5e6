"""One training step timed by phase, as the benchmarks of stage 3 and of bigger-than-memory
training measure it: forward, backward, then clipping + ``step`` + ``zero_grad``."""
from __future__ import annotations

import time
from typing import Any, Callable


def timed_step(model: Any, opt: Any, batch: tuple, clip: Callable[[], Any]) -> tuple[Any, dict[str, float]]:
    """Runs one step; (the loss, seconds per phase). ``clip`` clips the gradients (the
    optimizer's own ``clip_grad_norm_``, or torch's for a plain optimizer)."""
    t0 = time.perf_counter()
    loss = model(*batch)
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    clip()
    opt.step()
    opt.zero_grad()
    t3 = time.perf_counter()
    return loss, {"forward": t1 - t0, "backward": t2 - t1, "step": t3 - t2}
