"""Checkpoint errors: each names what is wrong and what to do about it."""
from __future__ import annotations


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded."""


class CheckpointCorruptError(CheckpointError):
    """A checkpoint's files do not match its manifest (damaged, truncated, missing, tampered)."""


class CheckpointMismatchError(CheckpointError, ValueError):
    """A valid checkpoint that does not fit the model or optimizer it is loaded into."""
