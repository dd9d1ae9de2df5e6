"""The tiers of memory a unit's state can live in: one vocabulary from the config to the step."""
from __future__ import annotations

from enum import Enum


class Tier(str, Enum):
    """Where one kind of a unit's state lives (Note [automatic placement] in
    zeroshard/planner/auto_placement.py): the model's device, host memory, or an NVMe swap file.
    A str equal to its name ("device", "host", "nvme"), so reports, JSON and lookups by name
    see the plain string. The offload strings (None, "cpu", "nvme") become a Tier once, in
    ``Placement`` and ``ZeroConfig`` (zeroshard/config.py); code below the config compares Tier
    members."""

    DEVICE = "device"
    HOST = "host"
    NVME = "nvme"

    def __str__(self) -> str:
        return self.value

    def __repr__(self) -> str:
        return repr(self.value)

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)
