"""Checkpoints of a pipeline-parallel model: one manifest over every stage's parameters.

Note [pipeline checkpoints]: under pipeline parallelism (Note [pipeline parallelism] in
zeroshard/comm/pipeline.py) each rank's optimizer knows its own stage's parameters only. A
checkpoint describes the whole model, so what the manifest lists is merged over the pp group
(one ``all_gather_object`` of names and shapes, no tensors): the tensor table is the union of
the stages' entries, the param groups are every stage's groups in stage order, each with its
own hyperparameters and the names it holds (a tensor's group index renumbered to match),
aliases are united, and a buffer
two stages share is written by the first of them. Each rank writes its own pieces as always,
keyed by the full model's names, so a load at another layout (pp 1, another dp, one process)
finds every piece by name and range; a load at a pp layout compares the checkpoint with the
union of its stages' expectations in the same way. Groups are matched by the names they hold,
never by index (Note [param groups by name] in group_names.py): stage 0 built with
``[{embedding, lr=1e-5}, {rest}]`` and stage 1 with ``[{rest}]`` once merged group ``i`` across
stages and resumed stage 1 at the embedding's learning rate.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from zeroshard.optim.zero_optimizer import engine_of

if TYPE_CHECKING:
    from zeroshard.checkpoint.commit import Snapshot
    from zeroshard.comm.pipeline import PipelineParallel


def pipeline_of(opt: object) -> Optional["PipelineParallel"]:
    """The optimizer's PipelineParallel (None without pp, or for a plain torch.optim optimizer)."""
    engine = engine_of(opt)
    mesh = engine.mesh if engine is not None else None
    return getattr(mesh, "pp", None)


def stages_of(opt: object) -> int:
    """Pipeline stages of the optimizer's mesh (1 without pp)."""
    pp = pipeline_of(opt)
    return pp.stages if pp is not None else 1


def merge_save(pp: "PipelineParallel", snap: "Snapshot", shapes: dict[str, dict],
               full_names: list[str]) -> dict[str, dict]:
    """Every stage's shapes, param groups and aliases in ``snap``'s header and the returned
    shapes (a collective over pp); ``snap.full`` keeps only the buffers no earlier stage
    writes (Note [pipeline checkpoints])."""
    header = snap.header
    mine = (shapes, header.get("param_groups", []), header.get("aliases", {}), full_names)
    stages = pp.comm.all_gather_object(mine)
    merged: dict[str, dict] = {}
    written: set[str] = set()
    offset = 0  # (stage k's group i is the manifest's group offset + i)
    for k, (stage_shapes, groups, _, names) in enumerate(stages):
        for name, meta in stage_shapes.items():
            if name not in merged:
                merged[name] = {**meta, "group": meta["group"] + offset} if meta.get("group") is not None else meta
        offset += len(groups)
        if k == pp.stage:
            snap.full = {n: t for n, t in snap.full.items() if n not in written}
        written |= set(names)
    if header:
        header["pipeline_stages"] = pp.stages  # (a load at another pp count reports it resharded)
        header["param_groups"] = [g for _, groups, _, _ in stages for g in groups]
        header["aliases"] = {a: t for _, _, aliases, _ in stages for a, t in aliases.items()}
    return merged


def merge_expected(pp: "PipelineParallel", expected: dict[str, tuple[tuple[int, ...], bool]]
                   ) -> dict[str, tuple[tuple[int, ...], bool]]:
    """What every stage holds, for a load's checks (a collective over pp: Note [pipeline checkpoints])."""
    out: dict[str, tuple[tuple[int, ...], bool]] = {}
    for stage_expected in pp.comm.all_gather_object(expected):
        out.update(stage_expected)
    return out
