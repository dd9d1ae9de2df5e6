"""``StepInFlight``: an optimizer step that finishes in the background, unit by unit.

Note [overlapped step]: with the optimizer state streamed from NVMe at stage 3, the step
is the disk reading and writing every unit's moments (and gradient, master, shard), and it
cannot start before backward ends: clipping and the fp16 overflow check need every
gradient. Forward needs a unit's new weights only when it gathers that unit. So
``optimizer.step()`` decides everything that depends on the whole model in the caller's
thread (overflow, the clip coefficient, a snapshot of each group's hyperparameters and of
the gradients to apply), then updates the units in a worker thread in the order the last
forward gathered them, and returns. Forward's gather of a unit waits for that unit only;
the disk keeps streaming the later units' state while the earlier units compute. The
update of each unit is the same kernel call on the same values as in a synchronous step,
so the bits are too.

Everything else that reads or writes the state waits for the whole step first (``join``):
the next ``step``, a backward pass (its first gradient hook), ``state_dict`` and checkpoint
code (through the optimizer's ``units``/``runs``/``inner``/``swapper``), ``close``. The
exception is ``zero_grad(set_to_none=True)``: what the user sees (``.grad`` is None) happens
at once, and the units' gradient stores are marked empty once the step has read them
(``defer``). An error in the worker (a damaged swap file, a full disk) is raised again, as
itself, by the next call that waits: the step's own call has returned by then.

Note [failed steps]: a step that fails part way (an I/O error in the background step, a full
disk, a damaged swap file; or any error inside a synchronous update) leaves some units updated
and others not, and nothing can tell which. Its error is raised once, as itself; from then on
the optimizer is *poisoned* (``poisoned``): ``step()`` and ``save_checkpoint`` refuse with a
RuntimeError that names the error, until ``load_checkpoint`` or ``load_state_dict`` restores
the state (``restored``). Forward and evaluation still run, on the half-updated weights.

Memory: the step's staging buffers are held while forward runs, beside forward's gathered
units. Units the parameter cache keeps from forward to backward wait for the whole step, so
the cache and the moments' pool (one memory in the plan: Note [automatic placement]) are
never both held. Off with ``overlap_step=False``; on by default under ``offload="auto"``.
"""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Callable, Iterable, Optional, Sequence


if TYPE_CHECKING:  # (types only: these modules build on this one)
    from zeroshard.config import ZeroConfig
    from zeroshard.offload.nvme_state import NvmeOptimizerState
    from zeroshard.offload.placement import StatePlacement
    from zeroshard.units.flat_unit import FlatUnit
    from zeroshard.units.stage_policy import StagePolicy
    from zeroshard.stages.stage3.gatherer import ParameterGatherer


class StepInFlight:
    def __init__(self) -> None:
        self._thread: Optional[threading.Thread] = None
        self._done: dict[int, threading.Event] = {}
        self._error: Optional[BaseException] = None
        self._deferred: list[Callable[[], None]] = []
        self._finished = threading.Event()
        self._finished.set()
        self.poisoned: Optional[BaseException] = None
        """The error of a step that failed part way, until the state is restored (Note [failed steps])."""
        self.steps = 0
        """Steps completed (``ZeroOptimizer.steps_done``)."""

    @property
    def running(self) -> bool:
        """A step was started and not joined yet (it may have finished its work)."""
        return self._thread is not None

    def start(self, units: Iterable["FlatUnit"], work: Callable[[Callable[["FlatUnit"], None]], None],
              after: Callable[[], None]) -> None:
        """Runs ``work(unit_done)`` in a worker thread; ``work`` calls ``unit_done(u)`` once unit
        ``u``'s new weights are in place. ``units``: those it will update (any other unit is
        ready at once). ``after`` runs in the worker once ``work`` returned."""
        self.join()
        self._done = {id(u): threading.Event() for u in units}
        self._error = None
        self._finished.clear()

        def run() -> None:
            try:
                work(self._unit_done)
                after()
            except BaseException as exc:  # raised again by the next join (Note [overlapped step])
                self._error = exc
            finally:
                for ev in self._done.values():
                    ev.set()
                self._finished.set()
        self._thread = threading.Thread(target=run, name="zeroshard-step", daemon=False)
        self._thread.start()

    def _unit_done(self, unit: "FlatUnit") -> None:
        ev = self._done.get(id(unit))
        if ev is not None:
            ev.set()

    def ready(self, unit: "FlatUnit", whole: bool = False) -> bool:
        if whole:
            return self._finished.is_set()
        ev = self._done.get(id(unit))
        return ev is None or ev.is_set()

    def wait_unit(self, unit: "FlatUnit", whole: bool = False) -> None:
        """Returns once ``unit`` is updated (``whole``: once the step's work is done)."""
        if self._thread is None or threading.current_thread() is self._thread:
            return
        if whole:
            self._finished.wait()
        else:
            ev = self._done.get(id(unit))
            if ev is not None:
                ev.wait()
        if self._error is not None:
            self.join()

    def defer(self, action: Callable[[], None]) -> bool:
        """Runs ``action`` when the step is joined; False (not deferred) when none is running."""
        if self._thread is None:
            return False
        self._deferred.append(action)
        return True

    def join(self) -> None:
        """Waits for the step, runs what was deferred, and raises the worker's error if any."""
        thread = self._thread
        if thread is None or threading.current_thread() is thread:
            return
        thread.join()
        self._thread = None
        deferred, self._deferred = self._deferred, []
        for action in deferred:
            action()
        error, self._error = self._error, None
        if error is not None:
            self.poisoned = error
            raise error

    def check(self, what: str) -> None:
        """Refuses ``what`` while a failed step's half-applied state is in place (Note [failed steps])."""
        error = self.poisoned
        if error is not None:
            raise RuntimeError(
                f"{what} refused: an earlier optimizer step failed part way ({type(error).__name__}: {error}), "
                "so some parameters and optimizer state were updated and others were not. Load a checkpoint "
                "first (zeroshard.load_checkpoint(root, model=model, optimizer=opt), or opt.load_state_dict(...) "
                "with a state dict saved before the error), then train on") from error

    def restored(self) -> None:
        """The whole state was loaded again: a failed step no longer matters."""
        self.poisoned = None


def overlaps(config: ZeroConfig, policy: StagePolicy, swapper: Optional[NvmeOptimizerState],
             gatherer: ParameterGatherer) -> bool:
    """Whether ``step()`` overlaps its swapped step with the next forward: ``overlap_step``
    (None: under offload="auto"), stage 3 (``gatherer``: asked only there) with state streamed, no hpZ."""
    wanted = config.overlap_step
    if wanted is None:
        wanted = config.automatic
    return (bool(wanted) and swapper is not None and policy.shard_parameters
            and gatherer.secondary is None and not policy.gather_after_step)


def start_swapped_step(inflight: StepInFlight, units: Sequence[FlatUnit], gatherer: ParameterGatherer,
                       swapper: NvmeOptimizerState, param_groups: list[dict], placement: StatePlacement,
                       scale: float, untouched: Optional[dict[int, list[tuple[int, int]]]] = None) -> None:
    """The swapped step of ``step()`` in ``inflight``'s worker, ``units`` (every unit, frozen
    ones included, as the gatherer numbers them) in the last forward's order; what follows it in
    a synchronous step (the step's peak memory, trimming the host pool) runs there after it.
    ``scale``: the pending clip coefficient."""
    order = [units[i] for i in gatherer.forward_unit_order()]
    todo = swapper.prepare(param_groups, unit_order=order, untouched=untouched)

    def work(unit_done: Callable[["FlatUnit"], None]) -> None:
        swapper.run(todo, grad_scale=scale, unit_done=unit_done)

    def after() -> None:
        placement.after_step()
    inflight.start([r.unit for r, _, _ in todo], work, after)
