"""Every value of a manifest checked before anything is trusted, and the same checks at save.

A manifest's CRC32 only shows it was not damaged by accident: its content is still input
that someone else may have written. So each field a loader, ``verify``, ``inspect`` or
``export`` uses is checked here for type, range and consistency (file names, sizes, block
checksums, the tiling of pieces, entry keys, optimizer scalars, hyperparameters, trainer
state), and a bad one raises CheckpointCorruptError naming it. ``check_header`` is what
``save_checkpoint`` runs on the header it is about to write, so a step the loader would
refuse (``step=True``, ``stage=2.0``) is never written.
"""
from __future__ import annotations

import math
import re
from typing import Any, Optional

import torch

from zeroshard.checkpoint import jsontree
from zeroshard.checkpoint.checkpoint_errors import CheckpointCorruptError
from zeroshard.checkpoint.names import FILE_RE, data_file, rng_file, step_dir_name
from zeroshard.checkpoint.shard_file import COMPLEX_DTYPES, DTYPES

FORMAT = "zeroshard.checkpoint"
VERSION = 1
MAX_STEP = 1 << 62
MAX_WORLD = 1 << 20
MAX_BLOCK = 64 << 20
"""Largest checksum block a loader accepts: a block is read whole to verify it, so this
bounds the memory a hostile manifest can make a reader allocate (the writer uses 32 MiB)."""
MAX_NUMEL = 1 << 42  # 4 T elements: far beyond any real tensor, far below an overflow
MAX_BYTES = 1 << 50
PRECISIONS = (None, "bf16", "fp16")
_NUMBER_KEYS = {"lr", "weight_decay", "eps", "momentum", "dampening", "alpha", "lr_decay", "rho", "lambd",
                "t0", "initial_accumulator_value", "momentum_decay", "initial_lr", "max_lr", "min_lr"}
_PAIR_KEYS = {"betas", "etas", "step_sizes"}
_FLAG_KEYS = {"amsgrad", "maximize", "foreach", "capturable", "differentiable", "fused", "nesterov",
              "decoupled_weight_decay"}
_SAMPLER_INTS = {"epoch", "consumed", "seed", "dataset_len", "num_replicas"}
_SAMPLER_FLAGS = {"shuffle", "drop_last"}
_STEP_LIKE = re.compile(r"step-\d+\s*")  # Unicode digits, trailing whitespace: names to compare


def fail(path: str, what: str) -> CheckpointCorruptError:
    return CheckpointCorruptError(f"{path}: {what}")


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: Any) -> bool:
    return (is_int(v) or isinstance(v, float)) and not (isinstance(v, float) and math.isnan(v))


def check_int(v: Any, lo: int, hi: int, path: str, what: str) -> int:
    if not is_int(v) or not lo <= v <= hi:
        raise fail(path, f"{what}={v!r} is not an int or is outside [{lo}, {hi}]")
    return v


def check_step_name(dir_name: str, step: int, path: str) -> None:
    """A directory named like a step must be named for the manifest's step, exactly: a
    ``step-0000٩`` or ``step-00000009\\n`` directory holding another step's manifest must
    not pass for step 9."""
    if _STEP_LIKE.fullmatch(dir_name) and dir_name != step_dir_name(step):
        raise fail(path, f"the directory is named {dir_name!r} but the manifest is of step {step} "
                         f"({step_dir_name(step)!r}); a renamed or forged step is not loaded")


def check_header(body: dict, path: str) -> None:
    """The fields a save writes before any data: format, step, world, stage, precision,
    optimizer, param groups, aliases, model config and trainer state."""
    if body.get("format") != FORMAT:
        raise fail(path, f"format {body.get('format')!r} is not {FORMAT!r}")
    if body.get("version") != VERSION:
        raise fail(path, f"format version {body.get('version')!r}; this zeroshard reads version "
                         f"{VERSION} (upgrade zeroshard to read newer checkpoints)")
    check_int(body.get("step"), 0, MAX_STEP, path, "step")
    world = check_int(body.get("world_size"), 1, MAX_WORLD, path, "world_size")
    check_int(body.get("stage"), 0, 3, path, "stage")
    check_int(body.get("pipeline_stages", 1), 1, world, path, "pipeline_stages")  # (Note [pipeline checkpoints])
    if body.get("mixed_precision") not in PRECISIONS:
        raise fail(path, f"mixed_precision={body.get('mixed_precision')!r} is not one of {list(PRECISIONS)}")
    if not isinstance(body.get("optimizer"), (str, type(None))):
        raise fail(path, f"optimizer={body.get('optimizer')!r} is not a class name")
    if not isinstance(body.get("model_config"), (dict, type(None))):
        raise fail(path, "model_config is not an object")
    aliases = body.get("aliases", {})
    if not isinstance(aliases, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in aliases.items()):
        raise fail(path, "aliases is not an object of names")
    check_param_groups(jsontree.decode(body.get("param_groups", []), f"{path}: param_groups"), path)
    if "frozen" in body:
        check_frozen(body["frozen"], path)
    check_trainer(body.get("trainer"), world, path, with_dataloader="files" in body)


def check_frozen(record: Any, path: str) -> None:
    """The base a checkpoint expects (Note [frozen weights in checkpoints] in frozen_base.py)."""
    if not isinstance(record, dict) or not isinstance(record.get("saved"), bool) or \
            not isinstance(record.get("tensors"), dict):
        raise fail(path, "frozen is not an object with 'saved' (true/false) and 'tensors'")
    if not isinstance(record.get("method", ""), str):
        raise fail(path, f"frozen method {record.get('method')!r} is not a name")
    for name, e in record["tensors"].items():
        if not (isinstance(e, dict) and isinstance(e.get("shape"), list)
                and all(is_int(d) and 0 <= d < 2**63 for d in e["shape"])
                and isinstance(e.get("dtype"), str) and isinstance(e.get("digest"), str) and len(e["digest"]) <= 64):
            raise fail(path, f"frozen tensor {name!r} is not an object with shape, dtype and digest")


def check_param_groups(groups: Any, path: str) -> None:
    """Shape of each saved param group and the type of every well-known hyperparameter, so
    ``lr: "fast"`` or ``betas: 5`` is refused here rather than at the first step."""
    if not isinstance(groups, list):
        raise fail(path, "param_groups is not a list")
    for i, g in enumerate(groups):
        where = f"param_groups[{i}]"
        if not isinstance(g, dict) or not isinstance(g.get("params"), list) or \
                not all(isinstance(n, str) for n in g["params"]):
            raise fail(path, f"{where} is not an object with a 'params' list of names")
        for k, v in g.items():
            if k in _NUMBER_KEYS and not (is_number(v) or _scalar_tensor(v) or k == "eps" and _eps_pair(v)):
                raise fail(path, f"{where}[{k!r}]={v!r} is not a number")
            if k in _PAIR_KEYS and not (isinstance(v, (list, tuple)) and len(v) == 2 and all(map(is_number, v))):
                raise fail(path, f"{where}[{k!r}]={v!r} is not a pair of numbers")
            if k in _FLAG_KEYS and not isinstance(v, (bool, type(None))):
                raise fail(path, f"{where}[{k!r}]={v!r} is not true/false/null")


def _eps_pair(v: object) -> bool:
    """Adafactor's ``eps``: a pair of numbers, the first of which may be None (torch's default)."""
    return isinstance(v, (list, tuple)) and len(v) == 2 and all(x is None or is_number(x) for x in v)


def _real_tensor(v: object) -> bool:
    return isinstance(v, torch.Tensor) and not v.dtype.is_complex


def _scalar_tensor(v: Any) -> bool:
    return isinstance(v, torch.Tensor) and v.numel() == 1 and not v.dtype.is_complex


def check_trainer(trainer: Any, world: int, path: str, with_dataloader: bool) -> None:
    if not isinstance(trainer, dict):
        raise fail(path, "'trainer' is missing or not an object")
    sched = jsontree.decode(trainer.get("scheduler"), f"{path}: trainer.scheduler")
    if sched is not None:
        if not isinstance(sched, dict):
            raise fail(path, f"trainer.scheduler is a {type(sched).__name__}, not a state dict")
        for k in ("last_epoch", "_step_count"):
            if k in sched and not is_int(sched[k]):
                raise fail(path, f"trainer.scheduler[{k!r}]={sched[k]!r} is not an int")
        for k in ("base_lrs", "_last_lr"):
            if k in sched and not (isinstance(sched[k], list) and all(is_number(x) or _scalar_tensor(x)
                                                                      for x in sched[k])):
                raise fail(path, f"trainer.scheduler[{k!r}] is not a list of numbers")
    scaler = trainer.get("loss_scaler")
    if scaler is not None:
        if not isinstance(scaler, dict) or not (is_number(scaler.get("scale")) and 0 < scaler["scale"] < math.inf) \
                or not all(is_int(scaler.get(k, 0)) and scaler.get(k, 0) >= 0 for k in ("good_steps", "skipped_steps")):
            raise fail(path, f"trainer.loss_scaler={scaler!r} is not a loss scaler state (a positive finite "
                             "scale and non-negative step counts)")
    jsontree.decode(trainer.get("extra"), f"{path}: trainer.extra")
    if with_dataloader:
        states = trainer.get("dataloader")
        if not isinstance(states, list) or len(states) != world:
            raise fail(path, f"trainer.dataloader is not a list of {world} per-rank states")
        for r, s in enumerate(states):
            state = jsontree.decode(s, f"{path}: trainer.dataloader[{r}]")
            if not isinstance(state, (dict, type(None))):
                raise fail(path, f"trainer.dataloader[{r}] is not a state dict")
            for k, v in (state or {}).items():  # zeroshard.data.ResumableSampler's own keys
                if k in _SAMPLER_INTS and not is_int(v) or k in _SAMPLER_FLAGS and not isinstance(v, bool):
                    raise fail(path, f"trainer.dataloader[{r}][{k!r}]={v!r} is not "
                                     f"{'an int' if k in _SAMPLER_INTS else 'true/false'}")


def check_files(body: dict, path: str) -> None:
    """Exactly one data and one RNG file per saved rank, each with a sane size, block size
    and one valid CRC32 per block. Nothing in a manifest is used as a path: names must be
    the names a save writes, joined to the step directory by the loader."""
    files = body.get("files")
    if not isinstance(files, dict):
        raise fail(path, "'files' is not an object")
    for name in files:
        if not isinstance(name, str) or not FILE_RE.fullmatch(name):
            raise fail(path, f"file name {name!r} is not a checkpoint file name (rank-NNNNN.safetensors "
                             "or rng-NNNNN.json); paths in a manifest are never followed")
    world = body["world_size"]
    want = {f(r) for r in range(world) for f in (data_file, rng_file)}
    if set(files) != want:
        extra, missing = sorted(set(files) - want), sorted(want - set(files))
        raise fail(path, f"the files listed do not match world size {world} (missing {missing[:4]}, "
                         f"unexpected {extra[:4]}); the checkpoint is incomplete or not from this format")
    for name, meta in files.items():
        if not isinstance(meta, dict):
            raise fail(path, f"{name}: file entry is not an object")
        size = check_int(meta.get("bytes"), 1, MAX_BYTES, path, f"{name} bytes")
        block = check_int(meta.get("block_size"), 1, MAX_BLOCK if name.endswith(".safetensors") else size,
                          path, f"{name} block_size")
        crcs = meta.get("crc32")
        if not isinstance(crcs, list) or len(crcs) != -(-size // block):
            raise fail(path, f"{name}: {len(crcs) if isinstance(crcs, list) else repr(crcs)} checksums for "
                             f"{size} bytes in blocks of {block}")
        if not all(is_int(c) and 0 <= c < 1 << 32 for c in crcs):
            bad = next(c for c in crcs if not (is_int(c) and 0 <= c < 1 << 32))
            raise fail(path, f"{name}: checksum {bad!r} is not a CRC32 (an int in [0, 2**32))")


def check_tensors(body: dict, path: str) -> None:
    """Every tensor entry, and pieces of each that tile it exactly, name a data file, and
    store under the keys a save uses; pieces of one param group hold the same kinds."""
    tensors = body.get("tensors")
    if not isinstance(tensors, dict):
        raise fail(path, "'tensors' is not an object")
    groups = jsontree.decode(body.get("param_groups", []), f"{path}: param_groups")
    members = {n: i for i, g in enumerate(groups) for n in g["params"]}
    kinds_of: dict[tuple[int, int], tuple] = {}
    for name, meta in tensors.items():
        sharded = _check_tensor(name, meta, body["files"], len(groups), path)
        if sharded and members.get(name) != meta["group"]:
            raise fail(path, f"tensor {name!r} is in group {meta['group']} but param_groups list it in "
                             f"{members.get(name)}")
        # (per dimensionality: an optimizer that reads whole tensors keeps other state for a
        # matrix than for a vector, e.g. Adafactor's factored moments)
        kind_key = (meta["group"], len(meta["shape"]))
        for p in meta["pieces"]:
            # (a state key by name, stored per element or whole: a one-element parameter's (1,)
            # state is both, e.g. a per-tensor scale beside other parameters' elementwise moments)
            names = frozenset(k[6:] for k in p["keys"] if k.startswith("state.")) | frozenset(p["scalars"])
            kinds = (frozenset(k for k in p["keys"] if not k.startswith("state.")), names)
            if not names:
                continue  # (no optimizer state yet: a parameter that never got a gradient, as torch saves it)
            if sharded and kinds_of.setdefault(kind_key, kinds) != kinds:
                raise fail(path, f"tensor {name!r}[{p['start']}:{p['stop']}] stores {sorted(kinds[0])} and "
                                 f"scalars {sorted(kinds[1])}, other pieces of its group and dimensionality store "
                                 f"{sorted(kinds_of[kind_key][0])}")
    for name in set(members) - set(tensors):
        raise fail(path, f"param_groups list {name!r}, which has no tensor entry")
    for alias, target in body.get("aliases", {}).items():
        if target not in tensors or alias in tensors:
            raise fail(path, f"alias {alias!r} -> {target!r} does not name one stored tensor")


def _check_tensor(name: str, meta: Any, files: dict, n_groups: int, path: str) -> bool:
    """Checks one tensor entry; True when it is sharded (trained), False when stored whole or frozen."""
    if not isinstance(meta, dict) or meta.get("dtype") not in DTYPES or not isinstance(meta.get("shape"), list) \
            or meta.get("kind") not in ("sharded", "full", "frozen") or not isinstance(meta.get("pieces"), list):
        raise fail(path, f"tensor {name!r} has a malformed entry (dtype, shape, kind and a pieces list)")
    sharded = meta["kind"] == "sharded"  # ("frozen": pieces of a stage-3 frozen unit, in no param group)
    if sharded:
        check_int(meta.get("group"), 0, n_groups - 1, path, f"{name} group")
    elif meta.get("group") is not None:
        raise fail(path, f"tensor {name!r} is stored whole but names param group {meta.get('group')!r}")
    if len(meta["shape"]) > 16:
        raise fail(path, f"tensor {name!r} has {len(meta['shape'])} dimensions")
    if "complex_dtype" in meta:  # (its reals: Note [complex parameters] in zeroshard/layout/unit_layout.py)
        cd = COMPLEX_DTYPES.get(meta["complex_dtype"]) if isinstance(meta["complex_dtype"], str) else None
        if cd is None or meta["shape"][-1:] != [2] or DTYPES[meta["dtype"]] != cd.to_real():
            raise fail(path, f"tensor {name!r} has a malformed complex_dtype {meta['complex_dtype']!r} (a complex "
                             "tensor is stored as its reals: shape (..., 2) of the matching real dtype)")
    numel = 1
    for d in meta["shape"]:
        numel *= check_int(d, 0, MAX_NUMEL, path, f"{name} dimension")
    check_int(numel, 0, MAX_NUMEL, path, f"{name} numel")
    if "split" in meta:
        _check_split(name, meta, sharded, path)
    covered = 0
    for p in meta["pieces"]:
        if not isinstance(p, dict) or not isinstance(p.get("file"), str) or not p["file"].endswith(".safetensors") \
                or p["file"] not in files or not isinstance(p.get("keys"), dict) or \
                not isinstance(p.get("scalars", {}), dict):
            raise fail(path, f"tensor {name!r}: a piece is malformed or names a file that is not a listed "
                             f"data file ({p.get('file') if isinstance(p, dict) else p!r})")
        p.setdefault("scalars", {})
        start = check_int(p.get("start"), 0, numel, path, f"{name} piece start")
        stop = check_int(p.get("stop"), start, numel, path, f"{name} piece stop")
        if start != covered:
            raise fail(path, f"tensor {name!r}: pieces leave a gap or overlap at element {covered} "
                             f"(next piece starts at {start})")
        covered = stop
        _check_keys(name, p, meta["kind"] != "full", path)
    if covered != numel:
        raise fail(path, f"tensor {name!r}: pieces cover {covered} of {numel} elements")
    return sharded


def _check_split(name: str, meta: dict, sharded: bool, path: str) -> None:
    """A TP-sharded tensor's split (Note [stored order] in tp_layout.py): a dimension of its
    shape and chunk sizes along it that add up to that dimension."""
    split = meta["split"]
    if not sharded or not isinstance(split, dict) or set(split) != {"dim", "sizes"} \
            or not isinstance(split["sizes"], list) or not 1 <= len(split["sizes"]) <= 1 << 16:
        raise fail(path, f"tensor {name!r} has a malformed split {split!r} (a trained tensor's "
                         "{'dim': d, 'sizes': [...]})")
    dim = check_int(split["dim"], 0, len(meta["shape"]) - 1, path, f"{name} split dim")
    total = sum(check_int(n, 0, MAX_NUMEL, path, f"{name} split size") for n in split["sizes"])
    if total != meta["shape"][dim]:
        raise fail(path, f"tensor {name!r}: split sizes {split['sizes']} add up to {total}, not dimension "
                         f"{dim} of shape {meta['shape']}")


def _check_keys(name: str, p: dict, sharded: bool, path: str) -> None:
    """The entry keys a save writes (``name|start|kind``, ``name|full``) and scalars that
    decode to numbers: nothing else, so one piece cannot read another's data."""
    keys, where = p["keys"], f"tensor {name!r}[{p['start']}:{p['stop']}]"
    if not sharded:
        if keys != {"param": f"{name}|full"} or p["scalars"]:
            raise fail(path, f"{where}: a tensor stored whole has keys {keys!r}, not {{'param': '{name}|full'}}")
        return
    for kind, key in keys.items():
        if not (kind in ("param", "master") or (isinstance(kind, str) and kind.startswith("state.") and len(kind) > 6)):
            raise fail(path, f"{where}: unknown stored kind {kind!r}")
        if key != f"{name}|{p['start']}|{kind}":
            raise fail(path, f"{where}: {kind} is stored under {key!r}, not {name}|{p['start']}|{kind}")
    if "param" not in keys:
        raise fail(path, f"{where}: no parameter values stored")
    for k, v in p["scalars"].items():
        value = jsontree.decode(v, f"{path}: {where} scalar {k!r}")
        # (a tensor of another shape than its parameter: per-tensor state of an optimizer that reads
        # whole tensors, e.g. Adafactor's factored moments, kept whole with its whole parameter)
        if f"state.{k}" in keys or not (isinstance(value, bool) or is_number(value) or _real_tensor(value)):
            raise fail(path, f"{where}: optimizer scalar {k!r}={v!r} is not a number or tensor (or is also a "
                             "sliced tensor)")


def compatible(live: Any, saved: Any, path: str, depth: int = 0) -> None:
    """Raises CheckpointCorruptError where ``saved`` cannot stand in for ``live`` (the value
    the target object holds now): a hyperparameter, scheduler or sampler entry of another
    type or length would load silently and fail at the first step."""
    if depth > 64 or live is None or saved is None and isinstance(live, bool):
        return
    if isinstance(live, bool) or isinstance(live, str):
        ok = type(saved) is type(live)
    elif is_number(live) or isinstance(live, float):
        ok = is_number(saved) or _scalar_tensor(saved)
    elif isinstance(live, torch.Tensor):
        ok = isinstance(saved, torch.Tensor) and saved.shape == live.shape or live.numel() == 1 and is_number(saved)
    elif isinstance(live, (list, tuple)):
        ok = isinstance(saved, (list, tuple)) and len(saved) == len(live)
        if ok:
            for i, (a, b) in enumerate(zip(live, saved)):
                compatible(a, b, f"{path}[{i}]", depth + 1)
    elif isinstance(live, dict):
        ok = isinstance(saved, dict)
        if ok:
            for k in set(live) & set(saved):
                compatible(live[k], saved[k], f"{path}[{k!r}]", depth + 1)
    else:
        return  # an object the checkpoint cannot have stored: the owner's load_state_dict judges
    if not ok:
        raise CheckpointCorruptError(f"{path}={_short(saved)} does not fit the {type(live).__name__} "
                                     f"{_short(live)} it would replace")


def _short(v: Any) -> str:
    r = repr(v)
    return r if len(r) <= 80 else r[:77] + "..."


def step_value(step: Any) -> Optional[str]:
    """Why ``step`` cannot be saved, or None (the loader's own range)."""
    if not is_int(step) or not 0 <= step <= MAX_STEP:
        return f"step={step!r}: a checkpoint step must be an int in [0, 2**62]"
    return None
