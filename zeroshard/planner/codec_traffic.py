"""Bytes per step on the inter-node link with quantized collectives (Note [quantized collectives]).

The formulas of "Bytes per step" (traffic.py) with each full-width term replaced by its encoded
size, in ``comm_report``'s units (the logical size of each collective's encoded buffer). For a
codec C, ``E_C(n)`` = ``C.encoded_bytes(n)`` (fp32 scales per block, padding to whole blocks
included); without a codec ``E(n) = width * n``. Per unit of Ψ_u padded elements, R nodes of k
ranks, N = R·k:

    scope   stage  inter-node per unit
    flat    3      N·E_g(Ψ_u/N) (all-to-all) + (2 − root)·N·E_w(Ψ_u/N) (gathers)
    hybrid  2, 3   2·R·E_g(⌈Ψ_u/(k·R)⌉) (the owned slice's all-reduce: all-to-all + all-gather)
    hpz     3      R·E_g(Ψ_u/N) (slice all-to-all) + R·E_w(Ψ_u/N) (secondary rebuild)

(the one flag byte per tensor of ``grad_flags`` and the norms are apart, as in traffic.py).
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

from zeroshard.comm.codecs.codec_formats import Codec


def _enc(codec: Optional[Codec], n: int, width: int) -> int:
    return codec.encoded_bytes(n) if codec is not None else width * n


def inter_node_bytes(scope: str, stage: int, nodes: int, per_node: int, units: Sequence[tuple[int, bool]],
                     weights: Optional[Codec], grads: Optional[Codec], param_width: int = 4,
                     grad_width: int = 4) -> int:
    """Bulk bytes one rank moves across nodes in one step; ``units``: (padded numel, is the root)."""
    r, k = nodes, per_node
    n_all = r * k
    total = 0
    for psi, root in units:
        if scope == "flat" and stage == 3:
            total += n_all * _enc(grads, psi // n_all, grad_width)
            total += (1 if root else 2) * n_all * _enc(weights, psi // n_all, param_width)
        elif scope == "hybrid" and stage in (2, 3):
            if grads is None:
                total += grad_width * (psi // k)
            else:
                total += 2 * r * grads.encoded_bytes(math.ceil(psi / k / r))
        elif scope == "hpz" and stage == 3:
            total += r * _enc(grads, psi // n_all, grad_width) + r * _enc(weights, psi // n_all, param_width)
        else:
            raise ValueError(f"no quantized-traffic formula for scope={scope!r} stage={stage} (flat 3, hybrid 2-3, hpz 3)")
    return total
