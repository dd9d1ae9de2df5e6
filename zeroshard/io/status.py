"""``engine_status()``: which I/O backend is active and why; ``python -m zeroshard.io`` prints it."""
from __future__ import annotations

import os
from typing import Any

from ._native import native
from ._plan import direct_refusals


def engine_status() -> dict[str, Any]:
    """Looks for (or builds) the native engine if not done yet and describes the outcome.

    Keys: ``backend`` ("native" or "python": what ``AsyncIO(backend="auto")`` uses),
    ``native`` (``available``, ``source``, ``reason``, ``engine``), ``fallback`` (what runs
    without it), ``direct_io`` (whether O_DIRECT is possible here, and every file system seen
    refusing it in this process, keyed by device number)."""
    state = native()
    refusals = direct_refusals()
    return {
        "backend": "native" if state.module is not None else "python",
        "native": {
            "available": state.module is not None,
            "source": state.source,
            "reason": state.reason,
            "engine": getattr(state.module, "BACKEND", None),
        },
        "fallback": "python-threads: os.preadv/os.pwritev on a thread pool (same blocks, same O_DIRECT rules)",
        "direct_io": {
            "supported_by_platform": hasattr(os, "O_DIRECT"),
            "refused_by": {str(dev): why for dev, why in refusals.items()},
        },
    }
