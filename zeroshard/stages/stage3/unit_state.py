"""Where each stage-3 unit is in its gather cycle, changed only by transitions that refuse the
impossible ones.

Lifecycle of a unit (``UnitState``), repeated every time a forward or backward uses it:

    RELEASED --reserve--> READING --launch--> GATHERING --arrive--> GATHERED --release--> RELEASED

- RELEASED: the flat buffer's storage is 0 bytes (Note [released parameters]) and the unit's
  modules hold its sharded parameters (Note [sharded parameters]);
- READING: the buffer has its memory (allocated, or the shard's own lent to it: Note [gather by
  alias]) but the collective has not started: the shard still streams in from the swap file,
  or the start was cut short (a failed copy or collective) and the next ``ensure`` launches it;
- GATHERING: the collective is in flight (its ``Work`` is kept here until it is waited for);
- GATHERED: the buffer holds the whole unit and its modules the unsharded parameters.

Any state but RELEASED may be released (a prefetch the forward never used, a read dropped by
``settle``). The effects of a transition (allocating, swapping registrations, waiting) are the
gatherer's (zeroshard/stages/stage3/gatherer.py); this object only keeps the record, so a bug
that skips a step fails here, naming the unit, instead of running on a half-gathered buffer.
"""
from __future__ import annotations

import enum
from typing import Iterator, Optional, Sequence, overload

from zeroshard.comm import Work


class UnitState(enum.Enum):
    RELEASED = "released"
    READING = "reading"
    GATHERING = "gathering"
    GATHERED = "gathered"


class UnitStates(Sequence[UnitState]):
    """The state of every unit of one gatherer (``states[ui]``), the collective in flight of
    each GATHERING one, and which units are gathered by their shard's memory lent."""

    def __init__(self, names: Sequence[str]) -> None:
        self._names = list(names)
        """A name per unit for the refusals (its first parameter's)."""
        self._state = [UnitState.RELEASED] * len(self._names)
        self._work: list[Optional[Work]] = [None] * len(self._names)
        self._lent = [False] * len(self._names)

    @overload
    def __getitem__(self, ui: int) -> UnitState: ...

    @overload
    def __getitem__(self, ui: slice) -> Sequence[UnitState]: ...

    def __getitem__(self, ui: int | slice) -> UnitState | Sequence[UnitState]:
        return self._state[ui]

    def __len__(self) -> int:
        return len(self._state)

    def __iter__(self) -> Iterator[UnitState]:
        return iter(self._state)

    def __repr__(self) -> str:
        return f"UnitStates({[s.value for s in self._state]})"

    def work(self, ui: int) -> Work:
        """The collective of GATHERING unit ``ui``."""
        work = self._work[ui]
        if self._state[ui] is not UnitState.GATHERING or work is None:
            raise RuntimeError(f"unit {ui} ({self._names[ui]}) has no collective in flight: it is "
                               f"{self._state[ui].value}, not {UnitState.GATHERING.value}")
        return work

    def lent(self, ui: int) -> bool:
        """Whether unit ``ui``'s buffer holds its shard's memory lent (Note [gather by alias])."""
        return self._lent[ui]

    # -- transitions -------------------------------------------------------------------------------
    def _move(self, ui: int, allowed: tuple[UnitState, ...], to: UnitState) -> None:
        if self._state[ui] not in allowed:
            raise RuntimeError(
                f"unit {ui} ({self._names[ui]}) cannot go from {self._state[ui].value} to {to.value} "
                f"(only from {' or '.join(s.value for s in allowed)})")
        self._state[ui] = to

    def reserve(self, ui: int, lent: bool = False) -> None:
        """The buffer has its memory (``lent``: the shard's own); the collective is to come."""
        self._move(ui, (UnitState.RELEASED,), UnitState.READING)
        self._lent[ui] = lent

    def launch(self, ui: int, work: Work) -> None:
        """The collective ``work`` fills the buffer."""
        self._move(ui, (UnitState.READING,), UnitState.GATHERING)
        self._work[ui] = work

    def arrive(self, ui: int) -> None:
        """The collective was waited for: the buffer holds the whole unit."""
        self._move(ui, (UnitState.GATHERING,), UnitState.GATHERED)
        self._work[ui] = None

    def release(self, ui: int) -> bool:
        """Back to RELEASED (its collective, if any, already waited for); returns whether the
        buffer held the shard's lent memory, which goes back rather than to the allocator."""
        self._move(ui, (UnitState.READING, UnitState.GATHERING, UnitState.GATHERED), UnitState.RELEASED)
        self._work[ui] = None
        lent, self._lent[ui] = self._lent[ui], False
        return lent
