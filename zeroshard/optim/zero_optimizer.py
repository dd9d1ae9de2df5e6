"""ZeroOptimizer: a torch.optim.Optimizer that partitions training state across ranks.

The facade over one ``Engine`` (zero_engine.py), built complete by the assembly (Note [assembly]
in assembly.py) from a typed policy per axis; each call goes to the engine's object that does it
(docs/design.md, Note [the layers]).
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from zeroshard.config import ZeroConfig
from zeroshard.layout import Segment
from zeroshard.memory import MemoryReport
from zeroshard.optim import assembly, construction, interrupts, ownership, rank_agreement, reports, state_forms, state_io
from zeroshard.units.flat_unit import FlatUnit
from zeroshard.optim.param_state import ParamStateView
from zeroshard.optim.params import ParamsLike, groups_with
from zeroshard.optim.zero_engine import Engine

class ZeroOptimizer(torch.optim.Optimizer):
    def __init__(self, model_or_params: ParamsLike, optimizer_class: type, *, stage: int = 2,
                 offload_optimizer: Optional[str] = None, offload_params: Optional[str] = None,
                 nvme_path: Optional[str] = None, mixed_precision: Optional[str] = None,
                 process_group: Optional[dist.ProcessGroup] = None, mesh: object = None,
                 module: Optional[nn.Module] = None, optimizer_kwargs: Optional[dict] = None,
                 config: Optional[ZeroConfig] = None, **kwargs: object) -> None:
        self.build_args = (optimizer_class, dict(  # (what add_param_group builds again with)
            stage=stage, offload_optimizer=offload_optimizer, offload_params=offload_params, nvme_path=nvme_path,
            mixed_precision=mixed_precision, process_group=process_group, mesh=mesh,
            optimizer_kwargs=optimizer_kwargs, config=config, **kwargs))
        self._build(model_or_params, module, first=True)

    def _build(self, model_or_params: ParamsLike, module: Optional[nn.Module], first: bool) -> None:
        """Builds the engine from ``build_args`` (Note [assembly]); torch's constructor gives torch its param
        groups the first time, a rebuild replaces them in place (Note [rebuild on add_param_group])."""
        optimizer_class, args = self.build_args
        config, inner_kwargs, model_or_params, group, mesh = assembly.configure_from(
            optimizer_class, model_or_params, module, args)
        # (checked before the model is touched, undone on an error: Note [refused construction] in construction.py)
        attached = construction.check_and_record(config, model_or_params, module, optimizer_class, inner_kwargs)
        try:  # (refused on one rank, refused on all: Note [agreed construction] in rank_agreement.py)
            self.engine, finish = rank_agreement.agreed(attached, lambda: assembly.assemble(
                self, config, optimizer_class, attached, model_or_params, module, group, mesh, inner_kwargs))
            if first:
                super().__init__(self.engine.user_groups, dict(self.engine.user_defaults))
            else:
                self.defaults, self.param_groups = dict(self.engine.user_defaults), []
                for g in self.engine.user_groups:
                    self.add_param_group(g)  # (torch's, while the engine is not ready)
            self.state = ParamStateView(self)  # type: ignore[assignment]  # (read-only)
            finish()
        except BaseException as exc:
            construction.abandon(attached, exc)
            raise
        self.engine.ready = True

    # -- properties users read -----------------------------------------------------------------
    @property
    def stage(self) -> int:
        return self.engine.config.stage

    @property
    def closed(self) -> bool:
        """Not live: closed, or not (yet) built (being built, or refused)."""
        return (e := self.__dict__.get("engine")) is None or e.closed or not e.ready

    @property
    def steps_done(self) -> int:
        """Optimizer steps completed (skipped ones too), from construction or the loaded checkpoint's
        step; whole or not begun even under Ctrl-C: the step to save (README: "Save on interrupt")."""
        return self.engine.inflight.steps

    @property
    def all_units(self) -> list[FlatUnit]:
        """Trainable units, then frozen ones (stage 3: Note [frozen units])."""
        return self.engine.joined().all_units

    @property
    def units(self) -> list[FlatUnit]:
        """The trainable flat units (layout introspection; the engine's are ``engine.units``)."""
        return self.engine.joined().units

    @property
    def inner(self) -> torch.optim.Optimizer:
        """The torch optimizer that steps this rank's owned ranges (its runs, not the model's parameters)."""
        return self.engine.joined().inner

    @property
    def data_parallel_size(self) -> int:
        """Ranks whose gradients are averaged: the shard group times its replicas."""
        return self.engine.mesh.data_parallel_size

    @property
    def loss_scale(self) -> float:
        return self.engine.precision.loss_scale

    # -- loss scaling ----------------------------------------------------------------------------
    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to call backward on (multiplied by the fp16 loss scale; unchanged otherwise)."""
        return self.engine.precision.scale_loss(loss, self.engine.reducer.passes)

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        self.scale_loss(loss).backward(**kwargs)

    # -- gradients and the step ------------------------------------------------------------------
    def model_weights_changed(self) -> None:
        """The model's parameters were written from outside (``model.load_state_dict``, a weights-only
        ``load_checkpoint``): the masters take the new values (the next step would write the old ones)."""
        self.engine.weights_changed()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """Clips the gradients of all ranks by their global norm and returns that norm (Stepper.clip)."""
        return self.engine.stepper.clip(max_norm, norm_type, error_if_nonfinite)

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None, **kwargs: Any) -> Any:
        """One optimizer step on every rank. ``kwargs`` go to the inner optimizer's step, as
        ZeroRedundancyOptimizer passes them to its local optimizer."""
        if self.closed:
            raise RuntimeError("this ZeroOptimizer was closed (close()); build a new one to train on")
        inflight = self.engine.settled().inflight
        inflight.check("optimizer.step()")  # (Note [failed steps])
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with interrupts.interrupts_held():  # a step is whole or not begun (Note [saving between steps])
            self.engine.stepper.step(self.param_groups, kwargs)
            inflight.steps += 1
        return loss

    def finish_step(self) -> None:
        """Waits for a step still updating in the background (Note [overlapped step]) and
        raises its error, if any. Calls that need the state do this themselves."""
        self.engine.inflight.join()

    def gather_params(self) -> None:
        """Makes every rank's full parameters current from the owned ranges (after a step or
        after loading owned pieces from a checkpoint). A collective."""
        self.engine.sharding.gather_params(self.engine.joined().units)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.engine.stepper.clip_coef = 1.0
        self.engine.grads.zero_grad(set_to_none, self.param_groups)

    def add_param_group(self, param_group: dict) -> None:
        """As torch.optim: the new parameters join with their own hyperparameters, existing state
        is kept. Note [rebuild on add_param_group]: units are laid out at construction, so this
        consolidates the state on every rank (a collective costing one copy of the optimizer state
        per rank for a moment), closes, builds again over the old groups plus the new one and
        loads the state back; torch's own state on this optimizer (its hooks) is kept: the rebuild
        replaces the param groups in place, not through torch's constructor."""
        if not self.engine.ready:
            return super().add_param_group(param_group)  # (torch's constructor adds the first groups)
        if not isinstance(param_group, dict) or "params" not in param_group:
            raise TypeError(f"param_group must be a dict with 'params', got {type(param_group).__name__}")
        state = self.consolidated_state_dict(to_rank=None)
        if state is None:  # (to_rank=None: every rank gets it)
            raise RuntimeError("add_param_group: the consolidated state did not reach this rank")
        e = self.engine
        groups = groups_with(e.sharding.visible, e.joined().all_units, self.param_groups, param_group)
        self.close()
        e.close_files()  # swap files are made anew by the rebuild
        self._build(groups, e.module, first=False)
        n = sum(len(g["params"]) for g in state["param_groups"])
        added = {k: v for k, v in self.param_groups[-1].items() if k != "params"}
        state["param_groups"].append({**added, "params": list(range(n, n + len(groups[-1]["params"])))})
        self.load_state_dict(state)

    # -- lifetime --------------------------------------------------------------------------------
    def close(self) -> None:
        """Detaches from the model: removes the gradient hooks, stage-3 forward hooks and the
        module guard, so the parameters can be given to a new optimizer. At stage 3 every
        parameter gets its full values back first (a collective: every rank must call it).
        Garbage collection of the optimizer does the same, except that stage-3 parameters,
        which then have no values left, must be reloaded."""
        e = self.engine
        if e.closed:
            return
        e.quiet()
        e.reducer.finalize()
        if e.shards_parameters:
            ownership.hand_back_stage3(e.stage3_gatherer, e.all_units)
        e.closed = True
        e.teardown(handed_back=True)

    def __deepcopy__(self, memo: dict) -> "ZeroOptimizer":
        raise TypeError(
            "a ZeroOptimizer cannot be deep-copied (nor copied): it owns the model's parameter storage (every parameter "
            "is a view of its flat buffers), hooks on those parameters and a process group, none of which a copy could "
            "share or duplicate. Save opt.state_dict() (or consolidated_state_dict()) and load it into a new ZeroOptimizer")

    def __copy__(self) -> "ZeroOptimizer":
        return self.__deepcopy__({})

    # -- state (torch's state-dict hooks run as in torch.optim, around the sharded state) ---------
    def state_dict(self) -> dict:
        """This rank's sharded state by parameter name and range (torch's get_state_dict: its form)."""
        for pre in self._optimizer_state_dict_pre_hooks.values():
            pre(self)
        state_dict = state_forms.produce(self) or state_io.sharded_state_dict(self)
        for post in self._optimizer_state_dict_post_hooks.values():
            result = post(self, state_dict)
            state_dict = result if result is not None else state_dict
        return state_dict

    def load_state_dict(self, state_dict: dict) -> None:
        """Loads a sharded state dict (``state_dict()``) or a consolidated one (the format of
        a plain torch.optim optimizer over the same parameters, e.g. ``consolidated_state_dict()``)."""
        if not isinstance(state_dict, dict):
            raise TypeError(f"load_state_dict takes a dict (optimizer.state_dict()), got {type(state_dict).__name__}")
        state_dict = state_dict.copy()  # (torch's contract: the hooks work on a shallow copy)
        self.engine.settled()
        for pre in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre(self, state_dict)
            state_dict = result if result is not None else state_dict
        state_io.loader_for(state_dict)(self, state_dict)  # (also torch's set_state_dict's form: state_forms.py)
        for post in self._optimizer_load_state_dict_post_hooks.values():
            post(self)
        self.engine.inflight.restored()  # (Note [failed steps])

    def consolidated_state_dict(self, to_rank: Optional[int] = 0) -> Optional[dict]:
        """The whole optimizer state as a plain ``torch.optim`` state dict (loadable by the same
        optimizer class over ``model.parameters()``). A collective: every rank must call it;
        ``to_rank=None`` returns it on every rank, otherwise other ranks get None."""
        return state_io.consolidated_state_dict(self, to_rank)

    def memory_report(self) -> MemoryReport:
        """Bytes of model state this rank holds, by category (zeroshard/optim/reports.py)."""
        return reports.memory_report(self)

    def placement_report(self, micro_batches: int = 1) -> dict:  # where state lives, why: offload/placement.py
        return reports.placement_report(self.engine.joined(), micro_batches)

    def comm_report(self, reset: bool = False) -> dict[str, dict]:
        """What this rank's collectives moved since construction (or the last ``reset``), by kind:
        calls, bytes and the group dimension crossed."""
        return reports.comm_report(self.engine.mesh, reset)

    def segment_index(self) -> dict[int, tuple[FlatUnit, Segment]]:
        """Where each managed parameter lives (frozen ones too): id(param) -> (unit, segment)."""
        return self.engine.segment_index()

    def __repr__(self) -> str:  # (also while being built)
        if (e := self.__dict__.get("engine")) is None:
            return "ZeroOptimizer(being built)"
        return (f"ZeroOptimizer(stage={self.stage}, world_size={e.mesh.comm.world_size}, units={len(e.units)}, "
                f"optimizer={e.optimizer_class.__name__}, runs_on={type(e.inner).__name__})")


def engine_of(optimizer: object) -> Optional[Engine]:
    """The engine behind a ZeroOptimizer, once a step in flight has finished (Note [overlapped
    step]); None for any other optimizer (checkpoints and integrations take any torch.optim one)."""
    return optimizer.engine.joined() if isinstance(optimizer, ZeroOptimizer) else None
