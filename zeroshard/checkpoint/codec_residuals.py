"""The residuals of gradient error feedback in checkpoints (Note [gradient error feedback] in
zeroshard/comm/codecs/link_codecs.py; Note [residuals of every replica]).

Each rank's residuals are its own (what its encodings lost), so they are saved in its shard
group's data file, ``rank-NNNNN.safetensors``, under
``codec_residual/<grad codec>/<block>/<links>/mesh<R>x<k>/replica<j>/<key>`` (covered by that
file's checksums like every piece; no manifest entry: no resharded load reads them). A load on
the same mesh (``R`` replicas of ``k`` ranks) with the same gradient codec, block and links
restores every rank's own, so a resume continues bit for bit; any other load starts them at
zero and says so once (a warning naming the saved and the current codec and mesh): a residual
is one rank's share of what a sum lost, and no other partition of the ranks has a share that
equals it (dropping it costs one step's quantization error, not correctness). A checkpoint
written without error feedback has none: the residuals start at zero, silently.

Note [residuals of every replica]: under a hybrid mesh only the first replica's shard group
writes a checkpoint (the replicas hold the same shards), but the replicas' residuals differ
(each encoded its own gradients). So before the first replica writes, each rank's residuals
are all-gathered over its replica group (``replica_tensors``, one flat fp32 tensor: the
residuals of one shard position have the same keys and sizes on every replica, checked) and
the first replica's rank ``s`` writes all ``R`` sets into ``rank-s``'s file; on load, the
rank at replica ``j`` of shard position ``s`` reads ``replica<j>/`` from ``rank-s``'s file.
"""
from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Callable, Optional

import torch
import torch.distributed as dist

from zeroshard.checkpoint.names import data_file
from zeroshard.checkpoint.shard_file import ShardReader
from zeroshard.optim.zero_optimizer import engine_of

if TYPE_CHECKING:
    from zeroshard.comm import Comm
    from zeroshard.comm.codecs.link_codecs import LinkCodecs

_PREFIX = "codec_residual/"


def _feedback(optimizer: object) -> tuple[Optional["LinkCodecs"], str, int]:
    """The optimizer's codecs where it carries residuals, the tag of this mesh's keys (up to the
    replica), and this rank's replica index."""
    engine = engine_of(optimizer)
    if engine is None or not engine.codecs.options.error_feedback:
        return None, "", 0
    o = engine.codecs.options
    replicas = engine.replicas
    r, j = (1, 0) if replicas is None else (replicas.world_size, replicas.rank)
    return engine.codecs, f"{_PREFIX}{o.grads}/{o.block}/{o.links}/mesh{r}x{engine.comm.world_size}/", j


def residual_tensors(optimizer: object) -> dict[str, torch.Tensor]:
    """This rank's residuals to write into its data file (none without error feedback)."""
    codecs, tag, j = _feedback(optimizer)
    return {} if codecs is None else {f"{tag}replica{j}/{k}": v for k, v in codecs.state_dict().items()}


def replica_tensors(optimizer: object, replicas: "Comm") -> dict[str, torch.Tensor]:
    """Every replica's residuals of this rank's shard position (Note [residuals of every
    replica]): a collective of ``replicas``; what the first replica's rank writes."""
    codecs, tag, _ = _feedback(optimizer)
    if codecs is None:
        return {}
    mine = codecs.state_dict()
    layout = [(k, v.numel()) for k, v in mine.items()]
    layouts = replicas.all_gather_object(layout)
    if any(other != layout for other in layouts):
        raise RuntimeError(f"the replicas of one shard position hold different gradient residuals "
                           f"({layouts}); they reduce the same units on the same links, so this is a bug")
    flat = torch.cat([v.flatten() for v in mine.values()]) if mine else torch.zeros(0)
    parts = [torch.empty_like(flat) for _ in range(replicas.world_size)]
    if flat.numel():
        dist.all_gather(parts, flat, group=replicas.group)
    out: dict[str, torch.Tensor] = {}
    for j, part in enumerate(parts):
        for (k, n), piece in zip(layout, part.split([n for _, n in layout])):
            out[f"{tag}replica{j}/{k}"] = piece
    return out


def restore(optimizer: object, reader_of: Callable[[str], ShardReader], saved_world: int, rank: int,
            world: int) -> bool:
    """Loads this rank's residuals from its data file where they apply (see above); True if it did.
    ``reader_of(file name)`` opens a verified reader of the step directory's file (its header:
    the tensors are read only where they apply)."""
    if _feedback(optimizer)[0] is None:
        return False
    reader = reader_of(data_file(rank if saved_world == world else rank % saved_world))
    keys = applicable(optimizer, [k for k in reader.entries if k.startswith(_PREFIX)], saved_world == world, rank)
    reader.load([reader.byte_range(k, 0, reader.entries[k].numel) for k in keys])
    return load(optimizer, {k: reader.get(k, 0, reader.entries[k].numel) for k in keys})


def applicable(optimizer: object, saved: list[str], same_mesh: bool, rank: int) -> list[str]:
    """Of the residual keys ``saved`` for this rank, those this run restores (same mesh, codec,
    block and links: see above; the warning once where some were saved and none apply)."""
    codecs, tag, j = _feedback(optimizer)
    if codecs is None:
        return []
    mine = f"{tag}replica{j}/"
    keys = [k for k in saved if k.startswith(mine)] if same_mesh else []
    if not keys and saved and rank == 0 and j == 0:
        kinds = sorted({k[len(_PREFIX):].split("/replica")[0] for k in saved})
        warnings.warn(f"the checkpoint's gradient residuals (error feedback) were saved for "
                      f"{', '.join(kinds)} (codec/block/links/mesh replicas x ranks) and this run is "
                      f"{mine[len(_PREFIX):-1]}: they do not apply here and start at zero (one step's "
                      "quantization error; resuming on the saved mesh and codec restores them)", stacklevel=4)
    return keys


def load(optimizer: object, tensors: dict[str, torch.Tensor]) -> bool:
    """Sets this rank's residuals to ``tensors`` (keys from ``applicable``; none: all start at
    zero); True if any were restored."""
    codecs, tag, j = _feedback(optimizer)
    engine = engine_of(optimizer)
    if codecs is None or engine is None:
        return False
    codecs.load_state_dict({}, torch.device("cpu"))  # (none until loaded below; a skipped step's copies too)
    if not tensors:
        return False
    mine = f"{tag}replica{j}/"
    device = engine.units[0].device if engine.units else torch.device("cpu")
    codecs.load_state_dict({k[len(mine):]: v.clone() for k, v in tensors.items()}, device)
    return True
