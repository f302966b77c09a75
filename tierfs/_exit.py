"""Background work finished when the interpreter exits: a store's commits and copies, ``tiered::`` uploads.

A :class:`~tierfs.TieredStore` (so a ``CheckpointManager`` too) and each drain of the ``tiered::``
filesystem register here, by weak reference: registering keeps nothing alive. When the interpreter exits,
the work each one still has (commits, copies to slower tiers, uploads to the target) is finished within its
``exit_timeout`` (default :data:`DEFAULT_EXIT_TIMEOUT` seconds, or ``TIERFS_EXIT_TIMEOUT`` from the
environment; ``0`` finishes nothing). Past a second of waiting, a line every few seconds (logger
``tierfs``, WARNING) says what is left. Past the bound, or when the work fails, one warning line says what
is not durable and where it is; never a traceback, never a wait past the bound. A store whose work
finished is then closed; a store closed before is not touched again.

The order matters. tierfs's background threads are daemon threads: the interpreter does not wait for
them, and stops them once its exit handlers have run. The work is finished in two passes:

1. among ``threading``'s exit hooks, which run before the interpreter waits for the non-daemon threads
   and before :mod:`concurrent.futures` stops its thread pools (after that, a thread pool refuses work:
   an S3 client's host name lookups fail);
2. in an :mod:`atexit` handler, once the non-daemon threads have ended: what they added since is finished
   too (best effort: a client that needs a thread pool then fails, and is reported), then finished stores
   close.

No thread is started at exit (Python 3.12 refuses new threads in exit handlers): each wait polls the work.
"""

from __future__ import annotations

import atexit
import concurrent.futures.thread  # noqa: F401 - its exit hook is registered first, so it runs after ours
import datetime
import logging
import math
import os
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from . import _args
from ._retry import short
from .errors import ArgumentError

log = logging.getLogger("tierfs")

#: seconds the work pending at exit may take, when neither the object's ``exit_timeout`` nor the
#: environment variable :data:`ENV` says otherwise
DEFAULT_EXIT_TIMEOUT = 600.0
#: the environment variable giving the default ``exit_timeout`` in seconds (``0``: finish nothing at exit)
ENV = "TIERFS_EXIT_TIMEOUT"
#: seconds of waiting before the first progress line, and between two of them
PROGRESS_AFTER, PROGRESS_EVERY = 1.0, 5.0
#: longest single wait on one piece of work while several are waited for
_SLICE = 0.25


def exit_seconds(value: Any, what: str = "exit_timeout") -> float:
    """An ``exit_timeout`` in seconds, checked.

    Parameters
    ----------
    value : float, datetime.timedelta, str or None
        Seconds (``>= 0``; ``0``: finish nothing at exit), a ``timedelta``, a number as a string (fsspec's
        configuration), or None (or ``""``/``"none"``): ``TIERFS_EXIT_TIMEOUT`` from the environment,
        else :data:`DEFAULT_EXIT_TIMEOUT`.
    what : str
        How messages name the option.

    Returns
    -------
    float
        The bound in seconds.

    Raises
    ------
    ArgumentError
        ``value`` (or the environment variable) is not a finite number of seconds ``>= 0``.
    """
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "none")):
        env = os.environ.get(ENV, "").strip()
        if not env:
            return DEFAULT_EXIT_TIMEOUT
        value, what = env, f"{ENV} (environment)"
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise ArgumentError(f"{what} must be seconds >= 0 (0: finish nothing at exit), got {value!r}") from None
    if isinstance(value, datetime.timedelta):
        value = value.total_seconds()
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
        raise ArgumentError(f"{what} must be seconds >= 0 or a timedelta (0: finish nothing at exit), got "
                            f"{_args.shown(value)}")
    return float(value)


def shown_seconds(t: float) -> str:
    """``t`` seconds for messages: ``"2 s"``, ``"0.5 s"``."""
    return f"{t:g} s"


class Work(Protocol):
    """What one registered object has left to do at exit (made by its factory, once per pass)."""

    def pending(self) -> str | None:
        """What is not finished yet, for a progress line (e.g. ``"3 file(s) (12.0 MB) ... to s3://b/run"``);
        None once everything is done."""

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds; True once everything is done. Raises (one line) if some of it
        cannot be done (an upload failed)."""

    def lost(self, reason: str) -> str:
        """The one warning line when the work stops unfinished for ``reason``: what is not durable, where
        it is."""

    def close(self) -> None:
        """Release the object once its work is done (the final pass)."""


@dataclass
class _Entry:
    pid: int  # a forked child inherits the registry, not the threads: only the registering process acts
    timeout: float
    work: Callable[[Any], "Work | None"]


@dataclass
class _Job:
    obj: Any
    work: Work
    timeout: float
    deadline: float


_registry: "weakref.WeakKeyDictionary[Any, _Entry]" = weakref.WeakKeyDictionary()
_settled: "weakref.WeakSet[Any]" = weakref.WeakSet()  # reported unfinished, or closed: not touched again
_lock = threading.Lock()
_installed = False
_start: float | None = None  # when the first pass began: every bound counts from there
_interrupted = False


def register(obj: Any, timeout: float, work: Callable[[Any], "Work | None"]) -> None:
    """Finish ``obj``'s pending work at exit within ``timeout`` seconds (0: only say what is left).

    ``work(obj)`` is called at exit, once per pass, and returns the :class:`Work` (None: nothing to do).
    It must not hold ``obj`` itself: only ``obj`` is held, weakly.
    """
    global _installed
    with _lock:
        if not _installed:
            _installed = True
            hook = getattr(threading, "_register_atexit", None)
            if hook is not None:
                try:
                    hook(_first_pass)
                except RuntimeError:  # the interpreter is exiting already: the atexit pass alone
                    pass
            atexit.register(_final_pass)
        _registry[obj] = _Entry(os.getpid(), timeout, work)


def unregister(obj: Any) -> None:
    """``obj`` was closed: nothing of it is left to finish at exit."""
    with _lock:
        _registry.pop(obj, None)


def _first_pass() -> None:
    _run(final=False)


def _final_pass() -> None:
    _run(final=True)


def _run(final: bool) -> None:
    """One pass (see the module docstring); any error is one warning line, never a traceback."""
    global _start, _interrupted
    try:
        if _start is None:
            _start = time.monotonic()
        jobs = _jobs(_start)
        _finish(jobs, final)
        for j in jobs if final else []:
            if j.obj not in _settled:
                _settled.add(j.obj)
                try:
                    j.work.close()
                except Exception as e:  # noqa: BLE001 - one line; the others still close
                    log.warning("tierfs: at exit, closing %r failed (%s)", j.obj, short(e, with_type=True))
    except KeyboardInterrupt:
        _interrupted = True
        log.warning("tierfs: exit interrupted; background work left unfinished (its data stays where it is)")
    except BaseException as e:  # noqa: BLE001 - at exit: one line, never a traceback
        log.warning("tierfs: finishing background work at exit failed (%s)", short(e, with_type=True))


def _jobs(start: float) -> list[_Job]:
    """This process's registered objects that are still open, with their work."""
    with _lock:
        entries = [(o, e) for o, e in _registry.items() if e.pid == os.getpid() and o not in _settled]
    jobs = []
    for obj, e in entries:
        try:
            work = e.work(obj)
        except Exception as exc:  # noqa: BLE001 - reported, the others still finish
            log.warning("tierfs: at exit, cannot look at %r (%s)", obj, short(exc, with_type=True))
            continue
        if work is not None:
            jobs.append(_Job(obj, work, e.timeout, start + e.timeout))
    return jobs


def _finish(jobs: list[_Job], final: bool) -> None:
    """Wait for the jobs with pending work, each until its deadline; report each that stops unfinished."""
    global _interrupted
    waiting: list[_Job] = []
    for j in jobs:
        if j.work.pending() is None:
            continue
        if _interrupted:
            _lose(j, "exit interrupted")
        elif j.timeout <= 0:
            if final:  # the first pass leaves it: the non-daemon threads may add to it still
                _lose(j, "exit_timeout is 0 (nothing is finished at exit)")
        elif time.monotonic() >= j.deadline:
            _lose(j, f"exit_timeout ({shown_seconds(j.timeout)}) passed")
        else:
            waiting.append(j)
    started = time.monotonic()
    report = started + PROGRESS_AFTER
    try:
        while waiting:
            now = time.monotonic()
            if now >= report:
                for j in waiting:
                    left = j.work.pending()
                    if left is not None:
                        log.warning("tierfs: finishing at exit: %s; waiting up to %s more (exit_timeout)",
                                    left, shown_seconds(round(max(0.0, j.deadline - now), 1)))
                report = now + PROGRESS_EVERY
            for j in list(waiting):
                if time.monotonic() >= j.deadline:
                    waiting.remove(j)
                    _lose(j, f"exit_timeout ({shown_seconds(j.timeout)}) passed")
                    continue
                wait = min(j.deadline, report) - time.monotonic()
                if len(waiting) > 1:
                    wait = min(wait, _SLICE)
                try:
                    done = j.work.wait(max(0.0, wait))
                except Exception as e:  # noqa: BLE001 - the work failed: reported in one line
                    waiting.remove(j)
                    _lose(j, short(e))
                    continue
                if done:
                    waiting.remove(j)
    except KeyboardInterrupt:
        _interrupted = True
        for j in waiting:
            _lose(j, "exit interrupted")


def _lose(job: _Job, reason: str) -> None:
    """Report ``job``'s work as unfinished, once."""
    if job.obj in _settled:
        return
    _settled.add(job.obj)
    try:
        line = job.work.lost(reason)
    except Exception as e:  # noqa: BLE001 - the reason alone, still one line
        line = f"tierfs: at exit, {reason}; background work of {job.obj!r} is unfinished ({short(e)})"
    log.warning("%s", line)
