"""Runs inside each of 3 gloo ranks for tests/dist/test_quantized_sweep.py: every stage x weight
codec x gradient codec (x error feedback) x offload x mesh combination (``combinations``) on a
model of tiny parameters, each either trained a few steps or refused at construction, and the
DeepSpeed failure list of issue 42 through ``zeroshard.initialize``'s DeepSpeed JSON keys.

Each rank writes, per combination, what happened: ``{"ran": True, losses, weights, report keys,
error keys}`` or ``{"ran": False, "type", "message"}``; an exception after construction is
recorded as ``"crash"`` (the test fails on it; the ranks are out of step after it, so the run
stops there rather than hang).
"""
from __future__ import annotations

import itertools
import json
import os
import resource
from typing import Any, Optional

import torch

import zeroshard

STEPS = 2
LR = 1e-2
BLOCK = 8
STAGES = (0, 1, 2, 3)
WEIGHT_CODECS = ("none", "bf16", "fp8", "int8")
GRAD_CODECS = ("none", "bf16", "fp8", "int8", "int4")
OFFLOADS = ("none", "cpu", "nvme")
MESHES = ("flat", "hybrid3x1", "hybrid1x3", "hpz3x1", "hpz1x3")
"""World 3 as a 2-D (nodes, ranks per node) mesh: 3 nodes of one rank or one node of three."""


class Tiny(torch.nn.Module):
    """Parameters of 1, 2, 7, 14 and 35 elements: smaller than the codec block (8) and than the
    world (3), odd, and sizes that divide neither the world nor the block."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = torch.nn.Linear(5, 7), torch.nn.Linear(7, 2), torch.nn.Linear(2, 1)
        self.scale = torch.nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x))))) * self.scale


FULL_CROSS = ("flat",)
"""Meshes that run the whole weight x gradient codec cross in every (stage, offload) context. The
2-D meshes run, per (stage, offload) context, each codec value at least once (``_covering``):
what they add to the flat mesh is their links (one-rank groups, a replicate hop), which every
codec value crosses there; the whole cross on them too would take the sweep past its time budget."""
GRAD_VARIANTS = [(g, ef) for g in GRAD_CODECS[1:] for ef in (False, True)]


def _covering(stage: int) -> list[tuple[str, str, bool]]:
    """none/none, each gradient codec with and without error feedback (weight codecs in turn
    beside them at stage 3), and each weight codec alone."""
    cells = [("none", "none", False)] + [(w, "none", False) for w in WEIGHT_CODECS[1:]]
    cells += [(WEIGHT_CODECS[1 + i % 3] if stage == 3 else "none", g, ef) for i, (g, ef) in enumerate(GRAD_VARIANTS)]
    return cells


def combinations() -> list[tuple[str, str, int, str, str, str, bool]]:
    """(name, mesh, stage, offload, weight codec, grad codec, error feedback) of every row the
    sweep runs; error feedback only where a gradient codec quantizes (without one it is refused
    by ``CollectiveCodecs``: the named case ``ef-without-codec``)."""
    out = []
    for mesh, stage, offload in itertools.product(MESHES, STAGES, OFFLOADS):
        if mesh in FULL_CROSS:
            cells = [(w, g, ef) for w in WEIGHT_CODECS for g in GRAD_CODECS for ef in ((False, True) if g != "none"
                                                                                    else (False,))]
        else:
            cells = _covering(stage)
        for w, g, ef in cells:
            out.append((f"{mesh}/s{stage}/{offload}/w={w}/g={g}{'+ef' if ef else ''}", mesh, stage, offload, w, g, ef))
    return out


_MESHES: dict[str, Any] = {}
"""One DeviceMesh per shape, made once (each makes new gloo groups, with their threads)."""


def _mesh_kwargs(mesh: str) -> dict:
    if mesh == "flat":
        return {}
    from torch.distributed.device_mesh import init_device_mesh
    shape = (3, 1) if mesh.endswith("3x1") else (1, 3)
    if shape not in _MESHES:
        _MESHES[shape] = init_device_mesh("cpu", shape, mesh_dim_names=("node", "local"))
    return {"mesh": _MESHES[shape], "hpz": mesh.startswith("hpz")}


def _offload_kwargs(offload: str, stage: int, nvme: str) -> dict:
    if offload == "none":
        return {}
    out: dict[str, Any] = {"offload_optimizer": offload}
    if stage == 3:
        out["offload_params"] = offload
    if offload == "nvme":
        out["nvme_path"] = nvme
    return out


def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(4, 5, generator=torch.Generator().manual_seed(step * 10 + rank))


def _train(kwargs: dict, rank: int) -> dict:
    """Construct (a refusal is the result), then STEPS steps."""
    model = Tiny()
    try:
        opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=LR, **kwargs)
    except (ValueError, TypeError) as e:
        return {"ran": False, "type": type(e).__name__, "message": str(e)}
    losses, keys = [], set()
    for step in range(STEPS):
        opt.comm_report(reset=True)
        loss = model(_batch(step, rank)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
        keys |= set(opt.comm_report())
    w = zeroshard.full_state_dict(model, rank0_only=False) if kwargs.get("stage") == 3 else dict(
        model.named_parameters())
    out = {"ran": True, "losses": losses, "report": sorted(keys), "errors": sorted(opt.engine.codecs.last_step_error),
           "weights": {n: t.detach().flatten().tolist() for n, t in w.items()}}
    opt.close()
    return out


def _deepspeed(config: dict, rank: int) -> dict:
    """The same tiny model through ``zeroshard.initialize``'s DeepSpeed front and JSON keys."""
    model = Tiny()
    cfg = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": LR}}, **config}
    try:
        engine, opt, _, _ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    except (ValueError, TypeError) as e:
        return {"ran": False, "type": type(e).__name__, "message": str(e)}
    losses, keys = [], set()
    for step in range(STEPS):
        loss = engine(_batch(step, rank)).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
        keys |= set(opt.comm_report())
    stage = config["zero_optimization"]["stage"]
    w = zeroshard.full_state_dict(model, rank0_only=False) if stage == 3 else dict(model.named_parameters())
    out = {"ran": True, "losses": losses, "report": sorted(keys),
           "weights": {n: t.detach().flatten().tolist() for n, t in w.items()}}
    opt.close()
    return out


DEEPSPEED_CASES = {
    # PR #5056: qgZ on sizes that divide neither the world nor the block (DeepSpeed fell back to a
    # plain reduce-scatter): int4 on the wire at stages 2 and 3, against full precision.
    "ds-5056-qgz-odd-sizes-s2": {"zero_optimization": {"stage": 2, "zero_quantized_gradients": True}},
    "ds-5056-qgz-odd-sizes-s3": {"zero_optimization": {"stage": 3, "zero_quantized_gradients": True}},
    "ds-full-s2": {"zero_optimization": {"stage": 2}},
    "ds-full-s3": {"zero_optimization": {"stage": 3}},
    # #5059 / ms-swift #3697: hpZ with offload. At world 3 the partition size 3 is one node
    # (nothing to partition across): refused by name; the native hpZ meshes of the sweep train.
    "ds-5059-hpz-offload": {"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 3,
                                                  "offload_optimizer": {"device": "cpu"},
                                                  "offload_param": {"device": "cpu"}}},
    # #6659: 1- and 2-element parameters with qwZ + qgZ at stage 3 and more ranks than elements.
    "ds-6659-tiny-params": {"zero_optimization": {"stage": 3, "zero_quantized_weights": True,
                                                  "zero_quantized_gradients": True}},
    # #4852: zero_quantized_weights alone (stage 3 trains; stage 2 is refused by name).
    "ds-4852-qwz": {"zero_optimization": {"stage": 3, "zero_quantized_weights": True}},
    "ds-4852-qwz-s2": {"zero_optimization": {"stage": 2, "zero_quantized_weights": True}},
}


def sweep_worker(rank: int, world: int, out_path: str, only: Optional[list[str]] = None) -> None:
    nvme = os.path.join(os.path.dirname(out_path), f"nvme{rank}")
    os.makedirs(nvme, exist_ok=True)
    results: dict[str, Any] = {}
    refs: set[tuple[str, int, str]] = set()
    for name, mesh, stage, offload, w, g, ef in combinations():
        if only is not None and name not in only:
            continue
        kwargs = {"stage": stage, **_mesh_kwargs(mesh), **_offload_kwargs(offload, stage, nvme)}
        if (mesh, stage, offload) not in refs:  # (the full-precision run each combination is held to)
            refs.add((mesh, stage, offload))
            results[f"{mesh}/s{stage}/{offload}/full"] = _guarded(kwargs, rank)
        codec = {"weight_codec": w, "grad_codec": g, "codec_block": BLOCK}
        if ef:
            codec["grad_error_feedback"] = True
        results[name] = _guarded({**kwargs, **codec}, rank)
        if results[name].get("crash"):
            break
    if only is None:
        results["ef-without-codec"] = _guarded({"stage": 2, "grad_error_feedback": True}, rank)
        for name, cfg in DEEPSPEED_CASES.items():
            results[name] = _deepspeed(cfg, rank)
    ru = resource.getrusage(resource.RUSAGE_SELF)  # (this rank's CPU seconds: the quiet-machine estimate)
    results["_cpu_s"] = ru.ru_utime + ru.ru_stime
    with open(f"{out_path}.rank{rank}", "w") as f:
        json.dump(results, f)


def _guarded(kwargs: dict, rank: int) -> dict:
    try:
        return _train(kwargs, rank)
    except Exception as e:  # (anything past construction is a defect the test reports)
        return {"ran": False, "crash": f"{type(e).__name__}: {e}"}
