"""Bytes per training step over intra- and inter-node links, by sharding scope and stage.

The formulas of docs/design.md ("Bytes per step"), in the units ``ZeroOptimizer.comm_report``
counts: per rank and per step (one forward, one backward, one optimizer step), the logical
size of each collective (an all-gather or reduce-scatter counts its whole buffer, an
all-reduce its tensor), attributed to the link its group crosses: a group inside one node is
intra-node; a group spanning nodes is inter-node. For Ψ_u padded elements of unit u, model
dtype width b, reduction width g (4: fp32 gradients), R nodes of k data-parallel ranks,
N = R·k, and G = Σ_u Ψ_u·(2 − [u is stage 3's root unit]) (blocks are gathered in forward
and again in backward; the root unit stays gathered):

    scope   stage  intra-node                     inter-node (R > 1)
    flat    0      0                              gΨ (all-reduce)
    flat    1      0                              gΨ + bΨ (all-reduce, gather after the step)
    flat    2      0                              gΨ + bΨ (reduce-scatter, gather)
    flat    3      0                              gΨ + bG (reduce-scatter, gathers per unit)
    hybrid  0-1    gΨ (+ bΨ at 1)                 gΨ (the whole gradient across replicas)
    hybrid  2      gΨ + bΨ                        gΨ/k (the owned slice across replicas)
    hybrid  3      gΨ + bG                        gΨ/k
    hpz     3      gΨ + bG                        gΨ/k + bΨ/k (slice reduce-scatter, secondary rebuild)

(flat over one node moves the same bytes intra-node.) Ψ is padded to N·16 elements per unit
(k·16 for hybrid, whose layout spans the shard group). Each step also all-reduces one flag
byte per parameter tensor over the data-parallel group (``grad_flags``; hybrid: over the
shard group and again across replicas). So hpZ cuts the
inter-node bytes of flat stage 3 by (gΨ + bG) / ((g + b)Ψ/k) ≈ k·(g + 2b)/(g + b): 1.5·k in
fp32, and its forward and backward gathers cross no node boundary; hybrid cuts further
(gΨ/k) at the price of optimizer state sharded over k ranks instead of N. Tensor
parallelism (``tp``) stays inside the node: it divides the data-parallel ranks per node and
the block parameters each rank holds; its own activation traffic is not counted here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from zeroshard.layout.bucketing import ALIGN_ELEMENTS

SCOPES = ("flat", "hybrid", "hpz")


@dataclass(frozen=True)
class Topology:
    """Where the ranks are: ``nodes`` × ``gpus_per_node``, tensor parallel degree ``tp``
    inside each node, and the sharding scope of the data-parallel ranks."""

    nodes: int = 1
    gpus_per_node: int = 1
    tp: int = 1
    scope: str = "flat"
    """"flat" (one group over every data-parallel rank), "hybrid" (shard inside the node,
    replicate across: ``mesh=``) or "hpz" (stage 3: ``mesh=..., hpz=True``)."""
    pp: int = 1
    """Pipeline stages (Note [pipeline parallelism]): across nodes where ``pp`` divides the
    nodes (the usual placement: only activations cross), else inside each node."""

    def __post_init__(self) -> None:
        for name in ("nodes", "gpus_per_node", "tp", "pp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} must be an int >= 1")
        if self.gpus_per_node % self.tp:
            raise ValueError(f"tp={self.tp} must divide gpus_per_node={self.gpus_per_node}: tensor "
                             "parallelism stays inside a node")
        if self.scope not in SCOPES:
            raise ValueError(f"scope={self.scope!r}; use one of {SCOPES}")
        if self.nodes % self.pp and self.gpus_per_node % (self.tp * self.pp):
            raise ValueError(f"pp={self.pp} must divide the nodes ({self.nodes}) or the GPUs of a node per tp "
                             f"group ({self.gpus_per_node} // tp {self.tp}): each stage needs whole dp groups")
        if self.pp > 1 and self.scope == "hpz":
            raise ValueError("scope='hpz' is stage 3, which pipeline parallelism (pp > 1) does not run")

    @property
    def pp_across_nodes(self) -> bool:
        return self.pp > 1 and self.nodes % self.pp == 0

    @property
    def node_dp(self) -> int:
        """k: data-parallel ranks per node (of one pipeline stage)."""
        return self.gpus_per_node // self.tp // (1 if self.pp_across_nodes else self.pp)

    @property
    def dp(self) -> int:
        """N: data-parallel ranks in all (of one pipeline stage)."""
        return (self.nodes // self.pp if self.pp_across_nodes else self.nodes) * self.node_dp

    @property
    def shard_size(self) -> int:
        """The ranks optimizer state is sharded over (ZeRO's N in the memory formulas)."""
        return self.node_dp if self.scope == "hybrid" else self.dp


@dataclass(frozen=True)
class StepTraffic:
    intra_node: int
    inter_node: int
    kinds: tuple[tuple[str, str, int], ...]
    """(collective, "intra" or "inter", bytes) per rank and step."""

    def as_dict(self) -> dict:
        return {"intra_node": self.intra_node, "inter_node": self.inter_node,
                "kinds": [list(k) for k in self.kinds]}


def padded(numel: int, ranks: int) -> int:
    """A unit's elements after the layout's padding (zeroshard/layout/bucketing.py)."""
    quantum = ranks * ALIGN_ELEMENTS
    return max(quantum, -(-numel // quantum) * quantum)


def step_traffic(stage: int, topo: Topology, units: Sequence[tuple[int, bool]], param_bytes: int,
                 grad_bytes: int = 4, n_tensors: int = 0) -> StepTraffic:
    """Bytes per rank of one step. ``units``: (elements, is stage 3's root unit) per unit of
    one rank (after tensor parallelism); ``n_tensors``: parameter tensors (the flags)."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage={stage!r} is not a ZeRO stage")
    if topo.scope == "hpz" and stage != 3:
        raise ValueError(f"scope='hpz' partitions stage-3 parameters; stage={stage}")
    R, k, b, g = topo.dp // topo.node_dp, topo.node_dp, param_bytes, grad_bytes  # (R: nodes of one stage)
    sizes = [(padded(n, topo.shard_size), root) for n, root in units]
    psi = sum(p for p, _ in sizes)
    gathered = {0: 0, 1: psi, 2: psi, 3: sum(p * (1 if root else 2) for p, root in sizes)}[stage]
    reduce = "all_reduce" if stage < 2 else "reduce_scatter"
    kinds: list[tuple[str, str, int, int]] = []  # (kind, link, group size, bytes)
    if topo.scope == "flat":
        link = "inter" if R > 1 else "intra"
        kinds += [(reduce, link, topo.dp, g * psi), ("all_gather", link, topo.dp, b * gathered),
                  ("grad_flags", link, topo.dp, n_tensors)]
    else:
        kinds += [(reduce, "intra", k, g * psi), ("all_gather", "intra", k, b * gathered)]
        if topo.scope == "hybrid":
            across = psi if stage < 2 else psi // k
            kinds += [("all_reduce", "inter", R, g * across), ("grad_flags", "intra", k, n_tensors),
                      ("grad_flags", "inter", R, n_tensors)]
        else:  # hpz
            kinds += [("reduce_scatter", "inter", R, g * psi // k), ("all_gather", "inter", R, b * psi // k),
                      ("grad_flags", "inter" if R > 1 else "intra", topo.dp, n_tensors)]
    counted = tuple((kind, link, nbytes) for kind, link, ranks, nbytes in kinds if ranks > 1 and nbytes)
    return StepTraffic(sum(n for _, link, n in counted if link == "intra"),
                       sum(n for _, link, n in counted if link == "inter"), counted)


def measured_links(report: dict, nodes: int) -> dict[str, int]:
    """``comm_report()`` totals by link: dimension "shard" is inside a node, "replicate"
    across nodes, "dp" (one group over every rank) across nodes when there are several."""
    out = {"intra_node": 0, "inter_node": 0}
    for entry in report.values():
        dim = entry["dimension"]
        inter = dim == "replicate" or (dim == "dp" and nodes > 1)
        out["inter_node" if inter else "intra_node"] += entry["bytes"]
    return out
