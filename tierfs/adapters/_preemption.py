"""SIGTERM for a :class:`~tierfs.CheckpointManager`: one save to the preemption tiers, then a bounded exit.

A scheduler that preempts a job sends SIGTERM, then SIGKILL a grace period later (Kubernetes' and SLURM's
default: 30 s), to one rank or to all. With ``handle_sigterm=True`` the manager takes the signal:

- every ``save`` call starts with one all-reduce of one number between the ranks (none on a single
  process): whether any rank got SIGTERM, and how long ago. So the first save after the signal goes, on
  every rank, to the tiers whose save policy includes ``PreemptionCheckpointingPolicy`` (to every tier if
  none does), once; later saves follow the tiers' usual policies. ``should_save`` (no collective) answers
  from what the ranks agreed at the last save (on a single process, from the signal itself);
- ``reached_preemption(step)`` turns True (on every rank once any rank got the signal), so the loop can stop;
  the save after its first True goes to the preemption tiers (again, if a save since the signal already
  did): the loop's last step is the one they hold;
- a loop that does not hear of it (it never calls ``reached_preemption``) is stopped when ``sigterm_grace``
  seconds have passed since the first rank got the signal: the first ``save`` call after that, on every rank
  alike, saves nothing (unless no save was made since the signal: then it is the preemption save), waits
  until the preemption save is durable (its commit and copies, within the store's ``exit_timeout``; no later
  save's copies) and ends the process as an unhandled SIGTERM would (exit status -15, no exit handlers).
  A loop that makes no save call by then is ended the same way by a watcher thread, between two of the
  manager's calls; a rank whose save then fails on the ended rank ends as SIGTERM too, not with that error.
  The uploads of older steps still queued or under way then are given up (at their next chunk, on every
  rank alike; they stay in RAM), so the job ends within the grace period plus the upload of that one save.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import threading
import time
from typing import Any, NoReturn

from ..errors import RankWaitError
from ..util.readable import duration
from ..store import TieredStore

log = logging.getLogger("tierfs")

#: seconds a loop has, after SIGTERM, to hear of it (``reached_preemption``) before the process ends
DEFAULT_SIGTERM_GRACE = 30.0
_POLL = 0.05  # seconds between two looks at whether the preemption save is durable


class Preemption:
    """The SIGTERM state of one manager over ``store``; ``grace``: seconds for the loop to hear of it."""

    def __init__(self, store: TieredStore, grace: float) -> None:
        self.store, self.grace = store, grace
        self._lock = threading.RLock()  # (the handler runs on the main thread, maybe inside)
        self._start: float | None = None  # when the first rank got SIGTERM, on this process's clock
        self._known = False  # the ranks agreed that one got it (at a save, or reached_preemption)
        self._heard = threading.Event()  # the loop heard of it (reached_preemption), or the manager closed
        self._asked = False  # reached_preemption said True before
        self._saved = False  # the save to the preemption tiers was made
        self._step: int | None = None  # the step that save wrote
        self._old: Any = None
        self._installed = False
        self._watch: threading.Thread | None = None

    # -- the handler --------------------------------------------------------------------------------
    def install(self) -> None:
        """Take SIGTERM (only the main thread may)."""
        self._old = signal.signal(signal.SIGTERM, self._on_signal)
        self._installed = True

    def uninstall(self) -> None:
        """Give SIGTERM back to the handler that had it; no exit is forced any more."""
        self._heard.set()
        if self._installed:
            signal.signal(signal.SIGTERM, self._old)
            self._installed, self._old = False, None

    def _on_signal(self, signum: int, frame: Any) -> None:
        log.warning("SIGTERM received: the next save goes to the preemption tiers on every rank and "
                    "reached_preemption(step) is True; a loop that does not ask within %s is ended at its next "
                    "save, once the preemption save is durable", duration(self.grace))
        self._begin(time.monotonic())

    def _begin(self, start: float) -> None:
        """The grace period started at ``start`` (this process's clock): watch it."""
        with self._lock:
            if self._start is None:
                self._start = start
            if self._watch is None and not self._heard.is_set():
                self._watch = threading.Thread(target=self._expire, name="tierfs-sigterm", daemon=True)
                self._watch.start()

    # -- the agreement ------------------------------------------------------------------------------
    def _reduce(self) -> int:
        """(collective on several ranks) 0 when no rank got SIGTERM, else 1 + the microseconds since the first
        did; learning it starts this rank's grace period at the same moment."""
        start = self._start
        mine = 0 if start is None else 1 + int((time.monotonic() - start) * 1e6)
        g = self.store.group
        got = g.all_reduce([mine], "max")[0] if g.world_size > 1 else mine
        if got:
            self._known = True
            self._begin(time.monotonic() - (got - 1) / 1e6)
        return got

    def agree(self) -> tuple[bool, bool]:
        """(collective on several ranks, at every save when the handler is installed) ``(preempted, ending)``:
        whether this save goes to the preemption tiers, and whether the grace period is over (the loop did not
        hear of it): the caller ends the process (:meth:`end`), after this save when it is the preemption save,
        else instead of it. The same on every rank."""
        if not self._installed:
            return self.pending(), False
        got = self._reduce()
        return self.pending(), bool(got) and not self._heard.is_set() and got - 1 >= self.grace * 1e6

    def asked(self) -> bool:
        """(collective on several ranks) ``reached_preemption``: whether any rank got SIGTERM. Its first True
        tells the loop: no exit is forced, and the next save goes to the preemption tiers (again, when a save
        since the signal already did, before the loop knew)."""
        flag = bool(self._reduce())
        if flag:
            self._heard.set()
            if not self._asked:
                self._asked, self._saved = True, False
        return flag

    # -- what the manager asks --------------------------------------------------------------------------
    @property
    def signalled(self) -> bool:
        """Whether this process got SIGTERM, or heard that another rank did."""
        return self._start is not None

    def pending(self) -> bool:
        """Whether the next save goes to the preemption tiers: the ranks know of SIGTERM (on one process: it
        came), and that save was not made yet."""
        known = self._known or (self.store.group.world_size == 1 and self._start is not None)
        return known and not self._saved

    def saved(self, step: int) -> None:
        """The save of ``step`` to the preemption tiers was made: later saves follow the usual policies."""
        self._saved, self._step = True, step

    def ends_on(self, error: BaseException) -> bool:
        """Whether a save that raised ``error`` ends the process as SIGTERM would, not raising: the loop did not
        hear of the SIGTERM this rank knows of, and the grace period is over or a rank is gone (another rank
        ended on it while this one saved)."""
        start = self._start
        if start is None or self._heard.is_set() or not self._installed:
            return False
        if time.monotonic() - start >= self.grace:
            return True
        seen: set[int] = set()
        e: BaseException | None = error
        while e is not None and id(e) not in seen:
            if isinstance(e, RankWaitError):
                return True
            seen.add(id(e))
            e = e.__cause__ or e.__context__
        return False

    # -- the end ------------------------------------------------------------------------------------
    def end(self, why: str) -> NoReturn:
        """Wait until the preemption save is durable (within ``exit_timeout``), then end the process as an
        unhandled SIGTERM would. ``why``: for the log."""
        bound = self.store.exit_timeout
        step = self._step
        what = f"step {step}, the preemption save," if step is not None else "the saves in flight"
        if step is not None:  # before anything else: older uploads queued before it are not waited for
            self.store._ctx.work.give_up_below(step)
        log.warning("SIGTERM %s: ending the process once %s is durable (at most %s)", why, what, duration(bound))
        t0 = time.monotonic()
        if not self._durable(bound):
            log.warning("tierfs: ending on SIGTERM with %s not durable after %s: it may be only in the RAM tier",
                        what, duration(time.monotonic() - t0))
        elif step is not None:
            log.warning("tierfs: ending on SIGTERM: step %d is on %s", step, self.store._ctx.ledger.holders(step))
        _end_as_sigterm()

    def _durable(self, bound: float) -> bool:
        """Wait up to ``bound`` seconds for the preemption save's commit and copies (for every save's
        background work when none was made); whether they are done."""
        deadline = time.monotonic() + bound
        if self._step is not None:
            # the uploads of older steps queued before it are given up: only this save is waited for
            self.store._ctx.work.give_up_below(self._step)
            ledger = self.store._ctx.ledger
            while ledger.busy(self._step):
                if time.monotonic() >= deadline:
                    return False
                time.sleep(_POLL)
            return True
        waiting = threading.Thread(target=self._drain, name="tierfs-sigterm-drain", daemon=True)
        waiting.start()
        waiting.join(bound)
        return not waiting.is_alive()

    def _drain(self) -> None:
        try:
            self.store.wait_until_finished()
        except Exception as e:  # noqa: BLE001 - the process ends anyway: say what failed
            log.warning("tierfs: ending on SIGTERM: background work failed (%s)", e)

    def _expire(self) -> None:
        """The watcher: when the grace period is over and the loop did not hear of it, end the process once the
        preemption save is durable, between two of the manager's calls (so that no collective of this rank's
        is cut short; a loop saving on ends at that save instead, on every rank alike)."""
        assert self._start is not None
        if self._heard.wait(max(0.0, self._start + self.grace - time.monotonic())):
            return
        t0 = time.monotonic()
        bound = self.store.exit_timeout
        self._durable(bound)
        calls = self.store._calls.lock
        left = bound - (time.monotonic() - t0)
        held = calls.acquire(timeout=left) if left > 0 else calls.acquire(blocking=False)
        if self._heard.is_set():
            if held:
                calls.release()
            return
        self.end(f"{duration(self.grace)} ago and the training loop did not stop (it never called "
                 "reached_preemption, and made no save call since)")


def _end_as_sigterm() -> NoReturn:
    """End the process as an unhandled SIGTERM does (status -15, no exit handlers), from any thread: the C
    disposition goes back to the default (Python's ``signal.signal`` works only on the main thread, which may
    be inside a long call), then the signal is sent again."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.signal.restype = ctypes.c_void_p
        libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
        libc.signal(int(signal.SIGTERM), None)  # SIG_DFL
        os.kill(os.getpid(), signal.SIGTERM)
    finally:  # a libc without signal(): the exit status a shell gives a process SIGTERM ended
        os._exit(128 + int(signal.SIGTERM))
