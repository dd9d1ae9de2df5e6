"""``convert_deepspeed(ckpt, out)``: a DeepSpeed ZeRO checkpoint (stages 0-3) as a zeroshard one.

DeepSpeed (0.19) writes, per tag directory:
- model states: ``mp_rank_00_model_states.pt`` (stages 0-2; the full module state) or one
  ``zero_pp_rank_<r>_mp_rank_00_model_states.pt`` per rank (stage 3; buffers and empty
  parameters), each with ``param_shapes`` (per param group: name -> shape, in flat order),
  ``buffer_names``, ``frozen_param_shapes``/``frozen_param_fragments``, ``shared_params``,
  ``lr_scheduler``, ``global_steps``, ``ds_config`` and the client state;
- optimizer partitions: ``[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt`` per rank. At
  stages 1-2 rank r holds the r-th equal slice of each group's flat fp32 buffer (params in
  ``param_shapes`` order, ``param_alignment_paddings`` after each); at stage 3 each parameter is
  split on its own into ``ceil(numel / world)`` elements per rank. The optimizer's moments
  have the layout of the fp32 partition they sit beside.

The flat partitions are reassembled per parameter (as DeepSpeed's ``zero_to_fp32.py`` does,
moments too), loaded into a model of the same names and shapes and a ZeroOptimizer at world 1,
and written with ``zeroshard.save_checkpoint``: a checkpoint that loads at any world size.
Files are read with ``restricted_unpickler.load_pt`` (no pickled code runs; deepspeed is not
imported). The schedule position, the engine's counters and the client state travel as the
front's ``DeepSpeedEngine.load_checkpoint`` reads them.
"""
from __future__ import annotations

import argparse
import math
import os
import re
import warnings
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from zeroshard.checkpoint import save_checkpoint
from zeroshard.checkpoint.jsontree import encode
from zeroshard.deepspeed_compat.engine import check_tag, read_latest_tag
from zeroshard.deepspeed_compat.partitions import check_partitions
from zeroshard.deepspeed_compat.restricted_unpickler import StandIn, load_pt
from zeroshard.optim.zero_optimizer import ZeroOptimizer
from zeroshard.train.deepspeed_config import translate

_MODEL = re.compile(r"(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt")
_OPTIM = re.compile(r"(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt")
_DS_KEYS = frozenset({
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
    "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
    "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size", "ds_config", "ds_version",
    "checkpoint_parallel_dimensions", "universal_checkpoint_info"})
"""DeepSpeed's own entries of a model-states file; the others are the client state."""
_HPARAMS = ("lr", "betas", "eps", "weight_decay", "momentum", "dampening", "nesterov", "amsgrad", "maximize")


def _tag_dir(ckpt: str, tag: Optional[str]) -> str:
    """The directory holding the ``.pt`` files: ``ckpt`` itself, or ``ckpt/tag`` (``tag``
    default: what ``ckpt/latest`` names)."""
    if tag is None and any(_MODEL.fullmatch(n) for n in os.listdir(ckpt)):
        return ckpt
    tag = tag if tag is not None else read_latest_tag(ckpt)
    if tag is None:
        raise ValueError(f"{ckpt} holds no *_model_states.pt and no 'latest' file; pass the tag directory "
                         "(e.g. CKPT/global_step100) or tag=...")
    path = os.path.join(ckpt, check_tag(tag, "convert_deepspeed"))
    if not os.path.isdir(path):
        raise ValueError(f"{path} (tag {tag!r}) is not a directory")
    return path


def _files(path: str) -> tuple[list[str], list[str]]:
    models: dict[int, str] = {}
    optims: dict[int, str] = {}
    for name in sorted(os.listdir(path)):
        m, o = _MODEL.fullmatch(name), _OPTIM.fullmatch(name)
        match = m or o
        if match is None:
            continue
        if int(match.group(2 if m else 3)) != 0:
            raise ValueError(f"{name}: model (tensor/pipeline) parallel DeepSpeed checkpoints are not supported; "
                             "only data-parallel ZeRO ones (mp_rank_00)")
        if m is not None:
            models[int(m.group(1) or 0)] = os.path.join(path, name)
        else:
            optims[int(match.group(2))] = os.path.join(path, name)
    if not models:
        raise ValueError(f"{path} holds no DeepSpeed *_model_states.pt file")
    for what, got in (("model states", models), ("optimizer states", optims)):
        if got and sorted(got) != list(range(len(got))):
            raise ValueError(f"{path}: {what} files for ranks {sorted(got)}: some are missing")
    return [models[r] for r in sorted(models)], [optims[r] for r in sorted(optims)]


def _stage_of(osd: object, path: str) -> int:
    """DeepSpeed's ZeroStageEnum (read as a StandIn) or a plain int, from ``path``'s optimizer states."""
    if not isinstance(osd, dict) or "zero_stage" not in osd:
        raise ValueError(f"{path}: its optimizer_state_dict has no 'zero_stage' field; not a DeepSpeed ZeRO "
                         "optimizer-states file, or a damaged one")
    v = osd["zero_stage"]
    value = v.value if isinstance(v, StandIn) else v
    if isinstance(value, bool) or not isinstance(value, int) or value not in (0, 1, 2, 3):
        raise ValueError(f"{path}: zero_stage={value!r}; expected a ZeRO stage 0-3")
    return value


def _optimizer_states(path: str) -> dict:
    loaded = load_pt(path)
    if not isinstance(loaded, dict) or not isinstance(loaded.get("optimizer_state_dict"), dict):
        raise ValueError(f"{path} is not a DeepSpeed optimizer-states file (no 'optimizer_state_dict')")
    return loaded["optimizer_state_dict"]


def _int_field(ms: dict, key: str, path: str) -> int:
    """A counter of the model states (``global_steps`` & co.): an int, or the file is refused."""
    v = ms.get(key, 0)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(f"{path}: {key}={v!r} is not a non-negative integer")
    return v


def _full_tensors(stage: int, world: int, shapes: list[dict], flats: list[list[torch.Tensor]],
                  paddings: Optional[list]) -> dict[str, torch.Tensor]:
    """name -> full flat fp32 tensor, from ``flats[rank][group]`` partitions."""
    out: dict[str, torch.Tensor] = {}
    if stage <= 2:
        for g, group in enumerate(shapes):
            full = torch.cat([flats[r][g].reshape(-1) for r in range(world)])
            offset = 0
            for i, (name, shape) in enumerate(group.items()):
                n = math.prod(shape)
                if offset + n > full.numel():
                    raise ValueError(f"the partitions of group {g} hold {full.numel()} elements; {name} needs more")
                out[name] = full[offset:offset + n].clone()
                offset += n + (int(paddings[g][i]) if paddings else 0)
        return out
    per_rank = [torch.cat([t.reshape(-1) for t in flats[r]]) for r in range(world)]
    offset = 0
    for group in shapes:
        for name, shape in group.items():
            n = math.prod(shape)
            part = -(-n // world)
            if offset + part > per_rank[0].numel():
                raise ValueError(f"the stage-3 partitions hold {per_rank[0].numel()} elements per rank; {name} "
                                 "needs more")
            out[name] = torch.cat([per_rank[r][offset:offset + part] for r in range(world)])[:n].clone()
            offset += part
    return out


class _Holder(nn.Module):
    """A model with the checkpoint's parameter and buffer names (nested by their dots)."""

    def _parent(self, name: str) -> tuple[nn.Module, str]:
        *path, leaf = name.split(".")
        module: nn.Module = self
        for part in path:
            child = module._modules.get(part)
            if child is None:
                child = nn.Module()
                module.add_module(part, child)
            module = child
        return module, leaf

    def put(self, name: str, value: torch.Tensor, parameter: bool, trainable: bool = True) -> None:
        module, leaf = self._parent(name)
        if parameter:
            module.register_parameter(leaf, nn.Parameter(value, requires_grad=trainable))
        else:
            module.register_buffer(leaf, value)

    def tie(self, name: str, source: str) -> None:
        module, leaf = self._parent(name)
        module.register_parameter(leaf, self.get_parameter(source))


class _Position:
    """The schedule position DeepSpeed saved, as zeroshard's schedules store it (Note
    [DeepSpeed step offset] in train/schedules.py: last_epoch = last_batch_iteration + 1)."""

    def __init__(self, state: object) -> None:
        self.state = state

    def state_dict(self) -> dict:
        if isinstance(self.state, dict) and set(self.state) == {"last_batch_iteration"}:
            done = int(self.state["last_batch_iteration"]) + 1
            return {"last_epoch": done, "_step_count": done + 1}
        if not isinstance(self.state, dict):
            raise ValueError(f"the checkpoint's lr_scheduler state is a {type(self.state).__name__}, not a dict")
        return self.state  # (a client scheduler's own state dict, plain data)


def _plain(value: object, key: str) -> object:
    """Client state as JSON can hold it: a Namespace (``args``) as its fields; the rest is
    kept if checkpoints can store it, else dropped with a warning naming the key."""
    if isinstance(value, StandIn):
        value = dict(value.state)
    try:
        encode(value, key)
    except TypeError as exc:
        warnings.warn(f"client state {key!r} left out of the converted checkpoint: {exc}", stacklevel=3)
        return None
    return value


def convert_deepspeed(ckpt: str, out: str, tag: Optional[str] = None,
                      process_group: Optional[dist.ProcessGroup] = None) -> str:
    """Converts the DeepSpeed checkpoint ``ckpt`` (a save dir with ``latest``, or a tag
    directory) into a zeroshard checkpoint under ``out``; returns the step directory.
    ``process_group``: a group of this one process when called inside a distributed job."""
    if not isinstance(ckpt, (str, os.PathLike)) or not os.path.isdir(ckpt):
        raise ValueError(f"{ckpt!r} is not a directory (a DeepSpeed save dir or tag dir)")
    if process_group is None and dist.is_initialized() and dist.get_world_size() > 1:
        raise ValueError("convert_deepspeed runs in one process: call it outside the distributed job (the "
                         "`zeroshard convert-deepspeed` command), or pass process_group=a group of one rank")
    model_files, optim_files = _files(_tag_dir(os.fspath(ckpt), tag))
    ms = load_pt(model_files[0])
    if not isinstance(ms, dict) or "module" not in ms or "buffer_names" not in ms:
        raise ValueError(f"{model_files[0]} is not a DeepSpeed model-states file (no 'module'/'buffer_names')")
    ds_config = ms.get("ds_config") or {}
    module_sd = ms["module"]
    buffers = {n: module_sd[n] for n in ms["buffer_names"]}
    shapes = [{n: tuple(s) for n, s in g.items()} for g in (ms.get("param_shapes") or [])]
    osds = [_optimizer_states(f) for f in optim_files]
    counters = {k: _int_field(ms, k, model_files[0]) for k in ("global_steps", "global_samples", "skipped_steps")}
    if osds:
        stages = [_stage_of(o, f) for o, f in zip(osds, optim_files)]
        stage, world = stages[0], len(osds)
        if any(s != stage for s in stages):
            raise ValueError(f"the optimizer files record ZeRO stages {stages} ({optim_files}): they are not "
                             "of one checkpoint")
    else:
        stage, world = 0, 1
    # -- masters, moments and per-group scalars ---------------------------------------------------
    states: dict[str, dict[str, torch.Tensor]] = {}
    saved_groups: list[dict] = []
    if stage == 0:
        opt_sd = ms.get("optimizer")
        if not isinstance(opt_sd, dict) or "state" not in opt_sd:
            raise ValueError(f"{model_files[0]} holds no optimizer state (stage 0 keeps it in the model states)")
        names = [n for n in module_sd if n not in buffers]
        ids = [i for g in opt_sd["param_groups"] for i in g["params"]]
        if len(ids) != len(names):
            raise ValueError(f"stage-0 checkpoint: {len(ids)} optimizer parameters for {len(names)} model "
                             "parameters (frozen or tied ones); only plain models convert at stage 0")
        by_id = dict(zip(ids, names))
        shapes = [{by_id[i]: tuple(module_sd[by_id[i]].shape) for i in g["params"]} for g in opt_sd["param_groups"]]
        masters = {n: module_sd[n].float().reshape(-1).clone() for n in names}
        for i, st in opt_sd["state"].items():
            states[by_id[i]] = dict(st)  # (torch.optim's format: shaped as the parameters)
        saved_groups = opt_sd["param_groups"]
    else:
        key = "fp32_flat_groups" if stage == 3 else "single_partition_of_fp32_groups"
        inner = "optimizer_state_dict" if stage == 3 else "base_optimizer_state"
        flats = [list(o[key]) for o in osds]
        paddings = osds[0].get("param_alignment_paddings") if stage <= 2 else None
        check_partitions(stage, world, optim_files, osds, shapes, flats, paddings)
        masters = _full_tensors(stage, world, shapes, flats, paddings)
        base = [o[inner] for o in osds]
        saved_groups = base[0]["param_groups"]
        elementwise = sorted({k for b in base for st in b["state"].values() for k, v in st.items()
                              if isinstance(v, torch.Tensor) and v.dim() > 0})
        shape_of = {n: s for group in shapes for n, s in group.items()}
        for k in elementwise:
            moment = _full_tensors(stage, world, shapes, [[b["state"][g][k] for g in range(len(shapes))]
                                                          for b in base], paddings)
            for n, v in moment.items():
                states.setdefault(n, {})[k] = v.view(shape_of[n])  # (torch.optim's format)
        for g, group in enumerate(shapes):
            scalars = {k: v for k, v in base[0]["state"].get(g, {}).items() if k not in elementwise}
            for n in group:
                states.setdefault(n, {}).update(scalars)
    # -- the model, the optimizer at world 1, the save -------------------------------------------
    holder = _Holder()
    for group in shapes:
        for n, shape in group.items():
            holder.put(n, masters[n].view(shape), parameter=True)
    frozen = dict(ms.get("frozen_param_shapes") or {})
    if stage <= 2:  # (stages 0-2 hold frozen weights whole in the module state, and may not list them)
        known = {n for g in shapes for n in g} | set(buffers) | set(ms.get("shared_params") or {})
        frozen.update({n: tuple(t.shape) for n, t in module_sd.items() if n not in known})
    fragments = [load_pt(f).get("frozen_param_fragments") or {} for f in model_files] if stage == 3 else []
    for n, shape in frozen.items():
        n_el = math.prod(shape)
        value = torch.cat([fr[n].reshape(-1) for fr in fragments])[:n_el] if stage == 3 else module_sd[n]
        holder.put(n, value.reshape(tuple(shape)).clone(), parameter=True, trainable=False)
    for n, source in (ms.get("shared_params") or {}).items():
        holder.tie(n, source)
    for n, b in buffers.items():
        holder.put(n, b.clone(), parameter=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (noted keys such as torch_adam: the run that resumes reports them)
        plan = translate({k: ds_config[k] for k in ("optimizer", "fp16", "bf16", "bfloat16") if k in ds_config})
    if plan.optimizer_class is None:
        raise ValueError("the checkpoint's ds_config has no 'optimizer' section (a client optimizer was used); "
                         "only config-built optimizers convert")
    accepted = set(plan.optimizer_kwargs) | set(_HPARAMS)
    groups = [{"params": [holder.get_parameter(n) for n in group],
               **{k: (tuple(v) if isinstance(v, list) else v) for k, v in saved.items() if k in accepted}}
              for group, saved in zip(shapes, saved_groups)]
    opt = ZeroOptimizer(groups, plan.optimizer_class, stage=min(stage, 2), module=holder,
                        mixed_precision=plan.zero.get("mixed_precision"), process_group=process_group,
                        **plan.optimizer_kwargs)
    order = [n for group in shapes for n in group]
    opt.load_state_dict({"state": {i: states[n] for i, n in enumerate(order) if n in states},
                         "param_groups": [{**{k: v for k, v in g.items() if k != "params"},
                                           "params": list(range(sum(len(s) for s in shapes[:gi]),
                                                                sum(len(s) for s in shapes[:gi + 1])))}
                                          for gi, g in enumerate(opt.param_groups)]})
    scaler = osds[0].get("loss_scaler") if osds else None
    if opt.engine.scaler is not None and isinstance(scaler, StandIn):
        cur_iter, last = int(scaler.state.get("cur_iter", 0)), int(scaler.state.get("last_overflow_iter", -1))
        opt.engine.scaler.load_state_dict({"scale": float(scaler.state.get("cur_scale", opt.engine.scaler.scale)),
                                    "good_steps": max(0, cur_iter - last - 1),
                                    "skipped_steps": counters["skipped_steps"]})
    client = {k: _plain(v, k) for k, v in ms.items() if k not in _DS_KEYS}
    steps = counters["global_steps"]
    extra = {"deepspeed_engine": counters,
             "client_state": {k: v for k, v in client.items() if v is not None},
             "converted_from": {"deepspeed_version": str(ms.get("ds_version")), "stage": stage, "world_size": world}}
    sched = _Position(ms["lr_scheduler"]) if ms.get("lr_scheduler") is not None else None
    os.makedirs(out, exist_ok=True)
    pending = save_checkpoint(os.fspath(out), steps, model=holder, optimizer=opt, scheduler=sched, extra=extra,
                              save_frozen=bool(frozen))
    path = pending.wait()
    opt.close()
    return path


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("ckpt", help="a DeepSpeed checkpoint: the save dir (with 'latest') or a tag directory")
    parser.add_argument("out", help="the zeroshard checkpoint root to write (loads at any world size)")
    parser.add_argument("--tag", default=None, help="the tag to convert (default: what CKPT/latest names)")


def _run(args: argparse.Namespace) -> int:
    path = convert_deepspeed(args.ckpt, args.out, tag=args.tag)
    print(f"wrote {path}")
    return 0


def _commands() -> dict:
    from zeroshard.cli import Command
    return {"convert-deepspeed": Command(
        help="convert a DeepSpeed ZeRO checkpoint (stages 0-3) into a zeroshard checkpoint, without running "
             "pickled code", add_arguments=_add_arguments, run=_run, one_line_errors=True)}


COMMANDS = _commands()
