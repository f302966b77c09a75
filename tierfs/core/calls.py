"""A store used from several threads: its calls run one at a time, and no save removes another thread's.

Every public call of a :class:`~tierfs.TieredStore` that saves, restores, deletes, lists or agrees with the
other ranks (and every such call of a :class:`~tierfs.CheckpointManager`) holds one re-entrant lock for
the whole call, so calls from several threads run one after the other, in the order they take the lock;
a call made inside another (the manager's save calling the store's, DCP's writer calling the store) takes
it again. The background workers (commit, copies, the rest of a restore) never take it: they call the
store's parts, not its public methods, so a call waiting for them (room for a save, a restore waiting for
the commits) cannot deadlock. Calls that only wait for background work or raise its failures
(``wait_until_finished``, ``wait_until_committed``, ``raise_background_errors``) and the reads without
collectives do not take it either.

Serialising calls is not enough when threads save interleaved steps: by the timeline rule
(:mod:`tierfs.core.timeline`) a save of step ``s`` removes every step above ``s``, so thread A saving
step 4 after thread B saved step 5 would remove step 5, whose save returned True. A save that would
remove a step another thread's save returned True for is refused (an
:class:`~tierfs.errors.ArgumentError`, before anything is written); a thread going back over its own steps
is the timeline rule at work, as in a single-threaded job. A restore (or ``resume_from``) of step ``r``
says the job goes on from ``r``: the steps above it that any thread saved are superseded by the next
save, as the rule says. The record of which thread saved which step is made of the calls themselves, so
on several ranks whose threads call in the same order every rank refuses the same save.
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable, TypeVar, cast

from ..util import args as _args
from . import timeline
from ..errors import ArgumentError

#: the steps (the highest) whose saver is remembered; a save below all of them is rare enough to allow
MAX_RECORDED = 4096

F = TypeVar("F", bound=Callable[..., Any])


def serial(method: F) -> F:
    """A method of an object with ``_calls`` (a :class:`Calls`) run while holding its lock."""
    @functools.wraps(method)
    def held(self: Any, *args: Any, **kwargs: Any) -> Any:
        with self._calls.lock:
            return method(self, *args, **kwargs)
    return cast(F, held)


class Calls:
    """The lock of one store's public calls, and which thread saved each recent step."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self._savers: dict[int, int] = {}  # step -> the thread whose save of it returned True

    def check_save(self, step: Any, restored: int | None) -> None:
        """Refuse a save of ``step`` from this thread that would remove (the timeline rule, from the step
        ``restored``) a step another thread saved. A bad ``step`` is left for the save to raise, where every
        rank hears of it."""
        try:
            step = _args.step(step)
        except ArgumentError:
            return
        me = threading.get_ident()
        theirs = sorted((s for s in self._removed(step, restored) if self._savers[s] != me), reverse=True)
        if theirs:
            why = ("a save removes every step above it" if theirs[0] > step else
                   f"after the restore of step {restored}, a save below a stored step also removes the steps "
                   "between the two")
            raise ArgumentError(f"step {step} cannot be saved from this thread: it would remove step(s) {theirs[:5]}, "
                                f"which another thread saved ({why}: the timeline rule); save steps in increasing "
                                "order across threads, or restore (or resume_from) the step to go back to first")

    def saved(self, step: int, restored: int | None) -> None:
        """This thread's save of ``step`` returned True: remember it; forget the steps it superseded."""
        for s in self._removed(step, restored):
            del self._savers[s]
        self._savers[step] = threading.get_ident()
        while len(self._savers) > MAX_RECORDED:
            del self._savers[min(self._savers)]

    def restored(self, step: int) -> None:
        """The job goes on from ``step``: the steps above it are superseded by the next save, whoever saved
        them."""
        for s in [s for s in self._savers if s > step]:
            del self._savers[s]

    def forget(self, step: int) -> None:
        """``step`` was deleted from every tier."""
        self._savers.pop(step, None)

    def _removed(self, step: int, restored: int | None) -> list[int]:
        """The recorded steps a save of ``step`` supersedes."""
        known = set(self._savers) - {step}
        return timeline.superseded([timeline.view(known, step, restored)], step, restored)
