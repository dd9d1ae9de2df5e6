"""ResumableSampler: distributed, shuffled by seed and epoch, resumes mid-epoch at any world size."""
from __future__ import annotations

import json

import pytest

from zeroshard.checkpoint import jsontree
from zeroshard.data import ResumableSampler

N = 37  # not a multiple of any world size


def _global_batches(world: int, batch: int, steps: int, state=None) -> tuple[list[list[int]], dict]:
    """Each step's global batch (union over ranks), and rank 0's state after ``steps``."""
    samplers = [ResumableSampler(N, num_replicas=world, rank=r, seed=11) for r in range(world)]
    if state is not None:
        for s in samplers:
            s.load_state_dict(jsontree.decode(json.loads(json.dumps(jsontree.encode(state)))))
    iters = [iter(s) for s in samplers]
    out = []
    for _ in range(steps):
        step = []
        for s, it in zip(samplers, iters):
            for _ in range(batch):
                try:
                    step.append(next(it))
                except StopIteration:  # epoch over: the next one starts (like set_epoch(e + 1))
                    s.set_epoch(s.epoch + 1)
                    iters[samplers.index(s)] = it = iter(s)
                    step.append(next(it))
        out.append(sorted(step))
    return out, samplers[0].state_dict()


@pytest.mark.parametrize("world_after,batch_after", [(4, 2), (2, 4), (1, 8)])
def test_resume_mid_epoch_at_any_world_size(world_after, batch_after):
    reference, _ = _global_batches(1, 8, 4)
    first, state = _global_batches(4, 2, 2)
    rest, _ = _global_batches(world_after, batch_after, 2, state)
    assert first + rest == reference


def test_epochs_shuffle_differently_and_cover_the_dataset():
    s = ResumableSampler(N, num_replicas=1, rank=0, seed=3)
    e0 = list(s)
    s.set_epoch(1)
    e1 = list(s)
    assert sorted(e0) == sorted(e1) == list(range(N)) and e0 != e1
    ranks = [list(ResumableSampler(N, num_replicas=3, rank=r, seed=3)) for r in range(3)]
    assert len({len(r) for r in ranks}) == 1 and set(sum(ranks, [])) == set(range(N))


def test_state_mismatch_is_refused():
    s = ResumableSampler(N, num_replicas=2, rank=0, seed=3)
    with pytest.raises(ValueError, match="dataset of 10 samples"):
        s.load_state_dict({**s.state_dict(), "dataset_len": 10})
    with pytest.raises(ValueError, match="seed=4"):
        s.load_state_dict({**s.state_dict(), "seed": 4})
