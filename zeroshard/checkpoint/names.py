"""The names a save writes on disk: step directories and per-rank files. Both the manifest
(which writes and finds them) and its validation (which refuses any other name) use these,
so they live below both."""
from __future__ import annotations

import os
import re
from typing import Optional

STEP_RE = re.compile(r"step-([0-9]{8,})", re.ASCII)
"""A committed step's directory name, matched with ``fullmatch`` (ASCII digits only, nothing
after them: ``step-0000٩`` and ``step-00000009\\n`` are not steps)."""
FILE_RE = re.compile(r"(rank|rng)-[0-9]{5}\.(safetensors|json)", re.ASCII)


def step_of(name: str) -> Optional[int]:
    """The step a directory name stands for, or None: only the canonical spelling counts."""
    m = STEP_RE.fullmatch(name)
    return int(m.group(1)) if m and name == step_dir_name(int(m.group(1))) else None


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def data_file(rank: int) -> str:
    return f"rank-{rank:05d}.safetensors"


def rng_file(rank: int) -> str:
    return f"rng-{rank:05d}.json"


def committed_steps(root: str) -> list[tuple[int, str]]:
    """(step, directory name) of every committed-looking step under root, oldest first."""
    try:
        names = os.listdir(root)
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted((step, n) for n in names if (step := step_of(n)) is not None)
