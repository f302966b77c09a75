"""The step ledger: what this process knows of every step on every tier, behind one lock.

The store's threads (the caller's, the commit worker, one copy worker per slower tier) all read and
change the same facts; each change is one named operation here, so the rules live in one place:

- which committed steps each tier holds (``listed``, ``stored``, ``claim``);
- each tier's save history, which the save policies see (a step enters it when a tier is chosen for it
  and leaves it when the tier did not get it: ``begin``, ``copied``, ``abandon``);
- the steps whose background work is unfinished, those not yet committed, and those each slower tier has
  still to get until their copy is released (``begin``, ``committed``, ``done``, ``released``; the
  in-flight bound, per tier: ``wait_for_room``; a save short of RAM waits for a release:
  ``wait_for_release``);
- pins: steps being read from or copied out of a tier, which retention must not delete (``pinned``);
- transient steps (staged in the first tier only to be copied on: ``retire``), and the step the job last
  restored (``restored``: the timeline rule of :mod:`.timeline` starts from it);
- failures of background work, raised by the next call (``fail``/``take_errors``).
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Iterable, Iterator, Sequence

from ..policies import StepInfo


@dataclass(frozen=True)
class Snapshot:
    """What retention decides on, read at one moment: the steps each tier holds, the transient steps,
    every step's info and the pinned steps of each tier."""

    held: dict[str, set[int]]
    transient: frozenset[int]
    info: dict[int, StepInfo]
    pinned: dict[str, frozenset[int]]


class StepLedger:
    """Bookkeeping of one store, for the tiers named ``names`` (fastest first)."""

    def __init__(self, names: Sequence[str]) -> None:
        self.names = list(names)
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._index: dict[str, set[int]] = {}  # tier -> committed steps (this process's view)
        self._history: dict[str, list[StepInfo]] = {n: [] for n in names}
        self._info: dict[int, StepInfo] = {}
        self._pins: dict[str, dict[int, int]] = {n: {} for n in names}
        self._transient: set[int] = set()
        self._restored: int | None = None  # the step the last restore of this process got
        self._errors: list[BaseException] = []
        self._in_flight: dict[int, int] = {}  # step -> unfinished background jobs (commit, copies)
        self._uncommitted: set[int] = set()  # staged in the first tier, marker not yet written
        # tier -> the steps a slower tier has still to get: queued or being copied, until the copy ended and
        # retention ran after it (released)
        self._copying: dict[str, set[int]] = {n: set() for n in names}
        self._releases = 0  # copies out of the first tier released so far (wait_for_release)

    # -- what the tiers hold ------------------------------------------------------------------------
    def listed(self, tier: str, steps: Iterable[int] | None) -> None:
        """A fresh listing of ``tier``'s committed steps (None: it could not be listed, keep what was
        known). Steps new to this process enter the tier's history."""
        with self._lock:
            if steps is None:
                self._index.setdefault(tier, set())
                return
            self._index[tier] = set(steps)
            known = {i.step for i in self._history[tier]}
            self._history[tier] += [StepInfo(s) for s in sorted(self._index[tier] - known)]
            self._history[tier].sort(key=lambda i: i.step)

    def holding(self, tier: str) -> set[int]:
        """The committed steps ``tier`` holds."""
        with self._lock:
            return set(self._index.get(tier, ()))

    def holders(self, step: int) -> list[str]:
        """The tiers holding a committed copy of ``step``, fastest first."""
        with self._lock:
            return [n for n in self.names if step in self._index.get(n, ())]

    def known(self, step: int) -> bool:
        """Whether ``step`` is being saved or is committed on some tier."""
        with self._lock:
            return step in self._in_flight or any(step in s for s in self._index.values())

    def known_steps(self) -> set[int]:
        """Every step being saved or committed on some tier."""
        with self._lock:
            return set(self._in_flight).union(*self._index.values())

    def previous(self, tier: str) -> tuple[StepInfo, ...]:
        """The steps ``tier`` saved before, oldest first (what its save policy sees)."""
        with self._lock:
            return tuple(self._history[tier])

    def stored(self, tier: str, step: int) -> None:
        """``tier`` now holds a committed copy of ``step``."""
        with self._cond:
            self._index.setdefault(tier, set()).add(step)
            self._cond.notify_all()

    def claim(self, tier: str, step: int) -> bool:
        """Take ``step`` off ``tier`` before deleting it; False when it is not there (or another thread
        claimed it first), so two threads never delete a step at once."""
        with self._lock:
            if step not in self._index.get(tier, ()):
                return False
            self._index[tier].discard(step)
            self._forget(step, [tier])
            return True

    def _forget(self, step: int, tiers: Iterable[str]) -> None:
        """(lock held) ``step`` leaves the histories of ``tiers``: their policies may take a later one."""
        for t in tiers:
            self._history[t] = [i for i in self._history[t] if i.step != step]

    # -- saving -------------------------------------------------------------------------------------
    def busy(self, step: int) -> bool:
        """Whether ``step``'s save is still under way."""
        with self._lock:
            return step in self._in_flight

    def wait_for_room(self, bound: int, tiers: Iterable[str] = ()) -> None:
        """Wait until fewer than ``bound`` saves are not yet committed in the first tier, and fewer than
        ``bound`` steps are still on their way to each of the slower ``tiers`` (the bound is per tier: a slow
        upload holds back only the next saves to its own tier), or until background work failed."""
        with self._cond:
            while not self._errors and (len(self._uncommitted) >= bound or any(
                    len(self._copying[t]) >= bound for t in tiers)):
                self._cond.wait()

    def on_the_way(self, tier: str) -> int:
        """How many steps slower ``tier`` has still to get (queued or being copied)."""
        with self._lock:
            return len(self._copying[tier])

    @property
    def releases(self) -> int:
        """How many copies out of the first tier have ended (read before a try :meth:`wait_for_release`
        may repeat)."""
        with self._lock:
            return self._releases

    def released(self, tier: str, step: int) -> None:
        """The copy of ``step`` to ``tier`` ended, and retention ran after it: the RAM it held may be free,
        and the tier has one step fewer on its way."""
        with self._cond:
            self._copying[tier].discard(step)
            self._releases += 1
            self._cond.notify_all()

    def wait_for_release(self, seen: int) -> bool:
        """Wait until a copy out of the first tier ended after :attr:`releases` read ``seen`` (whether it
        failed or not: its step may go all the same, and its failure is the next call's to raise); False at
        once when none is on its way (nothing will free RAM)."""
        with self._cond:
            while self._releases == seen and any(self._copying.values()):
                self._cond.wait()
            return self._releases != seen

    def begin(self, step: int, info: StepInfo, chosen: Iterable[str], *, transient: bool) -> None:
        """A save of ``step`` starts: it enters the histories of the ``chosen`` tiers; ``transient``: the
        first tier holds it only until the slower tiers have it."""
        chosen = list(chosen)
        with self._lock:
            self._info[step] = info
            for t in chosen:
                self._history[t].append(info)
            if transient:
                self._transient.add(step)
            self._in_flight[step] = 1
            self._uncommitted.add(step)
            for t in chosen:
                if t != self.names[0]:
                    self._copying[t].add(step)

    def committed(self, step: int, first: str, copies: int) -> None:
        """``step`` is committed in the first tier; ``copies`` background copies of it follow."""
        with self._cond:
            self._index.setdefault(first, set()).add(step)
            self._uncommitted.discard(step)
            self._in_flight[step] += copies
            self._cond.notify_all()

    def catch_up(self, step: int, tier: str, info: StepInfo, *, transient: bool) -> None:
        """A step committed in the first tier goes on to ``tier``, whose policy took it, as one more background
        job of the step; ``transient``: the first tier's policy did not take it (it leaves once copied)."""
        with self._lock:
            self._info.setdefault(step, info)
            if all(i.step != step for i in self._history[tier]):
                self._history[tier] = sorted([*self._history[tier], info], key=lambda i: i.step)
            if transient:
                self._transient.add(step)
            self._in_flight[step] = self._in_flight.get(step, 0) + 1
            self._copying[tier].add(step)

    def abandon(self, step: int) -> None:
        """``step``'s commit failed: no tier got it, and its save is over."""
        with self._cond:
            self._forget(step, self.names)
            self._transient.discard(step)
            self._uncommitted.discard(step)
            for steps in self._copying.values():
                steps.discard(step)
            self._cond.notify_all()
        self.done(step)

    def copied(self, tier: str, step: int, ok: bool) -> None:
        """A background copy of ``step`` to ``tier`` ended; a step ``tier`` did not get leaves its history."""
        with self._cond:
            if ok:
                self._index.setdefault(tier, set()).add(step)
            else:
                self._forget(step, [tier])
            self._cond.notify_all()

    def done(self, step: int) -> None:
        """One background job of ``step`` ended."""
        with self._cond:
            self._in_flight[step] -= 1
            if not self._in_flight[step]:
                del self._in_flight[step]
            self._cond.notify_all()

    # -- pins ---------------------------------------------------------------------------------------
    def pin(self, tier: str, step: int) -> None:
        with self._lock:
            pins = self._pins[tier]
            pins[step] = pins.get(step, 0) + 1

    def unpin(self, tier: str, step: int) -> None:
        with self._lock:
            pins = self._pins[tier]
            pins[step] -= 1
            if not pins[step]:
                del pins[step]

    @contextlib.contextmanager
    def pinned(self, tier: str, step: int) -> Iterator[None]:
        """Retention leaves ``step`` on ``tier`` alone while the block reads or copies it."""
        self.pin(tier, step)
        try:
            yield
        finally:
            self.unpin(tier, step)

    # -- transient and stale steps ------------------------------------------------------------------
    def retire(self, step: int, first: str) -> bool:
        """Whether transient ``step`` should now leave the ``first`` tier: it is not pinned there and some
        other tier holds it (it leaves the transient set either way, once unpinned)."""
        with self._lock:
            if step not in self._transient or self._pins[first].get(step):
                return False
            self._transient.discard(step)
            return any(step in self._index.get(t, ()) for t in self.names if t != first)

    @property
    def restored(self) -> int | None:
        """The step the last restore of this process got (None: it restored none)."""
        with self._lock:
            return self._restored

    def restore_of(self, step: int) -> None:
        """A restore got ``step``: the job goes on from it."""
        with self._lock:
            self._restored = step

    # -- retention ----------------------------------------------------------------------------------
    def snapshot(self) -> Snapshot:
        with self._lock:
            return Snapshot({n: set(self._index.get(n, ())) for n in self.names}, frozenset(self._transient),
                            dict(self._info), {n: frozenset(p) for n, p in self._pins.items()})

    def unknown_info(self) -> list[int]:
        """Committed steps whose time and metrics this process does not know (it did not save them)."""
        with self._lock:
            return sorted(set().union(*self._index.values()) - set(self._info))

    def learn(self, step: int, info: StepInfo) -> None:
        """The time and metrics of a step this process did not save, read from its marker and manifest."""
        with self._lock:
            self._info.setdefault(step, info)

    # -- failures -----------------------------------------------------------------------------------
    def fail(self, e: BaseException) -> None:
        """Background work failed: kept for the next call, and waiters wake."""
        with self._cond:
            self._errors.append(e)
            self._cond.notify_all()

    def take_errors(self) -> list[BaseException]:
        with self._lock:
            errors, self._errors = self._errors, []
        return errors
