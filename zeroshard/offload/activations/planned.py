"""``PlannedActivations``: ``offload="auto"`` places activations too, under the same
``memory_budget`` as the state (Note [activations under the budget]).

Note [activations under the budget]: with ``offload_activations=PlannedActivations(micro_batch=,
seq_len=)`` the automatic placement, once it has placed the state (Note [automatic placement] in
zeroshard/planner/auto_placement.py), plans the activations of one micro-batch of that shape
within what the state leaves of the budget (Note [planning activations] in
zeroshard/planner/activation_plan.py): on a CPU-only machine the device and the host are one
memory, so moving activations to host memory frees nothing and the places are keep /
checkpoint / NVMe; with an accelerator, the device budget's remainder holds what stays and
the host budget's remainder what moves to host memory. The per-block choice is applied by the
one activation offloader (Note [activation offload] in offloader.py), which covers exactly the
blocks planned "host" or "nvme" (a "checkpoint" block keeps its input: the model's own
``torch.utils.checkpoint`` does that). With the shape declared, the state's placement and the
activations are chosen together (Note [joint state and activation plan] in
zeroshard/planner/joint_plan.py); measured, the same at the first forward, the state moved to the
chosen placement before the first block (Note [state re-placed at the first forward] in
zeroshard/offload/placement_replan.py; where that cannot be, state first: the activations take what is
left). Either way a budget that cannot hold even the fully offloaded plan is refused naming the longest
sequence that fits and the smallest ``memory_budget`` that holds this sequence.
Blocks the model checkpoints (``checkpointed=True``, the default) move their inputs, which is
what the plan counts, exactly. With ``checkpointed=False`` the plan mixes keep / move / checkpoint /
checkpoint + move per block and the offloader checkpoints the blocks it picks (Note [mixed activation
plans] in zeroshard/planner/activation_mix.py; the first forward measures the last block's saved
bytes, keeping it). With ``checkpointed=False, recompute=False`` a block keeps its saved tensors or
moves them all (``plan_saved``): the estimate of their size is not exact for every model, so the first
forward moves every block (the least device memory any plan has), the offloader measures the
largest block's saved bytes, and the next forward is planned with that measurement (per token,
so a longer sequence later scales it): from then on the bytes moved are the plan's.
The micro-batch's shape is declared (``PlannedActivations(micro_batch=, seq_len=)``: planned at
construction, refused there) or, by default, measured: the offloader hooks every repeated block,
and at each forward's first block the ``ForwardPlanner`` (plan_at_forward.py) reads that block's
input (tokens = its elements / d_model, the micro-batch its first dimension) and plans before any
block has run, so the first step already runs under the plan (no unplanned step: same bits, and
within the budget). A later forward with more tokens than the plan's is planned again there, before
its first block (more blocks move), or refused with the same error naming the longest sequence that
fits, never run over the budget; one with as many or fewer keeps the plan (memory grows with the
tokens, so it still fits).
"""
from __future__ import annotations

import shutil
from typing import Callable, Optional

import torch
from torch import nn

from zeroshard.offload.activations.workload import PlannedActivations
from zeroshard.planner.activation_mix import RECOMPUTED, best_mixed, mix_sizes, mixed_peak, plan_mixed
from zeroshard.planner.activation_plan import (ActivationPlan, best_activations, longest_sequence, plan_activations,
                                               plan_saved)
from zeroshard.planner.auto_placement import MemoryBudget, Plan
from zeroshard.planner.model_shape import ModelShape, parts_of
from zeroshard.planner.sizes import fmt_bytes
from zeroshard.units.tier import Tier

NO_NVME = ("; no nvme_path is set, so no input moves to NVMe (the sequence and budget named are without it): "
           "set nvme_path=<directory on an NVMe drive> to let inputs move there")

_MOVED = {"host": Tier.HOST, "nvme": Tier.NVME, "saved-host": Tier.HOST,
          "saved-nvme": Tier.NVME}  # (the plan's places that leave the device: their tier)


def shape_of(model: nn.Module, n_blocks: int) -> ModelShape:
    """The model's shape for the activation planner, from its ``config`` (a TinyGPT's or a Hugging
    Face model's); a ValueError naming the fix when it has none."""
    cfg = getattr(model, "config", None)

    def get(*names: str) -> int:
        return next((int(getattr(cfg, k)) for k in names if isinstance(getattr(cfg, k, None), int)), 0)
    d, vocab = get("d_model", "hidden_size", "n_embd"), get("vocab", "vocab_size")
    if not d or not vocab:
        raise ValueError(
            f"offload_activations=PlannedActivations(...): {type(model).__name__} has no config giving its width "
            "and vocabulary (d_model/hidden_size, vocab/vocab_size), which the activation plan needs; choose the "
            "blocks by hand: offload_activations=ActivationOffload(where='cpu'|'nvme', blocks=(...))")
    n = max(1, sum(p.numel() for p in model.parameters()))
    return ModelShape(n_params=n, n_layers=n_blocks, d_model=d, n_heads=get("n_heads", "num_attention_heads",
                                                                            "n_head") or 1,
                      vocab=vocab, d_ff=get("d_ff", "intermediate_size", "n_inner"), loss_chunk=get("loss_chunk"),
                      checkpoint_parts=checkpoint_parts_of(model, cfg))


def checkpoint_parts_of(model: nn.Module, cfg: object) -> int:
    """Checkpoints per checkpointed block: as many as a block's ``checkpoint_parts()`` gives (what the
    offloader and TinyGPT checkpoint: Note [checkpoints finer than a block] in
    zeroshard/testing/toy.py), else the config's ``checkpoint_granularity`` ("half": 2), else 1."""
    for m in model.modules():
        parts = getattr(m, "checkpoint_parts", None)
        if callable(parts):
            return max(1, len(parts()))
    return parts_of(cfg)


def memory_left(state: Plan, budget: MemoryBudget, accelerator: bool, nvme_path: Optional[str]) -> dict[str, int]:
    """What the state's plan leaves of the budget for activations: device, host, NVMe bytes."""
    used = state.memory()
    if accelerator:
        device, host = budget.device - used["device"], budget.host - used["host"]
    else:  # (one memory: host copies would free nothing)
        device, host = budget.device + budget.host - used["host"], 0
    nvme = shutil.disk_usage(str(nvme_path)).free if nvme_path else 0
    return {"device": device, "host": max(0, host), "nvme": nvme}  # (device < 0: the state alone is over it)


def plan_for_run(options: PlannedActivations, shape: ModelShape, names: list[str], state: Plan,
                 budget: MemoryBudget, accelerator: bool, nvme_path: Optional[str], act_dtype: torch.dtype,
                 block_bytes: Optional[int] = None) -> tuple[ActivationPlan, dict[str, str], dict[str, int]]:
    """The activation plan of a micro-batch of ``options``' (known) shape within what ``state``
    leaves, each block's place by name (``names``: the model's blocks in order), and the memory it
    was planned in; a ValueError naming the longest sequence and smallest budget that fit. Blocks
    not checkpointed: every block moves until ``block_bytes`` (one block's saved tensors) is measured."""
    assert options.micro_batch is not None and options.seq_len is not None  # (declared or measured by now)
    left = memory_left(state, budget, accelerator, nvme_path)
    act_bytes = torch.empty((), dtype=act_dtype).element_size()
    hint = "" if nvme_path else NO_NVME
    if not options.checkpointed and options.recompute:
        return mixed_for_run(options, shape, names, budget, left, act_bytes, block_bytes, hint)
    if not options.checkpointed:
        try:
            plan = plan_saved(shape, options.micro_batch, options.seq_len, act_bytes, device=left["device"],
                              host=left["host"], nvme=left["nvme"], block_bytes=block_bytes, prefetch=options.prefetch,
                              most_kept=shape.n_layers if block_bytes is not None else 0)
        except ValueError as exc:
            raise ValueError(f"offload='auto': memory_budget ({budget}) leaves {fmt_bytes(left['device'])} for "
                             f"activations after the state; {exc}{hint}") from None
        return plan, dict(zip(names, plan.blocks)), left
    try:
        plan = plan_activations(shape, options.micro_batch, options.seq_len, act_bytes, device=left["device"],
                                host=left["host"], nvme=left["nvme"], prefetch=options.prefetch)
    except ValueError as exc:
        # (the device memory the fully offloaded plan needs, over what the state left: the budget must grow by it)
        grow = max(0, least_device(shape, options, act_bytes, left) - left["device"])
        where = "device" if accelerator else "host"
        smallest = (budget.device if accelerator else budget.device + budget.host) + grow
        longest = longest_sequence(shape, options.micro_batch, act_bytes, below=options.seq_len, device=left["device"],
                                   host=left["host"], nvme=left["nvme"], prefetch=options.prefetch)
        raise ValueError(
            f"offload='auto': memory_budget ({budget}) leaves {fmt_bytes(left['device'])} for activations after the "
            f"state ({fmt_bytes(state.memory()[where])}), which cannot hold a micro-batch of {options.micro_batch} x "
            f"{options.seq_len} tokens even with every block's input offloaded: the longest sequence that fits is "
            f"{longest} tokens, and the smallest memory_budget that holds {options.seq_len} tokens is "
            f"{fmt_bytes(smallest)} ({where}). ({exc}){hint}") from None
    return plan, dict(zip(names, plan.blocks)), left


def joint_activations(options: PlannedActivations, shape: ModelShape, names: list[str], budget: MemoryBudget,
                      nvme_path: Optional[str], act_dtype: torch.dtype
                      ) -> Callable[[Plan, bool], Optional[ActivationPlan]]:
    """The best plan of ``options``' micro-batch (declared, or measured at the first forward) in what a
    state plan leaves (``plan_for_run``), for the joint search (Note [joint state and activation plan] in
    zeroshard/planner/joint_plan.py): None where none fits, or with ``explain`` the refusal (a ValueError
    naming what fits)."""
    assert options.micro_batch is not None and options.seq_len is not None  # (known: the callers check)
    mb, seq = options.micro_batch, options.seq_len
    act_bytes = torch.empty((), dtype=act_dtype).element_size()

    def best(state: Plan, explain: bool = False) -> Optional[ActivationPlan]:
        if not explain:  # (a quick test first: a refusal's message bisects for the longest sequence)
            left = memory_left(state, budget, state.accelerator, nvme_path)
            device, host, nvme = left["device"], left["host"], left["nvme"]
            quick = (best_activations(shape, mb, seq, act_bytes, device=device, host=host, nvme=nvme,
                                      prefetch=options.prefetch)
                     if options.checkpointed else
                     best_mixed(shape, mb, seq, act_bytes, device=device, host=host, nvme=nvme,
                                prefetch=options.prefetch) if options.recompute else True)
            if quick is None:
                return None
        try:
            return plan_for_run(options, shape, names, state, budget, state.accelerator, nvme_path, act_dtype)[0]
        except ValueError:
            if explain:
                raise
            return None
    return best


def mixed_for_run(options: PlannedActivations, shape: ModelShape, names: list[str], budget: MemoryBudget,
                  left: dict[str, int], act_bytes: int, block_bytes: Optional[int],
                  hint: str = "") -> tuple[ActivationPlan, dict[str, str], dict[str, int]]:
    """Blocks not checkpointed by the model, the offloader checkpointing the ones the plan picks (Note
    [mixed activation plans] in zeroshard/planner/activation_mix.py). Before ``block_bytes`` is
    measured: the first forward checkpoints every block and moves its input but the last, which it
    keeps and whose saved bytes it measures (the last: freed as backward starts, before any
    recompute), once the estimate shows some plan fits; its predicted time is the estimate's (the
    plan from the second forward on)."""
    assert options.micro_batch is not None and options.seq_len is not None
    try:
        plan = plan_mixed(shape, options.micro_batch, options.seq_len, act_bytes, block_bytes=block_bytes,
                          device=left["device"], host=left["host"], nvme=left["nvme"], prefetch=options.prefetch)
    except ValueError as exc:
        raise ValueError(f"offload='auto': memory_budget ({budget}) leaves {fmt_bytes(left['device'])} for "
                         f"activations after the state; {exc}{hint}") from None
    if block_bytes is None:
        s = mix_sizes(shape, options.micro_batch, options.seq_len, act_bytes, block_bytes=None,
                      prefetch=options.prefetch)
        n = shape.n_layers
        moved = (n - 1) * s.input
        on_host = left["host"] >= moved
        if on_host or left["nvme"] >= moved:
            places = ("host" if on_host else "nvme",) * (n - 1) + ("keep",)
            plan = ActivationPlan(places, mixed_peak(s, 1, 0, [s.input] * (n - 1)), moved if on_host else 0,
                                  0 if on_host else moved, 2 * moved, plan.extra_seconds)
        else:  # (no room to move the inputs, no NVMe directory: they stay, checkpointed)
            peak = mixed_peak(s, 1, n - 1, [])
            if peak > left["device"]:
                raise ValueError(
                    f"offload='auto': memory_budget ({budget}) leaves {fmt_bytes(left['device'])} for activations "
                    f"after the state, and the first forward (which measures a block's saved tensors) needs "
                    f"{fmt_bytes(peak)} with every block checkpointed and no input moved: no nvme_path is set and "
                    f"host memory cannot take {fmt_bytes(moved)} of inputs; set nvme_path=<directory> so they move "
                    "to NVMe, or raise memory_budget")
            plan = ActivationPlan(("checkpoint",) * (n - 1) + ("keep",), peak, 0, 0, 0, plan.extra_seconds)
    return plan, dict(zip(names, plan.blocks)), left


def least_device(shape: ModelShape, options: PlannedActivations, act_bytes: int, left: dict[str, int]) -> int:
    """Device bytes the fully offloaded plan needs (what stays whatever the plan: the embeddings'
    and logits' activations and one block's saved tensors), with ``left``'s NVMe space (none
    without nvme_path: then the inputs that host memory cannot take stay; unbounded if not given)."""
    nvme = left.get("nvme", 1 << 62)
    assert options.micro_batch is not None and options.seq_len is not None
    low, high = 0, plan_activations(shape, options.micro_batch, options.seq_len, act_bytes, device=1 << 62,
                                    host=0, nvme=1 << 62, prefetch=options.prefetch).device_bytes
    while high - low > 1:  # (the least device memory with any plan, by bisection: the planner's own test)
        mid = (low + high) // 2
        try:
            plan_activations(shape, options.micro_batch, options.seq_len, act_bytes, device=mid, host=left["host"],
                             nvme=nvme, prefetch=options.prefetch)
            high = mid
        except ValueError:
            low = mid
    return high


def moved_blocks(places: dict[str, str]) -> dict[str, Tier]:
    """The blocks the plan moves off the device, and where to."""
    return {n: _MOVED[p] for n, p in places.items() if p in _MOVED}


def plan_report(plan: ActivationPlan, places: dict[str, str], options: PlannedActivations,
                left: dict[str, int]) -> dict:
    return {"micro_batch": options.micro_batch, "seq_len": options.seq_len, "blocks": places,
            "counts": plan.counts(), "offloaded": list(moved_blocks(places)),
            "device_bytes": plan.device_bytes, "host_bytes": plan.host_bytes, "nvme_bytes": plan.nvme_bytes,
            "moved_per_step": plan.moved_per_step, "memory_left": left, "summary": plan.summary(),
            "recompute": [n for n, p in places.items() if p in RECOMPUTED] if not options.checkpointed and options.recompute else []}
