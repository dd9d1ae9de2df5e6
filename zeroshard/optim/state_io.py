"""Optimizer state in and out of a ZeroOptimizer, in two forms.

- *Sharded* (``state_dict()``): only this rank's pieces, keyed by parameter name and the
  flat range ``[start, stop)`` of that parameter they cover (never by rank), so the same
  data can be re-cut for another world size or stage. Loadable as is at the same layout.
- *Consolidated* (``consolidated_state_dict()``): exactly the format of a plain
  ``torch.optim`` optimizer built over the same param groups, so a user can move between
  zeroshard and torch.optim in either direction at any step.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from zeroshard.layout import as_real
from zeroshard.units.elementwise import update_kind
from zeroshard.optim import shard_marker, state_forms

from zeroshard.offload.unit_swap import resident_runs
from zeroshard.optim.inner import normalize_state
from zeroshard.units.run import Run, elementwise_state, flat, run_pieces as _run_pieces
from zeroshard.optim.state_kinds import check_entry, expected_state
from zeroshard.optim.regroup import to_own_grouping

if TYPE_CHECKING:
    from zeroshard.optim.zero_engine import EngineOwner

FORMAT = 1


def is_sharded(state_dict: dict) -> bool:
    return isinstance(state_dict, dict) and "zeroshard" in state_dict and "pieces" in state_dict


def _hparams(group: dict) -> dict:
    """A group's options as a state dict keeps them: not its parameters, nor the class object
    a group may name (the optimizer that loads decides its own classes)."""
    return {k: v for k, v in group.items() if k not in ("params", "optimizer_class")}


# -- sharded ------------------------------------------------------------------------------------
def loader_for(state_dict: dict) -> Callable[["EngineOwner", dict], None]:
    """What loads ``state_dict``: a registered form's loader (``state_forms``), else by format."""
    return state_forms.loader(state_dict) or (load_sharded if is_sharded(state_dict) else load_consolidated)


def sharded_state_dict(opt: "EngineOwner") -> dict:
    engine = opt.engine.joined()
    pieces: dict[str, dict[str, Any]] = {}
    for run in resident_runs(engine.runs):
        state = engine.inner.state.get(run.tensor, {})
        for piece in _run_pieces(run):
            lo, hi = piece.unit_offset - run.a, piece.unit_offset - run.a + piece.numel
            entry: dict[str, Any] = {
                "start": piece.start, "stop": piece.stop, "numel": piece.segment.numel,
                "shape": list(piece.segment.shape),
                "state": {k: flat(v)[lo:hi].clone() if elementwise_state(v, run.tensor) else
                          (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in state.items()},
            }
            if run.unit.separate_master:
                entry["master"] = flat(run.tensor)[lo:hi].clone()
            pieces[piece.segment.name] = entry
    return shard_marker.marked(opt, {  # (a rank-0-only torch.save is told: Note [rank-only state dicts])
        "zeroshard": {"format": FORMAT, "stage": engine.config.stage, "world_size": engine.comm.world_size,
                      "rank": engine.comm.rank, "optimizer": type(engine.inner).__name__},
        "param_groups": [{**_hparams(g), "params": [engine.param_names[id(p)] for p in g["params"]]}
                         for g in opt.param_groups],
        "pieces": pieces,
        "loss_scaler": engine.scaler.state_dict() if engine.scaler else None,
    })


def _check_groups(opt: "EngineOwner", groups: list[dict], by_name: bool) -> None:
    engine = opt.engine.joined()
    if len(groups) != len(opt.param_groups):
        raise ValueError(f"state dict has {len(groups)} param groups, this optimizer has "
                         f"{len(opt.param_groups)}: it was saved for a different model or grouping")
    problems = []
    for gi, (saved, mine) in enumerate(zip(groups, opt.param_groups)):
        if len(saved["params"]) != len(mine["params"]):
            problems.append(f"group {gi}: {len(saved['params'])} saved parameters vs {len(mine['params'])}")
        elif by_name:
            names = [engine.param_names[id(p)] for p in mine["params"]]
            diff = [f"{a!r}!={b!r}" for a, b in zip(saved["params"], names) if a != b]
            if diff:
                problems.append(f"group {gi}: names differ: {', '.join(diff[:5])}")
    if problems:
        raise ValueError("state dict does not match this optimizer's parameters: " + "; ".join(problems))


def check_kinds(opt: "EngineOwner", groups: list[dict], got: dict[str, tuple[dict, Optional[int]]],
                where: str) -> set[str]:
    """Refuses loaded state that is not what each parameter's class keeps, naming the parameter,
    the key and the shape expected (Note [state kinds] in state_kinds.py). ``got``: name ->
    (its state, key -> value or shape; the element count of a flat slice it may hold, or None).
    Returns the names whose class could not be asked (their element counts are checked instead)."""
    shapes = {seg.name: tuple(seg.shape) for u in opt.engine.units for seg in u.layout.segments}
    problems, unknown = [], set()
    for saved, mine in zip(groups, opt.param_groups):
        cls = mine.get("optimizer_class", opt.engine.optimizer_class)
        options = {**_hparams(mine), **_hparams(saved)}  # (the options in force after the load)
        for p in mine["params"]:
            name = opt.engine.param_names[id(p)]
            if name not in got or name not in shapes:
                continue
            expected = expected_state(cls, options, shapes[name])
            if expected is None:
                unknown.add(name)
            state, flat_numel = got[name]
            problems += check_entry(name, cls, state, expected, shapes[name], flat_numel)
    if problems:
        raise ValueError(f"{where} holds optimizer state that is not this optimizer's: " +
                         "; ".join(problems[:10]) + (f" (and {len(problems) - 10} more)" if len(problems) > 10 else "") +
                         "; load state saved by the same optimizer class and param groups")
    return unknown


def apply_group_options(opt: "EngineOwner", groups: list[dict], replace: bool = False) -> None:
    """Saved param-group options (all but "params") take effect, in ``opt.param_groups`` and in the
    inner optimizer; ``replace``: options the saved groups lack are removed too (an undo)."""
    engine = opt.engine.joined()
    for saved, mine in zip(groups, opt.param_groups):
        if replace:
            for k in [k for k in mine if k not in ("params", "optimizer_class") and k not in saved]:
                del mine[k]
        for k, v in saved.items():
            if k != "params":
                mine[k] = v
    engine.stepper.sync_hyperparameters(opt.param_groups)


def apply_loss_scaler(opt: "EngineOwner", state: dict) -> None:
    """The fp16 loss scaler's saved state takes effect, and with it the gradients' factor."""
    engine = opt.engine.joined()
    if engine.scaler is None:
        raise ValueError("the state holds an fp16 loss scaler's state, and this optimizer has no loss scaler "
                         "(mixed_precision is not 'fp16'): load it into ZeroOptimizer(..., mixed_precision='fp16')")
    before = engine.scaler.scale
    engine.scaler.load_state_dict(state)
    engine.grads.set_grad_factor()
    engine.codecs.rescale(before, engine.scaler.scale)  # (Note [residuals under a moving loss scale])


def load_sharded(opt: "EngineOwner", sd: dict) -> None:
    engine = opt.engine.joined()
    shard_marker.refuse_lone(sd)  # (saved by one rank alone: refused on every rank alike)
    _check_groups(opt, sd["param_groups"], by_name=True)
    pieces = sd["pieces"]
    missing, wrong = [], []
    for run in engine.runs:
        for piece in _run_pieces(run):
            e = pieces.get(piece.segment.name)
            if e is None or e["start"] > piece.start or e["stop"] < piece.stop:
                missing.append(f"{piece.segment.name}[{piece.start}:{piece.stop}]")
            elif list(e["shape"]) != list(piece.segment.shape):
                wrong.append(f"{piece.segment.name}: saved {e['shape']} vs {list(piece.segment.shape)}")
    if wrong:
        raise ValueError("state dict is for a different model; mismatched shapes: " + "; ".join(wrong[:10]))
    if missing:
        meta = sd["zeroshard"]
        raise ValueError(
            f"this rank's state dict lacks pieces {missing[:5]}{'...' if len(missing) > 5 else ''}: it was "
            f"saved by rank {meta['rank']} of {meta['world_size']} at stage {meta['stage']}, this is rank "
            f"{engine.comm.rank} of {engine.comm.world_size} at stage {engine.config.stage}. To change world size or "
            "stage, load a checkpoint (zeroshard.load_checkpoint) or a consolidated_state_dict().")
    check_kinds(opt, sd["param_groups"], {n: (e["state"], e["stop"] - e["start"]) for n, e in pieces.items()
                                          if isinstance(e, dict) and isinstance(e.get("state"), dict)},
                "the state dict")
    apply_group_options(opt, sd["param_groups"])
    for run in resident_runs(engine.runs, write=True):
        names = [piece.segment.name for piece in _run_pieces(run)]
        keys = sorted(set().union(*(pieces[n]["state"] for n in names))) if names else []
        fill_run(opt, run, keys, lambda name, a, b, key: _slice_entry(pieces[name], a, b, key))
    normalize_loaded(opt)
    if engine.scaler is not None and sd.get("loss_scaler"):
        apply_loss_scaler(opt, sd["loss_scaler"])


def _slice_entry(entry: dict, a: int, b: int, key: str) -> Optional[torch.Tensor]:
    src = entry.get("master") if key == "__master__" else entry["state"].get(key)
    if src is None:
        return None
    if isinstance(src, torch.Tensor) and src.dim() > 0 and src.numel() == entry["stop"] - entry["start"]:
        return src[a - entry["start"]:b - entry["start"]]
    return src


# -- consolidated -------------------------------------------------------------------------------
def _param_index(opt: "EngineOwner") -> dict[str, int]:
    engine = opt.engine.joined()
    index, i = {}, 0
    for g in opt.param_groups:
        for p in g["params"]:
            index[engine.param_names[id(p)]] = i
            i += 1
    return index


def consolidated_state_dict(opt: "EngineOwner", to_rank: Optional[int]) -> Optional[dict]:
    # Which state keys exist (tensor-valued or scalar) and the scalars' values, per group;
    # a rank that owns nothing of a group learns them from the others.
    engine = opt.engine.joined()
    whole = {i for i, g in enumerate(opt.param_groups)
             if update_kind(g.get("optimizer_class", engine.optimizer_class)) == "whole"}
    # Whole-tensor groups (Note [whole-tensor units]): a parameter's state is its owner's run's,
    # whatever its keys and shapes (Adafactor's differ between matrices and vectors).
    owned: dict[str, dict[str, object]] = {}
    for run in engine.runs:
        if run.group in whole:
            seg = next(run.unit.layout.pieces_in(run.a, run.b)).segment
            owned[seg.name] = {k: v.clone() if isinstance(v, torch.Tensor) else v
                               for k, v in engine.inner.state.get(run.tensor, {}).items()}
    for other in engine.comm.all_gather_object(owned) if whole else ():
        owned.update(other)
    # Per group and key: elementwise or not, decided by a run of more than one element where
    # there is one (a one-element run's (1,) state is both); per parameter: the scalars of its
    # run (one run per parameter: Note [one run per parameter], so step counts may differ).
    local: dict[int, dict[str, tuple[bool, bool]]] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for run in engine.runs:
        if run.group in whole:
            continue
        if engine.inner.state.get(run.tensor):  # (its parameters have state: an entry each)
            for piece in _run_pieces(run):
                scalars.setdefault(piece.segment.name, {})
        for k, v in engine.inner.state.get(run.tensor, {}).items():
            elementwise, decisive = elementwise_state(v, run.tensor), run.tensor.numel() > 1
            if decisive or k not in local.get(run.group, {}):
                local.setdefault(run.group, {})[k] = (elementwise, decisive)
            if not elementwise or not decisive:
                for piece in _run_pieces(run):
                    scalars.setdefault(piece.segment.name, {})[k] = v.clone() if isinstance(v, torch.Tensor) else v
    kinds: dict[int, dict[str, tuple[bool, bool]]] = {}
    for other_kinds, other_scalars in engine.comm.all_gather_object((local, scalars)):
        for g, keys in other_kinds.items():
            for k, kind in keys.items():
                if kind[1] or k not in kinds.get(g, {}):
                    if not kinds.get(g, {}).get(k, (False, False))[1]:
                        kinds.setdefault(g, {})[k] = kind
        for name, values in other_scalars.items():
            mine = scalars.setdefault(name, {})  # (named with no scalars, as SGD's: it has state all the same)
            for k, v in values.items():
                mine.setdefault(k, v)
    merged: dict[int, dict[str, Any]] = {g: {k: None if kind[0] else True for k, kind in keys.items()}
                                         for g, keys in kinds.items()}
    index = _param_index(opt)
    masters = _full_masters(opt)
    state: dict[int, dict[str, Any]] = {}
    for unit in engine.units:
        groups_here = {seg.group for seg in unit.layout.segments}
        tensor_keys = sorted({k for g in groups_here for k, v in merged.get(g, {}).items() if v is None})
        fulls = {}
        for key in tensor_keys:
            full = torch.zeros(unit.layout.padded_numel, dtype=unit.master.dtype, device=unit.device)
            for run in engine.runs:
                if run.unit is unit and key in engine.inner.state.get(run.tensor, {}):
                    full[run.a:run.b].copy_(flat(engine.inner.state[run.tensor][key]))
            if engine.policy.shard_optimizer:
                engine.comm.gather_shards(full).wait()
            fulls[key] = full
        for seg in unit.layout.segments:
            entry = dict(owned.get(seg.name, {})) if seg.group in whole else {}
            for k, v in merged.get(seg.group, {}).items() if seg.name in scalars else ():
                if v is None:
                    entry[k] = _global(opt, seg.name, seg.bind(fulls[k][seg.offset:seg.end]).clone())
                elif k in scalars.get(seg.name, {}):  # (a parameter with no state has no entry)
                    entry[k] = scalars[seg.name][k]
            if entry and id(unit) in masters:
                entry[MASTER_KEY] = _global(opt, seg.name, seg.bind(masters[id(unit)][seg.offset:seg.end]).clone())
            if entry:
                state[index[seg.name]] = entry
    if to_rank is not None and engine.comm.rank != to_rank:
        return None
    groups, i = [], 0
    for g in opt.param_groups:
        n = len(g["params"])
        groups.append({**_hparams(g), "params": list(range(i, i + n))})
        i += n
    return {"state": state, "param_groups": groups}


MASTER_KEY = "zeroshard_master"
"""Note [masters in the consolidated state]: under mixed precision the fp32 master of each
parameter goes into ``consolidated_state_dict()`` beside its moments (as DeepSpeed's bf16
optimizer state keeps its fp32 partitions), so a resume through ``model.state_dict()`` +
``consolidated_state_dict()`` -- what the Trainer, Accelerate, Lightning and plain scripts
save -- continues from the masters, bit for bit, not from the bf16 weights rounded from them.
``load_state_dict`` takes it when present (the weights' values otherwise); a plain torch
optimizer loading the dict keeps it as an unused state entry."""


def _full_masters(opt: "EngineOwner") -> dict[int, torch.Tensor]:
    """id(unit) -> the unit's whole fp32 master (a collective where state is sharded), for
    units with masters apart from their low-precision weights."""
    engine = opt.engine.joined()
    out: dict[int, torch.Tensor] = {}
    for unit in engine.units:
        if unit.separate_master:
            out[id(unit)] = torch.zeros(unit.layout.padded_numel, dtype=unit.master.dtype, device=unit.device)
    if not out:
        return out
    for run in resident_runs(engine.runs):
        if id(run.unit) in out:
            out[id(run.unit)][run.a:run.b].copy_(flat(run.tensor))
    if engine.policy.shard_optimizer:
        for unit in engine.units:
            if id(unit) in out:
                engine.comm.gather_shards(out[id(unit)]).wait()
    return out


def _global(opt: "EngineOwner", name: str, t: torch.Tensor) -> torch.Tensor:
    """The whole tensor behind a TP-sharded parameter's local state (a collective over tp)."""
    engine = opt.engine.joined()
    tp = engine.tp
    return t if tp is None else tp.full(name, t)


def load_consolidated(opt: "EngineOwner", sd: dict) -> None:
    engine = opt.engine.joined()
    if "state" not in sd or "param_groups" not in sd:
        raise ValueError(f"not an optimizer state dict: keys {sorted(sd)[:8]}; expected 'state' and "
                         "'param_groups' (torch.optim format) or a ZeroOptimizer.state_dict()")
    sd = to_own_grouping(opt, sd)  # (groups that name their parameters: Note [regrouped state])
    _check_groups(opt, sd["param_groups"], by_name=False)
    index = _param_index(opt)
    # (a complex parameter's moments as the reals its pieces hold: Note [complex parameters])
    saved = {i: {k: as_real(v) if isinstance(v, torch.Tensor) else v for k, v in entry.items()}
             if isinstance(entry, dict) else entry for i, entry in sd["state"].items()}
    if engine.tp is not None:  # global tensors: this tp rank's part of each
        saved = {i: {k: engine.tp.local_part(name, v) for k, v in saved.get(i, {}).items()}
                 for name, i in index.items()}
    numel = {seg.name: seg.numel for u in engine.units for seg in u.layout.segments}
    unknown = check_kinds(opt, sd["param_groups"], {
        name: ({k: v for k, v in saved.get(i, {}).items() if k != MASTER_KEY}, None) for name, i in index.items()},
        "the state dict")
    wrong = []
    for name in unknown:
        for k, v in saved.get(index[name], {}).items():
            if isinstance(v, torch.Tensor) and v.dim() > 0 and v.numel() != numel[name] \
                    and v.numel() != 1:  # (one value per tensor, e.g. shape (1,), is a scalar)
                wrong.append(f"{name}.{k}: {tuple(v.shape)} has {v.numel()} elements, parameter has {numel[name]}")
    if wrong:
        raise ValueError("optimizer state does not fit this model: " + "; ".join(wrong[:10]))
    apply_group_options(opt, sd["param_groups"])
    for run in resident_runs(engine.runs, write=True):
        names = [piece.segment.name for piece in _run_pieces(run)]
        keys = sorted(set().union(*(saved.get(index[n], {}) for n in names)) - {MASTER_KEY}) if names else []
        fill_run(opt, run, keys, lambda name, a, b, key: _slice_plain(  # (Note [masters in the consolidated state])
            saved.get(index[name], {}), a, b, MASTER_KEY if key == "__master__" else key, numel[name]))
    normalize_loaded(opt)


def _slice_plain(entry: dict, a: int, b: int, key: str, numel: int) -> Optional[torch.Tensor]:
    v = entry.get(key)
    if isinstance(v, torch.Tensor) and v.dim() > 0 and v.numel() == numel:
        return v.reshape(-1)[a:b]
    return v


def normalize_loaded(opt: "EngineOwner") -> None:
    engine = opt.engine.joined()
    if engine.swapper is None:  # (swapped state is FusedAdam's, already in form)
        normalize_state(engine.inner)


# -- in-place fill (checkpoint loading) ------------------------------------------------------
def fill_run(opt: "EngineOwner", run: Run, keys: list[str], fetch, adopt=None) -> None:
    """Rebuilds one run's optimizer state (and master) from per-piece data, writing into the
    state tensors the run already has (so state that lives elsewhere, e.g. offloaded, stays
    where it is) and allocating without zero-filling otherwise: the pieces of a run cover it
    exactly. ``fetch(name, start, stop, key)`` returns that range of a tensor state, a scalar,
    or None (key ``"__master__"``: the master values); ``keys`` are the state keys.
    ``adopt(key)``, if given, returns a tensor holding the run's whole state ``key`` to take
    as it is instead of copying, or None (Note [adopting verified state] in checkpoint/load.py)."""
    engine = opt.engine.joined()
    pieces = list(_run_pieces(run))
    if not pieces:
        return
    first = pieces[0]
    current = engine.inner.state.get(run.tensor, {})
    state: dict[str, Any] = {}
    for key in keys:
        probe = fetch(first.segment.name, first.start, first.stop, key)
        if probe is None:
            continue
        # One value for the whole run (a scalar, or a per-tensor state of another shape).
        if not isinstance(probe, torch.Tensor) or probe.dim() == 0 or probe.numel() != first.numel:
            state[key] = probe.clone() if isinstance(probe, torch.Tensor) else probe
            continue
        whole = adopt(key) if adopt is not None else None
        if whole is not None:
            state[key] = whole.view(run.tensor.shape)
            continue
        buf = current.get(key)
        if not (isinstance(buf, torch.Tensor) and buf.shape == run.tensor.shape):
            buf = torch.empty(run.tensor.shape, dtype=run.tensor.dtype, device=run.tensor.device)
        for piece in pieces:
            o = piece.unit_offset - run.a
            flat(buf)[o:o + piece.numel].copy_(fetch(piece.segment.name, piece.start, piece.stop, key).reshape(-1))
        state[key] = buf
    if state:
        engine.inner.state[run.tensor] = state
    else:  # saved before the first step: no state, and none may linger from before the load
        engine.inner.state.pop(run.tensor, None)
    if run.unit.separate_master:
        for piece in pieces:
            master = fetch(piece.segment.name, piece.start, piece.stop, "__master__")
            if master is not None:
                o = piece.unit_offset - run.a
                flat(run.tensor)[o:o + piece.numel].copy_(master)
        run.unit.write_back()
