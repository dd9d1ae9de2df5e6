"""Sharded, crash-consistent, reshardable checkpoints (DESIGN.md, "Checkpoint layout").

Files, one object or concern each:
- ``saver``: ``save_checkpoint`` and the process's saver (sync and async lifecycle);
- ``commit``: the write/fsync/rename protocol that makes a step visible only when complete;
- ``pieces``: which pieces a rank owns and writes, and the names they are stored under;
- ``shard_file``: safetensors written with block checksums, read back by verified range;
- ``manifest``: the table of contents; ``validate``: every field of it checked before
  anything is trusted (and at save time); ``safe_fs``: regular files only, no links, bounded;
- ``load``/``locate``: loading at any world size and stage, falling back past damaged steps;
  ``resume``: ``load_checkpoint`` with the memory tiers tried first (``memory_recovery``;
  ``memory_commit`` fills them: Note [peer memory tier] in zeroshard/resilience/memory_tier.py);
  ``trainer_state``: the small state, decoded and checked first, applied with a way back;
- ``export``: streaming to the Hugging Face layout.

What a stage must provide to be saved and loaded (stages 0-2 do; stage 3 and offload must
keep these): ``opt.units`` with ``unit.layout`` (segments, ``pieces_in``, ``slice_of``),
``unit.owned``, ``unit.param_range(a, b)`` readable *and writable* for owned ranges,
``unit.master_range``/``unit.separate_master``/``unit.write_back()``, ``opt.runs`` whose
``run.tensor`` keys ``opt.inner.state`` with tensors indexable by run offset (offload: CPU
tensors or views that ``copy_`` works on), and ``opt.gather_params()`` that makes whatever
the stage keeps of the full parameters current after owned ranges were written.
"""
from zeroshard.checkpoint.checkpoint_errors import CheckpointCorruptError, CheckpointError, CheckpointMismatchError
from zeroshard.checkpoint.export import export_hf
from zeroshard.checkpoint.formats import save_checkpoint
from zeroshard.checkpoint.resume import load_checkpoint  # (the memory tiers first, then formats' dispatch)
from zeroshard.checkpoint.locate import latest_checkpoint
from zeroshard.checkpoint import torch_state_dict  # noqa: F401  (registers the form torch's state-dict API reads)
from zeroshard.checkpoint.saver import PendingSave, wait_checkpoint

__all__ = ["save_checkpoint", "export_hf", "load_checkpoint", "latest_checkpoint", "wait_checkpoint", "PendingSave",
           "CheckpointError", "CheckpointCorruptError", "CheckpointMismatchError"]
