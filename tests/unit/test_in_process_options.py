"""``InProcessOptions`` refuses what would make the recovery's protocol wrong, naming the value
(Note [in-process recovery] in zeroshard/train/in_process.py)."""
from __future__ import annotations

import pytest

from zeroshard import InProcessOptions, InProcessRecovery


@pytest.mark.parametrize("kwargs,match", [
    ({"host": ""}, "host"),
    ({"port": 0}, "port"),
    ({"port": True}, "port"),
    ({"timeout_s": 0}, "timeout_s"),
    ({"dead_after_s": 0.2}, "heartbeat_s"),  # (a live member's heartbeat would look stale)
    ({"max_recoveries": -1}, "max_recoveries"),
])
def test_bad_options_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        InProcessOptions(**{"host": "127.0.0.1", "port": 29500, **kwargs})


def test_recovery_checks_its_arguments():
    with pytest.raises(TypeError, match="InProcessOptions"):
        InProcessRecovery({"host": "127.0.0.1"}, rank=0, world_size=2, build=lambda r, w: None, root="ckpt")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="rank=2"):
        InProcessRecovery(InProcessOptions("127.0.0.1", 29500), rank=2, world_size=2, build=lambda r, w: None,
                          root="ckpt")  # type: ignore[arg-type, return-value]
