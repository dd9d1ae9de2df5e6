"""The residuals of gradient error feedback in checkpoints (Note [gradient error feedback] in
zeroshard/comm/codecs/link_codecs.py).

Each rank's residuals are its own (what its encodings lost), so they are saved in its own data
file, ``rank-NNNNN.safetensors``, under ``codec_residual/<grad codec>/<block>/<links>/<key>``
(covered by that file's checksums like every piece; no manifest entry: no other rank and no
resharded load reads them). A load at the same world size with the same gradient codec, block
and links restores them, so a resume continues bit for bit; any other load starts them at zero
(one step's quantization error, reported by nothing because nothing is lost that training
needs). A checkpoint written without error feedback has none: the residuals start at zero.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional

import torch

from zeroshard.checkpoint.names import data_file
from zeroshard.checkpoint.shard_file import ShardReader
from zeroshard.optim.zero_optimizer import engine_of

if TYPE_CHECKING:
    from zeroshard.comm.codecs.link_codecs import LinkCodecs

_PREFIX = "codec_residual/"


def _feedback(optimizer: object) -> tuple[Optional["LinkCodecs"], str]:
    """The optimizer's codecs where it carries residuals, and the tag their keys start with."""
    engine = engine_of(optimizer)
    if engine is None or not engine.codecs.options.error_feedback:
        return None, ""
    o = engine.codecs.options
    return engine.codecs, f"{_PREFIX}{o.grads}/{o.block}/{o.links}/"


def residual_tensors(optimizer: object) -> dict[str, torch.Tensor]:
    """This rank's residuals to write into its data file (none without error feedback)."""
    codecs, tag = _feedback(optimizer)
    return {} if codecs is None else {tag + k: v for k, v in codecs.state_dict().items()}


def restore(optimizer: object, reader_of: Callable[[str], ShardReader], saved_world: int, rank: int,
            world: int) -> bool:
    """Loads this rank's residuals from its data file where they apply (see above); True if it did.
    ``reader_of(file name)`` opens a verified reader of the step directory's file."""
    codecs, tag = _feedback(optimizer)
    engine = engine_of(optimizer)
    if codecs is None or engine is None:
        return False
    codecs.residuals.clear()
    if saved_world != world:
        return False
    reader = reader_of(data_file(rank))
    keys = [k for k in reader.entries if k.startswith(tag)]
    reader.load([reader.byte_range(k, 0, reader.entries[k].numel) for k in keys])
    device = engine.units[0].device if engine.units else torch.device("cpu")
    codecs.load_state_dict({k[len(tag):]: reader.get(k, 0, reader.entries[k].numel).clone() for k in keys}, device)
    return bool(keys)
