"""Loading a checkpoint into a model and ZeroOptimizer of any world size and stage.

Three phases, so that a damaged or malformed checkpoint loads nothing:
1. *read*: every rank runs ``locate.check_step`` (the whole manifest validated, every file a
   regular file of its size), checks the manifest against its model, works out which saved
   ranges its owned pieces overlap (plus the unsharded tensors), checks those pieces against
   the data files' headers, reads exactly the blocks holding them and verifies their
   checksums, and decodes and checks the small state (hyperparameters against the live
   param groups, scheduler, data position, RNG); the ranks agree that all succeeded;
2. *small state*: hyperparameters, loss scaler, scheduler, data position and (same world
   size only) RNG states are applied, undone on every rank if any object refuses its state;
3. *tensors*: owned parameter pieces, masters and optimizer states are filled from memory,
   then ``gather_params`` rebuilds full parameters. Nothing here can fail on a value.
Given a root, a step that fails phase 1 is skipped (with the reason) for the next newest.
"""
from __future__ import annotations

import bisect
import os
import struct
import warnings
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import nn

from zeroshard.optim.registry import optimizer_for
from zeroshard.checkpoint import codec_residuals, frozen_base, group_names, jsontree, locate, stage_merge, tp_layout, trainer_state
from zeroshard.checkpoint.checkpoint_errors import CheckpointCorruptError, CheckpointError, CheckpointMismatchError
from zeroshard.checkpoint.pieces import MASTER, PARAM, full_tensors, name_map, stored_view
from zeroshard.checkpoint.shard_file import COMPLEX_CODES, DTYPES, ShardReader, reap
from zeroshard.checkpoint.state_check import check_state_kinds
from zeroshard.offload.unit_swap import resident_runs
from zeroshard.optim.state_io import fill_run, normalize_loaded
from zeroshard.stages.stage3.secondary import params_written
from zeroshard.checkpoint.saver import checkpoint_comm, wait_checkpoint
from zeroshard.optim.interrupts import state_restored
from zeroshard.comm import Comm
from zeroshard.optim.zero_optimizer import engine_of

if TYPE_CHECKING:
    from zeroshard.layout.unit_layout import Piece
    from zeroshard.units.run import Run
    from zeroshard.comm.tensor_parallel import TensorParallel
    from zeroshard.offload.nvme_state import NvmeOptimizerState
    from zeroshard.optim.zero_optimizer import ZeroOptimizer


class _Source:
    """The saved pieces of every tensor of one step, readable by (name, range, kind)."""

    adoptable = True
    """Verified buffers may become state tensors (Note [adopting verified state])."""

    def __init__(self, step_dir: str, body: dict, max_blocks: Optional[int] = None) -> None:
        self.dir = step_dir
        self.body = body
        self.max_blocks = max_blocks
        self.readers: dict[str, ShardReader] = {}
        self.pieces = {n: m["pieces"] for n, m in body["tensors"].items()}
        self.starts = {n: [p["start"] for p in ps] for n, ps in self.pieces.items()}
        self.planned: dict[str, list[tuple[int, int]]] = {}  # file -> byte ranges to read

    def reader(self, fname: str) -> ShardReader:
        if fname not in self.readers:
            self.readers[fname] = ShardReader(os.path.join(self.dir, fname), self.body["files"][fname],
                                              self.max_blocks)
        return self.readers[fname]

    def overlapping(self, name: str, a: int, b: int):
        ps = self.pieces[name]
        i = max(0, bisect.bisect_right(self.starts[name], a) - 1)
        while i < len(ps) and ps[i]["start"] < b:
            if ps[i]["stop"] > a:
                yield ps[i]
            i += 1

    def _ranges(self, name: str, a: int, b: int, target: tp_layout.Target):
        """Stored ranges for ``[a, b)`` of ``target``'s view and how to assemble them, or None
        where the stored order is the reader's (Note [stored order])."""
        meta = self.body["tensors"][name]
        saved = tp_layout.split_of(meta)
        if saved is None and target is None:
            return None
        return tp_layout.plan(meta["shape"], saved, target, a, b)

    def plan(self, name: str, a: int, b: int, kinds: Optional[set[str]], target: tp_layout.Target = None) -> None:
        """Checks the pieces holding ``name[a:b]`` (of ``target``'s view) and notes their byte
        ranges for ``kinds`` (None: all); ``read_planned`` then reads and verifies them."""
        planned = self._ranges(name, a, b, target)
        for lo, hi in [(a, b)] if planned is None else planned[0]:
            self._plan(name, lo, hi, kinds)

    def _plan(self, name: str, a: int, b: int, kinds: Optional[set[str]]) -> None:
        for p in self.overlapping(name, a, b):
            self.reader(p["file"]).check_piece(name, p, self.body["tensors"][name]["dtype"])
            lo, hi = max(a, p["start"]) - p["start"], min(b, p["stop"]) - p["start"]
            for kind, key in p["keys"].items():
                if kinds is None or kind in kinds:
                    self.planned.setdefault(p["file"], []).append(self.reader(p["file"]).byte_range(key, lo, hi))

    def read_planned(self) -> None:
        # One ``load`` per file, not per tensor: its blocks are read as few long runs, so
        # no piece straddles two buffers (``get`` would stitch it into a fresh copy) and the
        # read-ahead never drains between tensors.
        for fname in sorted(self.planned):
            self.reader(fname).load(self.planned[fname])
        self.planned.clear()

    def fetch(self, name: str, a: int, b: int, kind: str, target: tp_layout.Target = None) -> Optional[torch.Tensor]:
        planned = self._ranges(name, a, b, target)
        if planned is None:
            return self._fetch(name, a, b, kind)
        parts = [self._fetch(name, lo, hi, kind) if hi > lo else None for lo, hi in planned[0]]
        if not any(p is not None for p in parts) or any(p is None for p, (lo, hi) in zip(parts, planned[0]) if hi > lo):
            return None
        dtype = next(p.dtype for p in parts if p is not None)
        return planned[1]([p if p is not None else torch.empty(0, dtype=dtype) for p in parts])

    def _fetch(self, name: str, a: int, b: int, kind: str) -> Optional[torch.Tensor]:
        parts = []
        for p in self.overlapping(name, a, b):
            key = p["keys"].get(kind)
            if key is None:
                return None
            lo, hi = max(a, p["start"]) - p["start"], min(b, p["stop"]) - p["start"]
            parts.append(self.reader(p["file"]).get(key, lo, hi))
        if not parts:
            return None
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def scalar(self, name: str, a: int, b: int, key: str, target: tp_layout.Target = None) -> Any:
        planned = self._ranges(name, a, b, target)
        if planned is not None and planned[0]:
            a, b = next(((lo, hi) for lo, hi in planned[0] if hi > lo), planned[0][0])
        for p in self.overlapping(name, a, b):
            if key in p.get("scalars", {}):
                return jsontree.decode(p["scalars"][key])
        return None

    def release(self, defer: bool = False) -> None:
        for r in self.readers.values():
            r.release(defer)


def _expected(model: Optional[nn.Module], opt: Any) -> dict[str, tuple[tuple[int, ...], bool]]:
    """Checkpoint name -> (shape, trained by opt) of everything the target holds."""
    out: dict[str, tuple[tuple[int, ...], bool]] = {}
    if opt is not None:
        names = name_map(model, opt)
        tp = _tp_of(opt)
        for u in opt.engine.joined().units:
            for seg in u.layout.segments:
                out[names[seg.name]] = (tuple(seg.shape) if tp is None else tp.global_shape(seg.name, seg.shape), True)
        for _, seg in frozen_base.unit_segments(opt):
            out[seg.name] = (tuple(seg.shape), False)
    full, _ = full_tensors(model, opt) if model is not None else ({}, {})
    for n, t in full.items():
        out[n] = (tuple(t.shape), False)
    return out


def _held(model: Optional[nn.Module], opt: Optional["ZeroOptimizer"]) -> tuple[dict[str, tuple[tuple[int, ...], bool]], list[list[str]]]:
    """(everything the target holds, its param groups' trained names), by checkpoint name; under
    pipeline parallelism every stage's (a collective: Note [pipeline checkpoints])."""
    expected = _expected(model, opt)
    groups: list[list[str]] = []
    if opt is not None:
        names = name_map(model, opt)
        groups = [[names[opt.engine.param_names[id(p)]] for p in g["params"] if p.requires_grad] for g in opt.param_groups]
    pp = stage_merge.pipeline_of(opt)  # (groups: this stage's own, matched by name: Note [param groups by name])
    return (stage_merge.merge_expected(pp, expected) if pp is not None else expected), groups


def check_compatible(body: dict, model: Optional[nn.Module], opt: Any, where: str,
                     held: Optional[tuple[dict[str, tuple[tuple[int, ...], bool]], list[list[str]]]] = None) -> None:
    """Raises CheckpointMismatchError listing every name, shape or param group that differs
    (``held``: what ``_held`` says, computed once per load)."""
    expected, mine = held if held is not None else _held(model, opt)
    saved = body["tensors"]
    record = body.get("frozen") or {"tensors": {}}
    unsaved = set(record["tensors"]) - set(saved)  # frozen weights checked by digest instead
    missing = sorted(set(expected) - set(saved) - unsaved)
    unexpected = sorted(set(saved) - set(expected))
    # (the base it was trained on had them; an optimizer alone does not show a model's frozen weights)
    base_lacking = sorted(unsaved - set(expected)) if model is not None else []
    wrong = [f"{n}: checkpoint {saved[n]['shape']} vs model {list(expected[n][0])}"
             for n in sorted(set(expected) & set(saved)) if list(expected[n][0]) != saved[n]["shape"]]
    if opt is not None:  # (a complex parameter's reals are not a real parameter of that shape: Note [complex parameters])
        names = name_map(model, opt)
        kinds = {names[seg.name]: COMPLEX_CODES.get(seg.complex_dtype) for u in opt.engine.joined().units  # type: ignore[arg-type]
                 for seg in u.layout.segments}
        wrong += [f"{n}: checkpoint {saved[n].get('complex_dtype') or 'real'} vs model {kinds[n] or 'real'}"
                  for n in sorted(set(kinds) & set(saved)) if saved[n].get("complex_dtype") != kinds[n]]
    if missing or unexpected or base_lacking or wrong:
        parts = []
        if missing:
            parts.append(f"missing from the checkpoint: {missing[:10]}{' ...' if len(missing) > 10 else ''}")
        if unexpected:
            parts.append(f"not in the model: {unexpected[:10]}{' ...' if len(unexpected) > 10 else ''}")
        if base_lacking:
            parts.append(f"frozen weights it was trained on (recorded, not saved), not in the model: "
                         f"{base_lacking[:10]}{' ...' if len(base_lacking) > 10 else ''}")
        if wrong:
            parts.append("shape mismatch: " + "; ".join(wrong[:10]))
        raise CheckpointMismatchError(f"{where} was saved from a different model ({' | '.join(parts)}); load it "
                                      "into the model that wrote it, or export_hf() and convert")
    frozen_base.check_base(record, sorted(unsaved & set(expected)), model,
                           opt if opt is not None else optimizer_for(model) if model is not None else None, where)
    if opt is not None:
        group_names.resolve(jsontree.decode(body.get("param_groups", []), f"{where}: param_groups"), mine, where)


def _target(opt: Optional["ZeroOptimizer"], own: str) -> tp_layout.Target:
    """Which part of parameter ``own`` this rank holds (None: all of it; Note [stored order])."""
    tp = _tp_of(opt)
    return None if tp is None else tp.split_of(own)


def _needed(opt: Optional["ZeroOptimizer"], model: Optional[nn.Module], saved: set[str]):
    """(name in checkpoint, [a, b), run or None, piece, target) this rank must load (frozen
    weights only where the checkpoint holds them: Note [frozen weights in checkpoints])."""
    if opt is not None:
        names = name_map(model, opt)
        for run in opt.engine.joined().runs:
            for piece in run.unit.layout.pieces_in(run.a, run.b):
                yield (names[piece.segment.name], piece.start, piece.stop, run, piece,
                       _target(opt, piece.segment.name))
        yield from frozen_base.frozen_needed(opt, saved)
    if model is not None:
        full, _ = full_tensors(model, opt)
        for n, t in full.items():
            if n in saved:
                yield n, 0, t.numel(), None, None, None


def read_phase(src: _Source, model: Optional[nn.Module], opt: Any) -> None:
    """Reads and verifies every block this rank's pieces need (the RNG file is read and
    checked by ``trainer_state.prepare``)."""
    for name, a, b, run, _, target in _needed(opt, model, set(src.pieces)):
        if a == b:
            continue
        kinds = None if run is not None and run.unit.separate_master else {PARAM} | {
            k for p in src.pieces[name] for k in p["keys"] if k.startswith("state.")}
        src.plan(name, a, b, kinds, target)
    src.read_planned()


def write_param(state_dict: dict[str, torch.Tensor], name: str, values: torch.Tensor,
                run: "Optional[Run | frozen_base.FrozenRun]", piece: Optional[Piece]) -> None:
    """Puts loaded ``values`` of parameter ``name`` where this rank keeps them: a whole tensor
    (``run`` None), its piece in a swap file, or its piece of the unit's flat buffer."""
    if run is None:  # whole tensors; a sharded stage-3 parameter takes its piece (and its master)
        t = stored_view(state_dict[name])
        t.copy_(values.view(t.shape))
    elif run.unit.swapped("shard"):  # straight into the swap file
        run.unit.swap.write_range(run.unit, "shard", piece.unit_offset, values)  # type: ignore[union-attr]
        run.unit.writes += 1
    elif piece is not None:
        ua = piece.unit_offset
        run.unit.param_range(ua, ua + piece.numel).copy_(values)
        run.unit.writes += 1
    if isinstance(run, frozen_base.FrozenRun):  # (hpZ: its secondary slice follows)
        params_written(run.unit)


def apply_phase(src: _Source, model: Optional[nn.Module], opt: Any) -> None:
    state_dict = model.state_dict(keep_vars=True) if model is not None else {}
    ckpt_name = name_map(model, opt) if opt is not None else {}
    streamed = _streamed(opt)
    if streamed:  # verified in full by read_phase; now each run's blocks are read whole, once
        for r in src.readers.values():
            r.release()
            r.max_blocks = None
    later: dict[int, list] = {}  # streamed: a run's parameter pieces, applied with its state

    def put_param(name: str, a: int, b: int, run: Any, piece: Any, target: tp_layout.Target) -> None:
        values = src.fetch(name, a, b, PARAM, target)
        if values is None:  # (read_phase planned and verified every block of this rank's pieces)
            raise RuntimeError(f"{name}: elements [{a}, {b}) of the parameter were not read from the checkpoint")
        write_param(state_dict, name, values, run, piece)

    with torch.no_grad():
        for name, a, b, run, piece, target in _needed(opt, model, set(src.pieces)):
            if a == b:
                continue
            if streamed and run is not None and not isinstance(run, frozen_base.FrozenRun):
                later.setdefault(id(run), []).append((name, a, b, run, piece, target))
            else:
                put_param(name, a, b, run, piece, target)
        if opt is None:
            managed = optimizer_for(model) if model is not None else None
            if managed is not None:  # the weights alone changed: whatever else holds them follows
                managed.engine.weights_changed()
            return
        for unit in opt.engine.joined().units:  # every owned piece came from the checkpoint (read_phase checked)
            unit.needs_init = False
        keys: dict[str, list[str]] = {}
        for own, name in ckpt_name.items():
            found: set[str] = set()
            for p in src.pieces.get(name, []):
                found |= {k[6:] for k in p["keys"] if k.startswith("state.")} | set(p.get("scalars", {}))
            keys[own] = sorted(found)

        def fetch(own: str, a: int, b: int, key: str) -> Any:
            name, target = ckpt_name[own], _target(opt, own)
            if key == "__master__":  # no master saved (fp32 run): the parameters are the master
                return src.fetch(name, a, b, MASTER, target) if any(MASTER in p["keys"] for p in src.pieces[name]) \
                    else src.fetch(name, a, b, PARAM, target)
            t = src.fetch(name, a, b, f"state.{key}", target) if any(
                f"state.{key}" in p["keys"] for p in src.pieces[name]) else None
            return t if t is not None else src.scalar(name, a, b, key, target)

        # Swapped units come into memory one at a time and go back to their file after.
        replaced = []  # the state tensors adopted views replace, freed on the reaper thread
        for run in resident_runs(opt.engine.joined().runs, write=True):
            for item in later.pop(id(run), ()):
                put_param(*item)
            names = {p.segment.name for p in run.unit.layout.pieces_in(run.a, run.b)}
            replaced += opt.engine.joined().inner.state.get(run.tensor, {}).values()
            fill_run(opt, run, sorted(set().union(*(keys[n] for n in names))), fetch,
                     adopt=None if streamed or not src.adoptable else _adopter(src, opt, run, ckpt_name))
            if streamed:
                src.release()  # host memory holds one run's checkpoint data at a time
        reap(replaced)
    normalize_loaded(opt)
    opt.gather_params()


# Note [adopting verified state]
# A load reads every block into fresh buffers and verifies them all before it applies
# anything (a damaged checkpoint loads nothing). Applying was then one copy of every byte
# into the live tensors: 0.09-0.12 s of a 2 GB load (~1 s) on the benchmark's VM, 10% of the
# load at disk speed. The optimizer moments need no copy: a save writes each run's pieces
# kind by kind (``commit._run_major``), so a run's ``exp_avg`` is one range of the data file
# and of the verified buffer, and the load makes that view the state tensor (the replaced
# tensors are freed on the reaper thread; unmapping them would cost the caller more than the
# copy did). Parameters are still copied: they are views of the unit's flat buffer, which
# gradients, hooks and gatherers hold. The buffer's other pages (the parameters' bytes) are
# given back (madvise) when the reader is released, so the load's memory ends where the
# copying load's did. Peak memory is unchanged (the buffers are the bytes read, once, as
# before) and the view lives until the next load replaces it. The state is adopted only where
# that is invisible: a plain (not pinned) CPU tensor of the run's dtype, no tensor
# parallelism, no state in swap files, each piece from one saved piece stored in the global
# order (not a tensor saved under tp in chunks along a dimension > 0, whose bytes are a
# permutation of the run's: Note [stored order] in tp_layout.py), the view aligned to the
# dtype; anything else (including checkpoints written in the older piece-by-piece order) is
# copied as before. (With one run per unit and group a run rarely lay in one saved piece, so
# the permuted case was copied by chance; one run per parameter, Note [one run per
# parameter], adopts it wherever a parameter's owned piece lies in one tp rank's chunk.) The alternative the issue named, reading into per-tensor buffers and
# copying into them on the reader threads while the disk works, would cost a second
# in-memory pass over every byte (on 2 cores shared with the crc32s) to save the same copy.
def _adopter(src: _Source, opt: Any, run: Any, ckpt_name: dict[str, str]):
    """``adopt(key)`` for ``fill_run``: the verified view holding ``run``'s state ``key``
    whole, or None where it must be copied (Note [adopting verified state])."""
    current = opt.engine.joined().inner.state.get(run.tensor, {})
    if _swapper_of(opt) is not None or _tp_of(opt) is not None or \
            run.tensor.device.type != "cpu":
        return None

    def adopt(key: str) -> Optional[torch.Tensor]:
        live = current.get(key)
        if live is not None and (live.device.type != "cpu" or live.dtype != run.tensor.dtype or
                                 torch.cuda.is_available() and live.is_pinned()):
            return None
        ranges, readers = [], set()
        for piece in run.unit.layout.pieces_in(run.a, run.b):
            name = ckpt_name[piece.segment.name]
            if not tp_layout.global_order(tp_layout.split_of(src.body["tensors"][name])):
                return None  # (saved under tp in another order: the bytes are not the run's, Note [stored order])
            saved = list(src.overlapping(name, piece.start, piece.stop))
            if len(saved) != 1 or f"state.{key}" not in saved[0]["keys"]:
                return None
            p, entry = saved[0], saved[0]["keys"][f"state.{key}"]
            reader = src.reader(p["file"])
            if reader.entries[entry].dtype != run.tensor.dtype:
                return None
            readers.add(p["file"])
            ranges.append(reader.byte_range(entry, piece.start - p["start"], piece.stop - p["start"]))
        if len(readers) != 1:
            return None
        view = src.reader(readers.pop()).adopt(ranges, run.tensor.dtype)
        return view if view is not None and view.numel() == run.b - run.a else None
    return adopt


_MALFORMED = (ValueError, TypeError, KeyError, IndexError, AttributeError, struct.error, RecursionError,
              OverflowError)
"""What reading a malformed file could still raise past the validators (a safety net: each
becomes CheckpointCorruptError naming the step, so the root falls back instead of crashing)."""


def load_checkpoint(path: str, *, model: Optional[nn.Module] = None, optimizer: Any = None,
                    scheduler: Any = None, dataloader: Any = None, load_rng: bool = True) -> dict:
    """Loads the newest valid step under a root (or exactly the given step directory) into
    ``model``/``optimizer`` at any world size and stage. Returns a dict with ``step``,
    ``path``, ``extra``, ``skipped`` [(dir, reason)], ``resharded``, ``rng_restored`` and
    ``bytes_read`` (by this rank: what its pieces need, rounded out to checksum blocks).

    Everything is read, decoded and checked on every rank before anything is applied; a
    step that fails (damaged, malformed) is skipped for the next newest, and nothing of it
    reaches the model, the optimizer or any other object passed in."""
    wait_checkpoint()  # (and the deletion of rotated-out steps: it would compete for the disk)
    if model is None and optimizer is None:
        raise ValueError("load_checkpoint needs model=... and/or optimizer=...")
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path={path!r}: a checkpoint path must be a str or os.PathLike")
    if not isinstance(load_rng, bool):
        raise TypeError(f"load_rng={load_rng!r} must be True or False")
    path = os.fspath(path)
    comm = optimizer.engine.comm if optimizer is not None else _world_comm()
    if _tp_of(optimizer) is not None or stage_merge.pipeline_of(optimizer) is not None:
        comm = checkpoint_comm(optimizer)  # every rank of dp x tp (x pp) takes part, as in the save
    held = _held(model, optimizer)
    exact = locate.is_step_dir(path)
    todo = [path] if exact else locate.candidates(path)
    if not todo:
        raise CheckpointError(f"no checkpoint under {path!r} (expected step-NNNNNNNN directories)")
    skipped: list[tuple[str, str]] = []
    for step_dir in todo:
        src, plan, error = None, None, None
        try:
            body = locate.check_step(step_dir)  # the checks latest_checkpoint makes, first
            check_compatible(body, model, optimizer, step_dir, held)
            check_state_kinds(body, model, optimizer, step_dir)  # (Note [state kinds])
            # Offloaded state streams: verified blocks are kept a few at a time, not all,
            # and the apply phase reads (and verifies) them again as it fills each unit.
            src = _Source(step_dir, body, max_blocks=_STREAM_BLOCKS if _streamed(optimizer) else None)
            read_phase(src, model, optimizer)
            plan = trainer_state.prepare(body, optimizer, scheduler, dataloader, step_dir, comm.rank,
                                         comm.world_size, load_rng, held[1])
        except CheckpointMismatchError as exc:
            error = ("mismatch", str(exc))
        except (CheckpointCorruptError, OSError) as exc:
            error = ("corrupt", str(exc))
        except _MALFORMED as exc:
            error = ("corrupt", f"{step_dir}: malformed checkpoint ({type(exc).__name__}: {exc})")
        errors = [e for e in comm.all_gather_object(error) if e]
        if not errors:  # every rank read everything: apply the small state, agreed, with a way back
            if src is None or plan is None:  # (without an error, this rank read it all)
                raise RuntimeError(f"{step_dir}: no rank reported an error, but this rank's read is incomplete")
            failed, undo = trainer_state.apply(plan, optimizer, scheduler, dataloader)
            refused = [e for e in comm.all_gather_object(failed) if e]
            if refused:
                if failed is None:
                    undo()
                src.release()
                raise CheckpointMismatchError(f"{step_dir}: the scheduler, data loader or optimizer refused the "
                                              f"saved state ({refused[0]}); nothing was loaded")
            break
        if src is not None:
            src.release()
        mismatch = [m for kind, m in errors if kind == "mismatch"]
        if mismatch:
            raise CheckpointMismatchError(mismatch[0])
        if exact:
            raise CheckpointCorruptError(f"cannot load {step_dir}: {errors[0][1]}")
        skipped.append((step_dir, errors[0][1]))
        warnings.warn(f"skipping checkpoint {step_dir}: {errors[0][1]}", stacklevel=2)
    else:
        raise CheckpointCorruptError(f"no valid checkpoint under {path!r}; skipped: " +
                                     "; ".join(f"{d}: {r}" for d, r in skipped))
    try:
        apply_phase(src, model, optimizer)
        codec_residuals.restore(optimizer, src.reader, body["world_size"], comm.rank, comm.world_size)
    except (CheckpointError, OSError) as exc:  # only I/O can fail here: every value was checked
        raise CheckpointError(f"loading {step_dir} failed while writing the state in ({exc}); the model and "
                              "optimizer are partly loaded: load again before training") from exc
    finally:
        src.release(defer=True)  # the gigabytes are unmapped on another thread
    if optimizer is not None:  # a failed step no longer matters; steps_done is the loaded step
        state_restored(optimizer, body["step"])
    return {"step": body["step"], "path": step_dir, "extra": plan.extra,
            "skipped": skipped, "world_size": body["world_size"], "stage": body["stage"],
            "resharded": body["world_size"] != comm.world_size or
            body["stage"] != getattr(optimizer, "stage", body["stage"]) or _tp_changed(body, model, optimizer) or
            body.get("pipeline_stages", 1) != stage_merge.stages_of(optimizer),
            "rng_restored": plan.rng is not None,
            "bytes_read": sum(r.bytes_read for r in src.readers.values())}


def _tp_changed(body: dict, model: Optional[nn.Module], opt: Any) -> bool:
    """The checkpoint's tensor-parallel splits differ from the optimizer's."""
    tp = _tp_of(opt)
    names = name_map(model, opt) if opt is not None else {}
    splits = {own: tp.split_of(own) if tp is not None else None for own in names}
    mine = {ckpt: (split[0].manifest() if split else None) for own, ckpt in names.items() for split in (splits[own],)}
    saved = {n: m.get("split") for n, m in body["tensors"].items() if m.get("kind") == "sharded"}
    return any(saved.get(n) != s for n, s in mine.items()) if opt is not None else False


_STREAM_BLOCKS = 4
"""Checksum blocks (32 MiB each) a streamed load keeps per data file while verifying."""


def _streamed(opt: object) -> bool:
    """The optimizer keeps its state in swap files: load without holding it all in memory."""
    engine = engine_of(opt)
    return engine is not None and engine.unit_store is not None


def _world_comm() -> Any:
    return Comm(None)


__all__ = ["load_checkpoint", "check_compatible", "DTYPES"]


def _tp_of(opt: object) -> Optional[TensorParallel]:
    engine = engine_of(opt)
    return engine.tp if engine is not None else None


def _swapper_of(opt: object) -> Optional[NvmeOptimizerState]:
    engine = engine_of(opt)
    return engine.swapper if engine is not None else None
