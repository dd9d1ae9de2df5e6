"""Surviving a lost rank from memory (issue 45; Note [peer memory tier] in tier.py).

Files, one object or concern each:
- ``options``: ``PeerRedundancy``, the frozen options of ``ZeroOptimizer(redundancy=...)``;
- ``slots``: one double-buffered slot pair in node-local shared memory (write, verify, read);
- ``tier``: ``MemoryTier``, the per-rank commit (copy, write, replicate to the buddy rank);
- ``recovery``: finding the newest step the tiers cover together and loading it at any world size.
Survivors re-forming the group in their processes: ``zeroshard.InProcessRecovery`` in
zeroshard/train/in_process.py (Note [in-process recovery]; it drives the checkpoint package,
which imports this one).
"""
from zeroshard.resilience.redundancy_options import PeerRedundancy

__all__ = ["PeerRedundancy"]
