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


def test_a_step_error_that_is_not_a_lost_peer_reaches_the_caller_at_once(tmp_path):
    """Only a peer's failure starts a recovery (Note [in-process recovery]): the step's own error,
    here a shape mismatch, is raised as it is, the step not counted and no recovery begun."""
    import torch

    import zeroshard
    from zeroshard import Trainee

    model = torch.nn.Linear(4, 4)
    opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-2)
    rec = InProcessRecovery(InProcessOptions("127.0.0.1", 29500), rank=0, world_size=1, build=lambda r, w: None,
                            root=str(tmp_path))  # type: ignore[arg-type, return-value]
    rec.objects = Trainee(model, opt)  # (as start() leaves them; no store is needed before a failure)

    def step_fn(t: Trainee, step: int) -> None:
        t.model(torch.ones(2, 3))  # (4 inputs expected)
    try:
        with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
            rec.run(step_fn)
        assert rec.step == 0 and rec.recoveries == [] and rec.generation == 0
    finally:
        opt.close()
