"""Per-rank memory by category for stages 0-3 (and offload) at world sizes 1, 2, 4, next to
the ZeRO formulas and the planner's estimate. Implementation: ``zeroshard.bench.memory_bench``.

    python benchmarks/bench_memory.py [--model medium --world-sizes 1,2,4 --out bench-results]
    # same as: python -m zeroshard.bench memory ...   (zeroshard bench memory ...)
"""
from __future__ import annotations

import sys

from zeroshard.bench.__main__ import main

if __name__ == "__main__":
    sys.exit(main(["memory", *sys.argv[1:]]))
