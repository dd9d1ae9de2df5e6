"""Checkpoint errors: each names what is wrong and what to do about it.

What the checksums can and cannot tell: every file and the manifest carry CRC32s, which
detect accidents (a flipped bit, a truncated or half-copied file, a disk returning stale
blocks), not deliberate edits: anyone who can write the files can recompute a CRC32. So a
loader never relies on them for safety: every value is validated as untrusted input (see
``validate`` and ``safe_fs``), and a checkpoint from a source you do not trust should be
treated like any other untrusted input (checked out of band, e.g. a signed digest).
"""
from __future__ import annotations


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded."""


class CheckpointCorruptError(CheckpointError):
    """A checkpoint's files are damaged, truncated, missing or malformed: they do not match
    their manifest (CRC32 detects accidental damage, not deliberate edits), or a value in
    them is not one a save writes. A root falls back to the previous valid step."""


class CheckpointMismatchError(CheckpointError, ValueError):
    """A valid checkpoint that does not fit the model or optimizer it is loaded into."""
