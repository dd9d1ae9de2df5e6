"""Per-GPU, CPU and NVMe bytes of each stage/offload choice, and which ones fit.

Model states follow ``zeroshard.zero_formula`` (the ZeRO paper's formulas with the byte
widths zeroshard uses); offload moves categories off the GPU the way DeepSpeed's
ZeRO-Offload / ZeRO-Infinity do (see ``_placement``). Activations come from
``activations.py``; buffers from the bucket and gather sizes zeroshard allocates.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch

from zeroshard.config import Placement, check_offload
from zeroshard.memory import MemoryReport, zero_formula
from zeroshard.planner.activations import activation_bytes
from zeroshard.planner.model_shape import ModelShape
from zeroshard.planner.traffic import StepTraffic, Topology, step_traffic

_PRECISIONS = (None, "bf16", "fp16")
_AN_ACCELERATOR = torch.device("cuda")
"""Any device but the host (nothing is allocated on it): where ``Placement`` puts state that it
moves off such a device is host memory."""


def _state_in_host_memory(placement: Placement) -> bool:
    """Master, gradients and moments live in host memory (``offload_optimizer="cpu"``): moved
    off the device, and not into a swap file."""
    return placement.optimizer_device(_AN_ACCELERATOR).type == "cpu" and not placement.state_swapped


def _params_in_host_memory(placement: Placement) -> bool:
    """Stage-3 shards live in host memory between gathers (``offload_params="cpu"``): moved off
    the device, and not into a swap file."""
    return placement.param_device(_AN_ACCELERATOR).type == "cpu" and not placement.params_swapped


@dataclass(frozen=True)
class Hardware:
    """The machine to plan for: ``nodes`` alike, the GPUs of a node sharing its CPU memory and NVMe."""

    gpu_memory: int
    """Bytes of memory per GPU (per rank)."""
    n_gpus: int = 1
    """GPUs per node (with one node and no tensor parallelism: the N that ZeRO divides by)."""
    cpu_memory: int = 0
    """Bytes of CPU memory of the node, shared by all ranks."""
    nvme: int = 0
    """Bytes of free NVMe space for offload swap files."""
    usable_fraction: float = 0.9
    """Share of each memory that training may use (CUDA context, allocator fragmentation
    and the OS take the rest)."""
    accelerator: bool = True
    """False when the model itself trains in CPU memory ("gpu_memory" is then that memory):
    "cpu" offload moves nothing there and fp32 training keeps no separate master copy."""
    nodes: int = 1
    """Nodes of ``n_gpus`` GPUs each (``Topology``: which links the collectives cross)."""

    def __post_init__(self) -> None:
        if self.gpu_memory <= 0:
            raise ValueError(f"gpu_memory={self.gpu_memory!r} must be > 0 bytes, e.g. --gpu-memory 80GB")
        if self.n_gpus < 1:
            raise ValueError(f"n_gpus={self.n_gpus!r} must be >= 1")
        if self.cpu_memory < 0 or self.nvme < 0:
            raise ValueError(f"cpu_memory={self.cpu_memory!r} and nvme={self.nvme!r} must be >= 0")
        if not 0 < self.usable_fraction <= 1:
            raise ValueError(f"usable_fraction={self.usable_fraction!r} must be in (0, 1]")
        if not isinstance(self.nodes, int) or isinstance(self.nodes, bool) or self.nodes < 1:
            raise ValueError(f"nodes={self.nodes!r} must be an int >= 1")


@dataclass(frozen=True)
class Workload:
    """How the model is trained: what sets activation and buffer sizes."""

    micro_batch: int = 1
    """Sequences per rank per forward pass."""
    seq_len: int = 1024
    mixed_precision: Optional[str] = "bf16"
    """None (fp32), "bf16" or "fp16", as ``ZeroOptimizer(mixed_precision=...)``."""
    optim_bytes_per_param: float = 8
    """Optimizer state per parameter: 8 for Adam/AdamW (two fp32 moments), 4 SGD momentum,
    Muon's recipe and Adafactor by the model (``optimizer_state.optimizer_bytes_per_param``)."""
    bucket_size_mb: float = 25.0
    max_inflight_buckets: int = 2
    max_live_units: int = 2
    eager_attention: bool = False
    """True if attention materialises the s × s scores (no fused SDPA kernel)."""
    trainable_fraction: float = 1.0
    """Share of the parameters that train; the rest is frozen (a LoRA base): weights only, in
    the model dtype, partitioned at stage 3 and placed by ``offload_params`` like the others."""
    tp: int = 1
    """Tensor-parallel degree inside a node: blocks split over ``tp`` GPUs (zeroshard shards the
    data-parallel dimension); embeddings and the head stay whole."""
    scope: str = "flat"
    """Data-parallel sharding scope: "flat", "hybrid" or "hpz" (``zeroshard.planner.traffic``)."""
    pp: int = 1
    """Pipeline stages: each rank holds ⌈layers / pp⌉ blocks (and, conservatively, the
    embeddings and head), sharded over the stage's dp ranks; 1F1B keeps up to ``pp``
    micro-batches' activations on the first stage. Stages 0-2 only (Note [pipeline parallelism])."""

    def __post_init__(self) -> None:
        if self.micro_batch < 1 or self.seq_len < 1:
            raise ValueError(f"micro_batch={self.micro_batch!r} and seq_len={self.seq_len!r} must be >= 1")
        if self.mixed_precision not in _PRECISIONS:
            raise ValueError(f"mixed_precision={self.mixed_precision!r}; use one of {_PRECISIONS}")
        if self.optim_bytes_per_param < 0:
            raise ValueError(f"optim_bytes_per_param={self.optim_bytes_per_param!r} must be >= 0")
        if not 0 < self.trainable_fraction <= 1:
            raise ValueError(f"trainable_fraction={self.trainable_fraction!r} must be in (0, 1] (LoRA: ~0.01)")
        Topology(tp=self.tp, gpus_per_node=self.tp * self.pp, scope=self.scope, pp=self.pp)  # (their checks)

    @property
    def param_bytes(self) -> int:
        return 4 if self.mixed_precision is None else 2


@dataclass(frozen=True)
class Choice:
    """One configuration ``ZeroOptimizer`` can run."""

    stage: int
    offload_optimizer: Optional[str] = None
    offload_params: Optional[str] = None
    activation_checkpointing: bool = False

    def __post_init__(self) -> None:
        if self.stage not in (0, 1, 2, 3):
            raise ValueError(f"stage={self.stage!r} is not a ZeRO stage; use 0, 1, 2 or 3")
        check_offload(self.stage, self.offload_optimizer, self.offload_params)  # (Note [one validator])

    @property
    def placement(self) -> Placement:
        """Where this choice keeps every unit's state (as ``ZeroConfig.placement``)."""
        return Placement(self.offload_optimizer, self.offload_params)

    def zero_kwargs(self) -> dict:
        """The ``ZeroOptimizer`` arguments of this choice (offloads only when set)."""
        kw: dict = {"stage": self.stage}
        kw.update({k: v for k, v in (("offload_optimizer", self.offload_optimizer),
                                     ("offload_params", self.offload_params)) if v})
        return kw

    @property
    def label(self) -> str:
        parts = [f"stage {self.stage}"]
        if self.offload_optimizer:
            parts.append(f"optim→{self.offload_optimizer}")
        if self.offload_params:
            parts.append(f"params→{self.offload_params}")
        if self.activation_checkpointing:
            parts.append("act-ckpt")
        return " + ".join(parts)

    @property
    def relative_cost(self) -> float:
        """A speed *ordering*, not a prediction: compute 1.0; activation checkpointing re-runs
        the forward (+1/3); stage 3 adds a parameter all-gather in backward (1.5× the traffic
        of stages 0-2, which all move one all-reduce's worth); offload adds PCIe/NVMe
        traffic and a CPU optimizer step. Stages 0-2 tie: ``Plan.recommended`` then takes the
        one that leaves the most GPU memory free."""
        cost = 1.0 + (1 / 3 if self.activation_checkpointing else 0.0) + (0.15 if self.stage == 3 else 0.0)
        p = self.placement
        cost += 1.2 if p.state_swapped else 0.4 if _state_in_host_memory(p) else 0.0
        cost += 1.8 if p.params_swapped else 0.6 if _params_in_host_memory(p) else 0.0
        return cost


def all_choices() -> list[Choice]:
    out = []
    for ckpt in (False, True):
        out += [Choice(s, activation_checkpointing=ckpt) for s in (0, 1, 2, 3)]
        out += [Choice(s, o, activation_checkpointing=ckpt) for s in (1, 2, 3) for o in ("cpu", "nvme")]
        out += [Choice(3, o, "cpu", activation_checkpointing=ckpt) for o in ("cpu", "nvme")]
        out.append(Choice(3, "nvme", "nvme", activation_checkpointing=ckpt))  # needs both on NVMe
    return out


@dataclass(frozen=True)
class Estimate:
    choice: Choice
    gpu_states: MemoryReport
    """Model states (and, in ``buffers``, bucket/gather buffers) on each GPU."""
    activations: int
    cpu_per_rank: int
    """Offloaded model states plus pinned staging buffers, per rank."""
    nvme_per_rank: int
    checkpoint_async_cpu: int
    """Extra CPU memory of the node for an async checkpoint save (staging copies of what every
    rank saves; a synchronous save writes from the live tensors and needs none)."""
    n_gpus: int
    fits: bool = False
    why_not: str = ""
    traffic: Optional[StepTraffic] = None
    """Bytes per rank and step over intra- and inter-node links (zeroshard/planner/traffic.py)."""

    @property
    def gpu_total(self) -> int:
        return self.gpu_states.model_states + self.gpu_states.buffers + self.activations

    @property
    def cpu_total(self) -> int:
        return self.cpu_per_rank * self.n_gpus

    @property
    def nvme_total(self) -> int:
        return self.nvme_per_rank * self.n_gpus


def _placement(choice: Choice, full: MemoryReport, shard_numel: int, run_numel: int, n_runs: int, w: Workload,
               accelerator: bool) -> tuple[MemoryReport, int, int]:
    """Splits the formula's per-rank bytes into (device, CPU, NVMe) as zeroshard places them
    (``Placement`` in zeroshard/config.py):

    - optimizer offload "cpu": the fp32 gradient store, a separate fp32 master slice (4Ψ/N,
      even for fp32 models: the device keeps its own parameters) and the optimizer states
      live in host memory; "nvme" keeps all three in swap files and streams them through a
      few host buffers, each about the size of the largest run (a unit's slice);
    - parameter offload (stage 3, "cpu"): the rank's parameter slice lives in host memory and
      only gathered units (``buffers``) stay on the device; "nvme" (with the optimizer on
      NVMe too) keeps every per-parameter byte in swap files.

    Without an accelerator the host *is* the device: nothing moves and no master is added.
    """
    params, grads, master, optim = full.parameters, full.gradients, full.master_weights, full.optimizer_states
    cpu = nvme = 0
    placement = choice.placement
    if placement.state_swapped:
        # Moments, gradients, a separate fp32 master and (offload_params="nvme") the shards in
        # swap files (zeroshard/offload/nvme_state.py, unit_swap.py). The host keeps min(3,
        # runs) buffers of the largest run for the moments (optimizer state) and, transiently
        # (buffers), the two or three units of the step's read-update-write pipeline.
        separate = 4 * shard_numel if accelerator else master
        shards = params if placement.params_swapped else 0
        nvme += optim + grads + separate + shards
        pool = int(min(3, n_runs) * run_numel * w.optim_bytes_per_param)
        unit_bytes = 4 + (4 if separate else 0) + (w.param_bytes if shards else 0)
        working = min(3, n_runs) * run_numel * unit_bytes
        params, grads, master = params - shards, 0, 0
        if accelerator:
            cpu += pool + working
            return MemoryReport(params, 0, 0, 0), cpu, nvme
        return MemoryReport(params, 0, 0, pool, buffers=working), cpu, nvme
    elif _state_in_host_memory(placement):
        if accelerator:
            cpu += grads + 4 * shard_numel + optim
            grads = master = optim = 0
    if _params_in_host_memory(placement) and accelerator:
        cpu += params
        params = 0
    return MemoryReport(params, grads, master, optim), cpu, nvme


def _buffers(choice: Choice, shape: ModelShape, w: Workload) -> int:
    """Stage 0-2: up to ``max_inflight_buckets`` fp32 gradient buckets. Stage 3 adds the
    gather buffers of ``max_live_units`` blocks plus the root unit (embeddings, head)."""
    bucket_numel = int(w.bucket_size_mb * 2**20) // w.param_bytes
    trained = shape.n_params * w.trainable_fraction  # (frozen weights have no gradient buckets)
    buckets = int(min(w.max_inflight_buckets * bucket_numel, trained) * 4)
    if choice.stage < 3:
        return buckets
    root = max(0, shape.n_params - shape.n_layers * shape.block_params)
    gathered = (min(w.max_live_units, shape.n_layers) * shape.block_params + root) * w.param_bytes
    grad_buckets = int(min(w.max_inflight_buckets * shape.block_params * w.trainable_fraction, trained) * 4)
    return gathered + grad_buckets


def _per_rank(shape: ModelShape, tp: int) -> ModelShape:
    """What one rank of a tensor-parallel group holds: 1/tp of every block."""
    if tp == 1:
        return shape
    root = max(0, shape.n_params - shape.n_layers * shape.block_params)
    block = max(1, shape.block_params // tp)
    return replace(shape, n_params=root + shape.n_layers * block, block_numel=block)


def _per_stage(shape: ModelShape, pp: int) -> ModelShape:
    """What one pipeline stage holds: ⌈layers / pp⌉ blocks and the root (embeddings, head:
    the first and last stages hold parts of it; counted whole, an upper bound)."""
    if pp == 1:
        return shape
    root = max(0, shape.n_params - shape.n_layers * shape.block_params)
    layers = -(-shape.n_layers // pp)
    return replace(shape, n_params=root + layers * shape.block_params, n_layers=layers,
                   block_numel=shape.block_params)


def _units(shape: ModelShape, stage: int, w: Workload) -> list[tuple[int, bool]]:
    """(elements, is the root unit) per unit: blocks and the root at stage 3, buckets below."""
    if stage == 3:
        root = shape.n_params - shape.n_layers * shape.block_params
        return [(shape.block_params, False)] * shape.n_layers + ([(root, True)] if root > 0 else [])
    bucket = max(1, int(w.bucket_size_mb * 2**20) // w.param_bytes)
    full, rest = divmod(shape.n_params, bucket)
    return [(bucket, False)] * full + ([(rest, False)] if rest else [])


def estimate(choice: Choice, shape: ModelShape, hw: Hardware, w: Workload) -> Estimate:
    topo = Topology(hw.nodes, hw.n_gpus, w.tp, w.scope, w.pp)
    n = topo.shard_size
    shape = _per_stage(_per_rank(shape, w.tp), w.pp)
    # (traffic: every parameter gathered; frozen ones reduce no gradient, which step_traffic
    # does not know: its gradient bytes are an upper bound under a trainable fraction)
    traffic = step_traffic(choice.stage, topo, _units(shape, choice.stage, w), w.param_bytes)
    trained = max(1, round(shape.n_params * w.trainable_fraction))
    full = zero_formula(choice.stage, trained, n, param_bytes=w.param_bytes,
                        mixed_precision=w.mixed_precision is not None,
                        optim_bytes_per_param=w.optim_bytes_per_param)
    # Frozen weights (Note [frozen units]): the model dtype only, divided by N at stage 3.
    frozen = (shape.n_params - trained) * w.param_bytes // (n if choice.stage == 3 else 1)
    full = replace(full, parameters=full.parameters + frozen, frozen=frozen)
    if w.scope == "hpz":  # the secondary partition: p·Ψ/k per rank on the device (Note [hpZ secondary partition])
        full = replace(full, secondary=w.param_bytes * shape.n_params // topo.node_dp)
    bucket_numel = int(w.bucket_size_mb * 2**20) // w.param_bytes
    run_numel = (shape.block_params if choice.stage == 3 else min(bucket_numel, shape.n_params)) // n
    n_runs = shape.n_layers + 1 if choice.stage == 3 else -(-shape.n_params // max(1, bucket_numel))
    gpu, cpu, nvme = _placement(choice, full, trained // n, run_numel, n_runs, w, hw.accelerator)
    gpu = MemoryReport(gpu.parameters, gpu.gradients, gpu.master_weights, gpu.optimizer_states,
                       buffers=_buffers(choice, shape, w) + gpu.buffers, secondary=full.secondary,  # (on the device)
                       frozen=frozen if choice.offload_params is None or not hw.accelerator else 0)
    act = w.pp * activation_bytes(shape, w.micro_batch, w.seq_len, w.param_bytes,
                                  checkpointing=choice.activation_checkpointing, eager_attention=w.eager_attention)
    params = full.parameters - frozen  # checkpoints hold what trains (Note [frozen weights in checkpoints])
    saved = params // (1 if choice.stage == 3 else n) + full.master_weights + full.optimizer_states
    if choice.stage == 0:
        saved = params // n + (full.master_weights + full.optimizer_states) // n  # ranks split the writing
    est = Estimate(choice, gpu, act, cpu, nvme, checkpoint_async_cpu=saved * hw.n_gpus, n_gpus=hw.n_gpus,
                   traffic=traffic)
    return _judge(est, hw)


def _judge(est: Estimate, hw: Hardware) -> Estimate:
    over = []
    limits = (("GPU", est.gpu_total, hw.gpu_memory), ("CPU", est.cpu_total, hw.cpu_memory),
              ("NVMe", est.nvme_total, hw.nvme))
    for name, need, have in limits:
        usable = have if name == "NVMe" else int(have * hw.usable_fraction)
        if need > usable:
            over.append(f"{name} needs {need / max(usable, 1):.2f}x what is usable" if usable else f"no {name}")
    return replace(est, fits=not over, why_not="; ".join(over))


@dataclass(frozen=True)
class Plan:
    shape: ModelShape
    hardware: Hardware
    workload: Workload
    estimates: tuple[Estimate, ...]

    @property
    def recommended(self) -> Optional[Estimate]:
        """The fitting choice with the lowest ``Choice.relative_cost`` (ties: the least GPU
        memory, i.e. the most headroom for a larger batch), or None."""
        fitting = [e for e in self.estimates if e.fits]
        return min(fitting, key=lambda e: (round(e.choice.relative_cost, 6), e.gpu_total)) if fitting else None


def plan(shape: ModelShape, hw: Hardware, w: Workload, choices: Optional[list[Choice]] = None) -> Plan:
    choices = choices or [c for c in all_choices() if (w.scope != "hpz" or c.stage == 3)  # (hpZ is stage 3)
                          and (w.pp == 1 or (c.stage < 3 and not c.placement.state_swapped))]  # (what pp runs)
    return Plan(shape, hw, w, tuple(estimate(c, shape, hw, w) for c in choices))
