"""SIGTERM for a :class:`~tierfs.CheckpointManager`: one save to the preemption tiers, then a bounded exit.

A scheduler that preempts a job sends SIGTERM, then SIGKILL a grace period later (Kubernetes' and SLURM's
default: 30 s). With ``handle_sigterm=True`` the manager takes the signal:

- the next ``save`` goes to the tiers whose save policy includes ``PreemptionCheckpointingPolicy`` (to every
  tier if none does), once; later saves follow the tiers' usual policies;
- ``reached_preemption(step)`` turns True (on every rank once any rank got the signal), so the loop can stop;
- a loop that does not hear of it (it never calls ``reached_preemption``) within ``sigterm_grace`` seconds
  is not left running: once the preemption save (and every other save's background work) is durable,
  within the store's ``exit_timeout``, the process ends as an unhandled SIGTERM would (exit status -15,
  no exit handlers).
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import threading
import time
from typing import Any

from ..util.readable import duration
from ..store import TieredStore

log = logging.getLogger("tierfs")

#: seconds a loop has, after SIGTERM, to hear of it (``reached_preemption``) before the process ends
DEFAULT_SIGTERM_GRACE = 30.0


class Preemption:
    """The SIGTERM state of one manager over ``store``; ``grace``: seconds for the loop to hear of it."""

    def __init__(self, store: TieredStore, grace: float) -> None:
        self.store, self.grace = store, grace
        self._signalled = threading.Event()
        self._heard = threading.Event()  # the loop heard of it (reached_preemption), or the manager closed
        self._saved = False  # the one save to the preemption tiers was made
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
        log.warning("SIGTERM received: the next save goes to the preemption tiers and reached_preemption(step) is "
                    "True; a loop that does not ask within %s is ended once its saves are durable",
                    duration(self.grace))
        self._signalled.set()
        if self._watch is None:
            self._watch = threading.Thread(target=self._expire, name="tierfs-sigterm", daemon=True)
            self._watch.start()

    def _expire(self) -> None:
        """After ``grace`` seconds unheard: wait for the saves to be durable, then end as SIGTERM would."""
        if self._heard.wait(self.grace):
            return
        bound = self.store.exit_timeout
        log.warning("SIGTERM %s ago and the training loop did not stop (it never called reached_preemption): "
                    "ending the process once the saves are durable (at most %s)", duration(self.grace),
                    duration(bound))
        t0 = time.monotonic()
        waiting = threading.Thread(target=self._drain, name="tierfs-sigterm-drain", daemon=True)
        waiting.start()
        waiting.join(bound)
        if waiting.is_alive():
            log.warning("tierfs: ending on SIGTERM with background work unfinished after %s: the newest steps may "
                        "be only in the RAM tier", duration(time.monotonic() - t0))
        _end_as_sigterm()

    def _drain(self) -> None:
        try:
            self.store.wait_until_finished()
        except Exception as e:  # noqa: BLE001 - the process ends anyway: say what failed
            log.warning("tierfs: ending on SIGTERM: background work failed (%s)", e)

    # -- what the manager asks --------------------------------------------------------------------------
    @property
    def signalled(self) -> bool:
        """Whether this process got SIGTERM (or heard that another rank did)."""
        return self._signalled.is_set()

    def pending(self) -> bool:
        """Whether the next save goes to the preemption tiers: signalled, and that save not yet made."""
        return self._signalled.is_set() and not self._saved

    def saved(self) -> None:
        """The save to the preemption tiers was made: later saves follow the usual policies."""
        self._saved = True

    def heard(self) -> None:
        """The loop knows (``reached_preemption`` said True): it stops by itself, no exit is forced."""
        self._signalled.set()
        self._heard.set()


def _end_as_sigterm() -> None:
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
