"""Exporting a PEFT (LoRA) fine-tune trained with zeroshard: the adapter in PEFT's own format,
and the merged model as sharded safetensors that ``from_pretrained`` loads.

Both are collectives (every rank calls them; rank 0 writes). ``save_adapter`` gathers only
the trainable units, never the base. ``export_merged`` streams: it walks the stage-3 gather
groups one at a time (a block's frozen base and its adapters are one group), merges each
adapted layer while its group is gathered, and writes output shards as they fill, so memory
stays at one group plus one output shard whatever the model size. Shards are planned first
from the shapes, in the order tensors are produced.

Note [merging as PEFT does]: each adapted layer is merged by PEFT's own ``layer.merge`` (the
code ``merge_and_unload`` runs), applied to a copy of the layer's base tensors which are put
back afterwards; so every variant PEFT merges — plain LoRA, DoRA's magnitude, ``lora_bias``,
LoRA on embeddings and convolutions — comes out as ``merge_and_unload`` writes it, rounding
included. ``modules_to_save`` wrappers export their active copy under the original name (the
module ``merge_and_unload`` keeps); trainable-token wrappers are refused by name.

Note [tied weights in a merged export]: where the base ties its input and output embeddings
(``tie_word_embeddings=True``) and an adapter sits on one of them (LoRA on ``embed_tokens`` or
``lm_head``), the trained model is untied in effect: the adapter's delta applies in that
module's forward only, the other reads the base weight. ``export_merged`` writes what was
trained, the merged weight under the adapted name and the base weight under the other, and a
``config.json`` that says ``tie_word_embeddings: false``, so ``from_pretrained`` loads two
weights and the logits the adapter model gave. PEFT's ``merge_and_unload`` keeps the tie
instead: it merges into the one shared tensor, so both embeddings take the delta (a model
whose output head differs from the one trained, smaller on disk). A tie other than the word
embeddings' that an adapter breaks has no config field to record it and is refused, naming
the tied names.

Note [all or nothing on disk]: a rank-0-only write must not leave the other ranks waiting in
a collective, nor half a directory behind. Before the first collective rank 0 makes a
staging directory inside ``out_dir`` (a read-only or missing-permission target fails there)
and every rank agrees on the outcome, as ``save_checkpoint`` does. A write that fails later
(a full disk) stops rank 0's writing but not its part in the collectives; at the end the
ranks agree again, and either every file moves from the staging directory into ``out_dir``
(renames on one file system, the index last) or the staging directory is removed and every
rank raises the same error.
"""
from __future__ import annotations

import contextlib
import copy
import json
import os
import shutil
import tempfile
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, Protocol, TypeGuard, Union

import torch
from torch import nn

from zeroshard.checkpoint.export import parse_size
from zeroshard.optim.registry import optimizer_for
from zeroshard.model.full_state import full_state_dict

if TYPE_CHECKING:
    from zeroshard.optim.zero_engine import Engine


class _PeftModel(Protocol):
    """What the exports use of a ``peft.PeftModel`` (``_is_peft_model`` checks for it)."""

    peft_config: dict

    def get_base_model(self) -> nn.Module: ...

    def save_pretrained(self, save_directory: str, *, state_dict: dict[str, torch.Tensor]) -> None: ...


class _TunerLayer(Protocol):
    """What the merge uses of a PEFT tuner layer, e.g. a LoRA Linear (``_is_tuner_layer``)."""

    merged_adapters: list[str]

    def merge(self) -> None: ...

    def get_base_layer(self) -> nn.Module: ...

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]: ...


def _is_peft_model(model: nn.Module) -> TypeGuard[_PeftModel]:
    return isinstance(getattr(model, "peft_config", None), dict) and callable(getattr(model, "get_base_model", None)) \
        and callable(getattr(model, "save_pretrained", None))


def _is_tuner_layer(module: nn.Module) -> TypeGuard[_TunerLayer]:
    return (callable(getattr(module, "merge", None)) and callable(getattr(module, "get_base_layer", None))
            and hasattr(module, "merged_adapters") and isinstance(getattr(module, "base_layer", None), nn.Module))


def _peft_model(model: nn.Module) -> _PeftModel:
    """``model`` as the PEFT model the exports need; TypeError naming its type otherwise."""
    if not _is_peft_model(model):
        raise TypeError(f"{type(model).__name__} is not a PEFT model (peft.get_peft_model(...) makes one)")
    return model


def _comm(model: nn.Module) -> Any:
    opt = optimizer_for(model)
    return opt.engine.comm if opt is not None and opt.engine.comm.world_size > 1 else None


def _rank(model: nn.Module) -> int:
    opt = optimizer_for(model)
    return opt.engine.comm.rank if opt is not None else 0


def _agree(comm: Any, error: Optional[BaseException], what: str) -> None:
    """Every rank raises when any rank failed (Note [all or nothing on disk])."""
    local = None if error is None else f"{type(error).__name__}: {error}"
    if comm is None:
        failed = [(0, local)] if local is not None else []
    else:
        failed = [(r, m) for r, m in enumerate(comm.all_gather_object(local)) if m is not None]
    if failed:
        detail = "; ".join(f"rank {r}: {m}" for r, m in failed)
        raise RuntimeError(f"{what} failed, nothing was written: {detail}") from error


class _Staging:
    """Rank 0's staging directory inside ``out_dir`` (Note [all or nothing on disk])."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = os.path.abspath(out_dir)
        if os.path.exists(self.out_dir) and not os.path.isdir(self.out_dir):
            raise NotADirectoryError(f"out_dir {out_dir!r} exists and is not a directory")
        self.created = not os.path.exists(self.out_dir)
        os.makedirs(self.out_dir, exist_ok=True)
        try:
            self.path = tempfile.mkdtemp(prefix=".zeroshard-export-", dir=self.out_dir)
        except OSError:
            self._remove_created()
            raise

    def _remove_created(self) -> None:
        if self.created:
            shutil.rmtree(self.out_dir, ignore_errors=True)

    def commit(self, last: Optional[str] = None) -> None:
        """Moves everything into ``out_dir``; ``last`` (the index) goes last."""
        names = sorted(os.listdir(self.path), key=lambda n: (n == last, n))
        for name in names:
            _move_into(os.path.join(self.path, name), os.path.join(self.out_dir, name))
        os.rmdir(self.path)
        fd = os.open(self.out_dir, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def discard(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        if self.created and not os.listdir(self.out_dir):
            os.rmdir(self.out_dir)


def _move_into(src: str, dst: str) -> None:
    if os.path.isdir(src) and os.path.isdir(dst):
        for name in os.listdir(src):
            _move_into(os.path.join(src, name), os.path.join(dst, name))
        os.rmdir(src)
    else:
        os.replace(src, dst)


def _staged(model: nn.Module, out_dir: str, what: str) -> tuple[Any, Optional[_Staging]]:
    """The communicator, and rank 0's staging directory, agreed before the first collective."""
    comm = _comm(model)
    staging, error = None, None
    if _rank(model) == 0:
        try:
            staging = _Staging(out_dir)
        except OSError as exc:
            error = exc
    _agree(comm, error, f"{what} into {out_dir!r}")
    return comm, staging


def _finish(comm: Any, staging: Optional[_Staging], error: Optional[BaseException], what: str,
            last: Optional[str] = None) -> None:
    if staging is not None and error is None:
        try:
            staging.commit(last)
        except OSError as exc:
            error = exc
    if staging is not None and error is not None:
        staging.discard()
    _agree(comm, error, what)


def save_adapter(model: nn.Module, out_dir: str) -> Optional[str]:
    """Writes the adapter(s) as ``PeftModel.save_pretrained`` does (``adapter_config.json`` and
    ``adapter_model.safetensors``), loadable by ``PeftModel.from_pretrained(base, out_dir)``.
    Returns ``out_dir`` on rank 0, None elsewhere; a failure on any rank raises on every rank
    and leaves nothing behind (Note [all or nothing on disk])."""
    peft = _peft_model(model)
    comm, staging = _staged(model, out_dir, "save_adapter")
    state = full_state_dict(model, rank0_only=True, frozen=False)
    error: Optional[BaseException] = None
    if staging is not None:
        try:
            if state is None:  # (staging is rank 0's, and rank 0 gets the state)
                raise RuntimeError("full_state_dict gave rank 0 no state (a zeroshard bug)")
            peft.save_pretrained(staging.path, state_dict={k: v.contiguous() for k, v in state.items()})
        except Exception as exc:  # noqa: BLE001 - (safetensors reports a full disk as its own SafetensorError)
            error = exc
    _finish(comm, staging, error, f"save_adapter into {out_dir!r}")
    return out_dir if staging is not None else None


def _base_name(name: str) -> str:
    if name.startswith("base_model.model."):
        name = name[len("base_model.model."):]
    while ".base_layer." in name:
        name = name.replace(".base_layer.", ".")
    return name


def _merge_targets(model: nn.Module) -> dict[str, tuple[_TunerLayer, str]]:
    """State-dict key of a base tensor -> (the LoRA layer over it, the tensor's attribute name),
    for layers with active adapters (Note [merging as PEFT does])."""
    names = {id(m): n for n, m in model.named_modules()}
    out: dict[str, tuple[_TunerLayer, str]] = {}
    for module in model.modules():
        if not _is_tuner_layer(module):
            continue
        if module.merged_adapters:
            raise ValueError("the model has merged adapters already (merge_adapter()); unmerge them first")
        base = module.get_base_layer()
        for pname, _ in base.named_parameters(recurse=False):
            out[f"{names[id(base)]}.{pname}"] = (module, pname)
    return out


def _renamed(model: nn.Module) -> Callable[[str], Optional[str]]:
    """Key -> the key ``merge_and_unload``'s model has for it (None: not exported): a
    ``modules_to_save`` wrapper exports its active copy under the wrapped module's name."""
    from peft.utils.other import ModulesToSaveWrapper, TrainableTokensWrapper
    rules: list[tuple[str, Optional[str]]] = []  # (key prefix, its replacement or None to drop)
    for name, module in model.named_modules():
        if isinstance(module, TrainableTokensWrapper):
            raise ValueError(f"export_merged does not support trainable_token_indices ({name}); merge with PEFT's "
                             "merge_and_unload on the weights zeroshard.full_state_dict(model) returns")
        if isinstance(module, ModulesToSaveWrapper):
            active = module.active_adapters
            keep = f"{name}.modules_to_save.{module.active_adapter}." if active else f"{name}.original_module."
            rules.append((keep, f"{name}."))
            rules += [(f"{name}.original_module.", None), (f"{name}.modules_to_save.", None)]

    def rename(key: str) -> Optional[str]:
        if ".lora_" in key:  # the adapters themselves: merged into their base weights
            return None
        for prefix, replacement in rules:
            if key.startswith(prefix):
                return None if replacement is None else replacement + key[len(prefix):]
        return key
    return rename


@torch.no_grad()
def _merged(layer: _TunerLayer) -> dict[str, torch.Tensor]:
    """The layer's base tensors with its active adapters merged by PEFT's own ``merge``, the
    layer left as it was (Note [merging as PEFT does])."""
    params = dict(layer.get_base_layer().named_parameters(recurse=False))
    originals = {n: p.data for n, p in params.items()}
    merged_before = list(layer.merged_adapters)
    caches = dict(getattr(layer, "_caches", {}))
    try:
        for n, p in params.items():
            p.data = originals[n].clone()
        layer.merge()
        return {n: p.data for n, p in params.items()}
    finally:
        for n, p in params.items():
            p.data = originals[n]
        layer.merged_adapters[:] = merged_before
        after = getattr(layer, "_caches", None)  # (the layer's cache of merge results, where PEFT keeps one)
        if after is not None:
            after.clear()
            after.update(caches)


class _Groups:
    """Which gather groups hold what, and gathering them: below stage 3 (or without an optimizer)
    one group, -1, always "gathered" (stage 3's: ``_Stage3Groups``)."""

    def group_of(self, t: torch.Tensor) -> int:
        return -1

    def order(self) -> list[int]:
        return []

    @contextlib.contextmanager
    def gathered(self, gis: list[int]) -> Iterator[None]:
        yield


class _Stage3Groups(_Groups):
    """Stage 3's gather groups (``ParameterGatherer.groups``), gathered for as long as a block runs."""

    def __init__(self, engine: Engine) -> None:
        self.gatherer = engine.stage3_gatherer
        self.where = engine.segment_index()

    def group_of(self, t: torch.Tensor) -> int:
        if id(t) not in self.where:
            return -1
        unit = self.where[id(t)][0]
        return self.gatherer.group_of[next(i for i, u in enumerate(self.gatherer.units) if u is unit)]

    def order(self) -> list[int]:
        return list(range(len(self.gatherer.groups)))

    @contextlib.contextmanager
    def gathered(self, gis: list[int]) -> Iterator[None]:
        gis = [g for g in gis if g >= 0]
        for gi in gis:
            self.gatherer.ensure_group(gi)
        try:
            yield
        finally:
            for gi in reversed(gis):
                self.gatherer.release_group(gi)


def _groups_of(model: nn.Module) -> _Groups:
    opt = optimizer_for(model)
    return _Stage3Groups(opt.engine) if opt is not None and opt.engine.shards_parameters else _Groups()


def _plan(model: nn.Module, groups: _Groups, rename: Callable[[str], Optional[str]]) -> list[tuple[int, list[str]]]:
    """(group, state_dict keys it produces), in production order; group -1: unmanaged tensors."""
    live = model.state_dict(keep_vars=True)
    by_group: dict[int, list[str]] = {}
    for key, t in live.items():
        if rename(key) is not None:
            by_group.setdefault(groups.group_of(t), []).append(key)
    return [(gi, by_group[gi]) for gi in groups.order() + [-1] if gi in by_group]


@torch.no_grad()
def export_merged(model: nn.Module, out_dir: str, max_shard_size: Union[int, str] = "2GB",
                  dtype: Optional[torch.dtype] = None) -> Optional[str]:
    """Merges the adapters into the base weights as PEFT's ``merge_and_unload`` does (LoRA,
    DoRA, LoRA on embeddings, ``modules_to_save``: Note [merging as PEFT does]) and writes the
    base model's Hugging Face layout (``model-0000k-of-0000n.safetensors``,
    ``model.safetensors.index.json`` and the base's ``config.json``), loadable by
    ``AutoModelForCausalLM.from_pretrained(out_dir)``. Streamed one gather group at a time; a
    collective. Returns ``out_dir`` on rank 0; a failure on any rank raises on every rank and
    leaves nothing behind (Note [all or nothing on disk])."""
    peft = _peft_model(model)
    from safetensors.torch import save_file
    limit = parse_size(max_shard_size)
    rename = _renamed(model)
    targets = _merge_targets(model)
    untie = _broken_tie(model, peft, rename, targets)  # (before the first collective: every rank refuses alike)
    comm, staging = _staged(model, out_dir, "export_merged")
    groups = _groups_of(model)
    plan = _plan(model, groups, rename)
    live = model.state_dict(keep_vars=True)
    out_name = {k: _base_name(rename(k) or k) for _, keys in plan for k in keys}
    shapes = {k: (tuple(live[k].shape), dtype or live[k].dtype) for _, keys in plan for k in keys}
    shards: list[list[str]] = [[]]
    size = 0
    for _, keys in plan:
        for k in keys:
            shape, dt = shapes[k]
            n = torch.Size(shape).numel() * dt.itemsize
            if shards[-1] and size + n > limit:
                shards.append([])
                size = 0
            shards[-1].append(out_name[k])
            size += n
    total = len(shards)
    file_of = {name: f"model-{i + 1:05d}-of-{total:05d}.safetensors" for i, names in enumerate(shards) for name in names}
    writer = _ShardWriter(staging.path if staging is not None else None, file_of, save=save_file)
    for gi, keys in plan:
        layers = {id(targets[k][0]): targets[k][0] for k in keys if k in targets}
        needed = {gi} | {groups.group_of(p) for layer in layers.values() for p in layer.parameters() if p.requires_grad}
        with groups.gathered(sorted(needed)):
            current = model.state_dict(keep_vars=True)  # (gathered: the unsharded views)
            merged = {lid: _merged(layer) for lid, layer in layers.items()}
            for k in keys:
                target = targets.get(k)
                t = merged[id(target[0])][target[1]] if target is not None else current[k].detach()
                writer.add(out_name[k], t.to(shapes[k][1]))
    error = writer.close()
    if staging is not None and error is None:
        base = peft.get_base_model()
        try:
            config = getattr(base, "config", None)
            if config is not None and untie:  # (Note [tied weights in a merged export]; the live config stays)
                config = copy.deepcopy(config)
                config.tie_word_embeddings = False
            if config is not None:
                config.save_pretrained(staging.path)
        except OSError as exc:
            error = exc
    _finish(comm, staging, error, f"export_merged into {out_dir!r}", last=_INDEX)
    return out_dir if staging is not None else None


_INDEX = "model.safetensors.index.json"


def _broken_tie(model: nn.Module, peft: _PeftModel, rename: Callable[[str], Optional[str]],
                targets: dict[str, tuple[_TunerLayer, str]]) -> bool:
    """True where the export unties the base's word embeddings (an adapter on one of them);
    ValueError naming any other tie an adapter breaks (Note [tied weights in a merged export])."""
    live = model.state_dict(keep_vars=True)
    by_tensor: dict[int, list[str]] = {}
    for key, t in live.items():
        if rename(key) is not None:
            by_tensor.setdefault(id(t), []).append(key)
    broken = [keys for keys in by_tensor.values() if len(keys) > 1 and any(k in targets for k in keys)]
    if not broken:
        return False
    base = getattr(peft, "get_base_model")()  # (a PeftModel's; typed as a Module here)
    config = getattr(base, "config", None)
    words = set()
    try:
        inp, out = getattr(base, "get_input_embeddings")(), getattr(base, "get_output_embeddings")()
        words = {id(getattr(inp, "weight", None)), id(getattr(out, "weight", None))}
    except (AttributeError, NotImplementedError, TypeError):
        pass  # (not a transformers model: it has no word embeddings to untie)
    for keys in broken:
        if not (len(words) == 1 and id(live[keys[0]]) in words and getattr(config, "tie_word_embeddings", False)):
            names = [_base_name(k) for k in keys]
            raise ValueError(f"export_merged: {names} are one tied tensor and an adapter sits on "
                             f"{[n for n, k in zip(names, keys) if k in targets]}: merged, they differ, and the "
                             "config has no field to untie them; merge with PEFT's merge_and_unload (which merges "
                             "into the shared tensor) on zeroshard.full_state_dict(model), or adapt neither")
    return True


class _ShardWriter:
    """Holds one output shard at a time; writes it when its last tensor arrives. A failed write
    (a full disk) stops the writing and is returned by ``close`` (the caller goes on with the
    collectives: Note [all or nothing on disk]). ``directory`` None: this rank writes nothing."""

    def __init__(self, directory: Optional[str], file_of: dict[str, str], save: Any) -> None:
        self.directory, self.save = directory, save
        self.file_of = file_of
        self.left: dict[str, int] = {}
        for f in self.file_of.values():
            self.left[f] = self.left.get(f, 0) + 1
        self.pending: dict[str, dict[str, torch.Tensor]] = {}
        self.total = 0
        self.error: Optional[BaseException] = None

    def add(self, name: str, t: torch.Tensor) -> None:
        if self.directory is None or self.error is not None:
            return
        f = self.file_of[name]
        self.pending.setdefault(f, {})[name] = t.detach().to("cpu").contiguous().clone()
        self.total += t.numel() * t.element_size()
        self.left[f] -= 1
        if self.left[f] == 0:
            try:
                self.save(self.pending.pop(f), os.path.join(self.directory, f), metadata={"format": "pt"})
            except Exception as exc:  # noqa: BLE001 - (safetensors reports a full disk as its own SafetensorError)
                self.error = exc
                self.pending.clear()

    def close(self) -> Optional[BaseException]:
        if self.directory is None or self.error is not None:
            return self.error
        index = {"metadata": {"total_size": self.total}, "weight_map": dict(sorted(self.file_of.items()))}
        try:
            with open(os.path.join(self.directory, _INDEX), "w", encoding="utf-8") as fh:
                json.dump(index, fh, indent=2)
        except OSError as exc:
            return exc
        return None
