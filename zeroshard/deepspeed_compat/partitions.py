"""Each DeepSpeed optimizer partition checked against what DeepSpeed records about it.

The converter joins rank r's flat fp32 partition (and the moments beside it) at rank r's
place. Nothing but the file name said which rank a file is, so a rank-1 file replaced by a
copy of rank 0's converted with exit 0 and wrong weights. DeepSpeed records enough to tell:
at stages 1-2 each file's ``param_slice_mappings`` names the parameters its partition holds
and where (``start`` in the partition, ``numel``), which follow from the group's layout
(``param_shapes`` in order, ``param_alignment_paddings`` after each, equal partitions of
``partition_count`` ranks) for exactly one rank; every file records ``partition_count``; and
the partitions' sizes follow from the layout at every stage. A file whose records do not
match its rank's place is refused, naming it; so are two ranks' files holding the same
non-zero partition (at stage 3 nothing in a file names its rank).
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from zeroshard.deepspeed_compat.restricted_unpickler import StandIn


def _count(v: object) -> Optional[int]:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def check_partitions(stage: int, world: int, files: list[str], osds: list[dict], shapes: list[dict],
                     flats: list[list[torch.Tensor]], paddings: Optional[list]) -> None:
    """Raises ValueError naming the file whose partition is not its rank's (see the module doc)."""
    for r, (path, o) in enumerate(zip(files, osds)):
        counts = o.get("partition_count")
        listed = counts if isinstance(counts, list) else [counts] * len(shapes)
        if any(_count(c) != world for c in listed):
            raise ValueError(f"{path}: partition_count={counts!r}, but the checkpoint has {world} rank files")
        if len(flats[r]) != len(shapes):
            raise ValueError(f"{path}: {len(flats[r])} flat partitions for {len(shapes)} param groups")
    for g, group in enumerate(shapes):
        sizes = [math.prod(s) for s in group.values()]
        pads = [int(p) for p in paddings[g]] if paddings else [0] * len(sizes)
        if stage <= 2:
            per_rank = flats[0][g].numel()
            need = -(-(sum(sizes) + sum(pads)) // world)
            for r in range(world):
                if flats[r][g].numel() != per_rank or per_rank < need:
                    raise ValueError(f"{files[r]}: group {g}'s partition holds {flats[r][g].numel()} elements; "
                                     f"rank {r} of {world} holds {max(per_rank, need)} of the group's "
                                     f"{sum(sizes) + sum(pads)}")
                _check_mapping(files[r], r, g, group, sizes, pads, per_rank, osds[r])
        else:
            need = sum(-(-n // world) for n in sizes)
            for r in range(world):
                if flats[r][g].numel() < need:
                    raise ValueError(f"{files[r]}: group {g}'s stage-3 partition holds {flats[r][g].numel()} "
                                     f"elements; each rank holds {need} (ceil(numel / {world}) per parameter)")
    seen: dict[bytes, int] = {}
    for r in range(world):
        flat = torch.cat([t.reshape(-1) for t in flats[r]]) if flats[r] else torch.zeros(0)
        if not bool(flat.any()):
            continue  # (zeros are the same on every rank that holds them: a copy changes nothing)
        digest = flat.float().numpy().tobytes()
        if digest in seen:
            raise ValueError(f"{files[r]} holds the same fp32 partition as {files[seen[digest]]}: rank {r}'s file is "
                             f"a copy of rank {seen[digest]}'s (each rank of a ZeRO checkpoint holds its own part)")
        seen[digest] = r


def _check_mapping(path: str, rank: int, g: int, group: dict, sizes: list[int], pads: list[int], per_rank: int,
                   osd: dict) -> None:
    """Stages 1-2: the file's ``param_slice_mappings`` for group ``g`` against rank ``rank``'s place."""
    mappings = osd.get("param_slice_mappings")
    if mappings is None:
        return  # (older DeepSpeed does not write them: the sizes and the copy check stand)
    if not isinstance(mappings, list) or len(mappings) <= g or not isinstance(mappings[g], dict):
        raise ValueError(f"{path}: param_slice_mappings is not a list of one mapping per param group")
    lo, hi = rank * per_rank, (rank + 1) * per_rank
    want, offset = {}, 0
    for (name, _), n, pad in zip(group.items(), sizes, pads):
        a, b = max(offset, lo), min(offset + n, hi)
        if a < b:
            want[name] = (a - lo, b - a)
        offset += n + pad
    got = {}
    for name, address in mappings[g].items():
        state = address.state if isinstance(address, StandIn) else address if isinstance(address, dict) else {}
        got[name] = (_count(state.get("start")), _count(state.get("numel")))
    if got != want:
        diff = sorted(n for n in set(got) | set(want) if got.get(n) != want.get(n))

        def at(where: dict) -> str:
            return f"at (start, numel) {where[diff[0]]}" if diff[0] in where else "nowhere"
        raise ValueError(
            f"{path}: its partition of group {g} is not rank {rank}'s: it records {diff[0]!r} {at(got)}, rank "
            f"{rank} of the checkpoint holds it {at(want)} "
            f"({len(diff)} parameter(s) differ); the file is out of place, a copy of another rank's, or from "
            "another checkpoint")
