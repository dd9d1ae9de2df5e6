"""``memory_checkpoint``: the per-step commit to the memory tier, called where a save would be.
What is captured is what ``save_checkpoint`` captures (``saver._capture``), laid out for one
slot: each tensor's byte offset, and the small state beside it (Note [peer memory tier] in
zeroshard/resilience/memory_tier.py)."""
from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Optional, cast

import torch
from torch import nn

from zeroshard.checkpoint import codec_residuals, frozen_base
from zeroshard.checkpoint.saver import _capture, _shapes, checkpoint_comm
from zeroshard.checkpoint.shard_file import CODES, Deferred
from zeroshard.optim.zero_optimizer import engine_of
from zeroshard.resilience.memory_tier import ALIGN

if TYPE_CHECKING:
    from zeroshard.optim.zero_optimizer import ZeroOptimizer


def model_digest(shapes: dict[str, dict]) -> str:
    """Names, shapes and dtypes of everything a checkpoint of this model holds (not values)."""
    table = sorted((n, m["shape"], m["dtype"], m["kind"]) for n, m in shapes.items())
    return hashlib.sha256(json.dumps(table).encode()).hexdigest()


def digest_of(model: Optional[nn.Module], opt: object) -> tuple[str, dict[str, dict]]:
    """(``model_digest``, the shapes table) of what ``model``/``opt`` would save."""
    shapes = _shapes(model, opt, frozen_base.save_frozen_default(model, opt))
    return model_digest(shapes), shapes


def memory_checkpoint(step: int, *, model: Optional[nn.Module], optimizer: object, scheduler: object = None,
                      dataloader: object = None, extra: object = None) -> bool:
    """Commits step ``step``'s training state to the memory tier of ``ZeroOptimizer(redundancy="peer")``
    (a collective; call it after ``opt.step(); sched.step()``, every step: ``PeerRedundancy(every=K)``
    keeps every K-th, ``every="auto"`` (the default) the steps its measurements choose: Note [commit pacing]
    in zeroshard/resilience/commit_pacer.py). The copy is made now; the write and the replica to the buddy rank run on a
    thread. Returns False when skipped (not a K-th step, or the tier turned off after a write failed).
    ``load_checkpoint`` loads from the tiers when they hold a step at least as new as the disk's
    (Note [peer memory tier] in zeroshard/resilience/memory_tier.py)."""
    return commit_step(step, force=False, model=model, optimizer=optimizer, scheduler=scheduler,
                       dataloader=dataloader, extra=extra)


# Note [save group made early]: a disk save's side group (saver.checkpoint_comm) used to be
# made at the first save, with new_group: every rank of the world publishes its address in the
# store and waits for the others'. A run that keeps a memory tier is one that expects to lose
# ranks, and a rank lost just before the first save left the others waiting there for the
# store's timeout (ZEROSHARD_PG_TIMEOUT, 30 minutes by default; measured by the node-loss kill
# points: a worker waited 240 s before its stack was dumped), not failing at once as a
# collective with a dead peer does. So the first memory_checkpoint, which every rank reaches at
# the same step, makes it while all are alive; a later save reuses it.
def commit_step(step: int, *, force: bool, model: Optional[nn.Module], optimizer: object, scheduler: object = None,
                dataloader: object = None, extra: object = None) -> bool:
    """``memory_checkpoint``; ``force``: past ``every`` (a handoff's agreed step)."""
    engine = engine_of(optimizer)
    if engine is None or engine.memory_tier is None:
        raise ValueError("memory_checkpoint needs the ZeroOptimizer built with redundancy='peer' "
                         "(or zeroshard.PeerRedundancy(...))")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step={step!r} must be an int >= 0")
    tier = engine.memory_tier
    if tier.world > 1:  # (cached after the first call: Note [save group made early])
        checkpoint_comm(cast("ZeroOptimizer", optimizer))
    if model is not None:
        tier.guard(model)
    if not tier.ready(step, force):
        return False
    snap = _capture(step, model, optimizer, scheduler, dataloader, extra, tier.world,
                    frozen_base.save_frozen_default(model, optimizer), writes_full=tier.rank == 0)
    digest, shapes = digest_of(model, optimizer)
    pieces, full, tensors, size = [], {}, [], 0

    def place(t: torch.Tensor) -> dict:
        nonlocal size
        spec = {"dtype": CODES[t.dtype], "offset": size, "numel": t.numel()}
        tensors.append((size, t))
        size += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
        return spec
    for rec in snap.records:
        keys = {}
        for kind, t in rec.tensors.items():
            if isinstance(t, Deferred):  # (refused at construction: Note [peer memory tier])
                raise RuntimeError("the memory tier cannot hold state kept in swap files")
            keys[kind] = place(t)
        pieces.append({"name": rec.name, "start": rec.start, "stop": rec.stop, "keys": keys, "scalars": rec.scalars})
    # A forward changes buffers (BatchNorm's running statistics) before the next step waits for
    # the tier's copy (Note [peer memory tier]): what is not a frozen weight is copied now (small).
    fixed = {p.data_ptr() for p in model.parameters() if not p.requires_grad} if model is not None else set()
    for name, t in snap.full.items():
        full[name] = place(t if t.numel() and t.data_ptr() in fixed else t.detach().clone())
    # This rank's gradient residuals (error feedback; copies taken now: the next backward changes
    # them before the next step waits for the tier's copy), restored at the same world size.
    residuals = {k: place(t) for k, t in codec_residuals.residual_tensors(optimizer).items()}
    header = {"pieces": pieces, "full": full, "rng": snap.rng, "dataloader": snap.dataloader,
              "header": snap.header, "shapes": shapes, "residuals": residuals}
    tier.commit({"digest": digest, "step": step}, header, tensors, size)
    return True
