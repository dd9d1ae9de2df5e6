"""Step time and per-rank memory: zeroshard stages vs DDP, ZeroRedundancyOptimizer, FSDP2 and
DeepSpeed, in one session. The implementation is ``zeroshard.bench.step``; this file keeps
the old entry point.

    python benchmarks/bench_step.py [--rounds 3 --steps 4 --world-size 2 --model large]
    # same as: python -m zeroshard.bench step ...   (zeroshard bench step ...)
"""
from __future__ import annotations

import sys

from zeroshard.bench.__main__ import main

if __name__ == "__main__":
    sys.exit(main(["step", *sys.argv[1:]]))
