"""Background work finished when the interpreter exits: a store's commits and copies, ``tiered::`` uploads.

A :class:`~tierfs.TieredStore` (so a ``CheckpointManager`` too) and each drain of the ``tiered::``
filesystem register here, by weak reference: registering keeps nothing alive. When the interpreter exits,
the work each one still has (commits, copies to slower tiers, uploads to the target) is finished within its
``exit_timeout`` (default :data:`DEFAULT_EXIT_TIMEOUT` seconds, or ``TIERFS_EXIT_TIMEOUT`` from the
environment; ``0`` finishes nothing). Past a second of waiting, a line every few seconds (logger
``tierfs``, WARNING) says what is left. Past the bound, or when the work fails, one warning line says what
is not durable and where it is; never a traceback, never a wait past the bound. A store whose work
finished is then closed; a store closed before is not touched again.

Ctrl-C while the exit waits: the first press (unless the program itself ended by Ctrl-C, which counts
as the first) says what is still being finished and goes on; the next one stops waiting at once: one line
per object says what is not durable and where it is, and the process ends as a Ctrl-C ends it (killed by
SIGINT, status 130 in a shell), without running the rest of the exit (which could wait again, on a thread
pool's transfer). :func:`wait_for` is the same wait for a call such as ``TieredStore.close()``.

Exit status: work that failed at exit, or was cut short by the bound, makes the process exit with
status 1 (after every exit handler registered since tierfs was imported has run), so that a job whose
last checkpoint or upload is not durable does not look successful; ``exit_timeout=0`` (finish nothing
at exit, on purpose) leaves the status alone. A program that ended by Ctrl-C still ends by SIGINT
(:mod:`tierfs.util.exitstatus`).

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
import logging
import os
import signal
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from .args import DEFAULT_EXIT_TIMEOUT, EXIT_TIMEOUT_ENV as ENV, exit_seconds, shown_seconds  # noqa: F401
from .exitstatus import die_by_sigint, fail, main_interrupted
from .retry import short

log = logging.getLogger("tierfs")

#: seconds of waiting before the first progress line, and between two of them
PROGRESS_AFTER, PROGRESS_EVERY = 1.0, 5.0
#: longest single wait on one piece of work while several are waited for
_SLICE = 0.25


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
_presses = 0  # Ctrl-C pressed while the exit waited


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
    global _start
    jobs: list[_Job] = []
    try:
        if _start is None:
            _start = time.monotonic()
        jobs = _jobs(_start)
        _finish(jobs, final)
        for j in jobs if final else []:
            if j.obj not in _settled:
                _settled.add(j.obj)
                try:  # a failure that no call raised (the last save's copy failed before the exit)
                    j.work.wait(0.0)
                except Exception as e:  # noqa: BLE001 - one line; the object still closes
                    _report(j, short(e))
                try:
                    j.work.close()
                except Exception as e:  # noqa: BLE001 - one line; the others still close
                    log.warning("tierfs: at exit, closing %r failed (%s)", j.obj, short(e, with_type=True))
    except KeyboardInterrupt:  # (also a second Ctrl-C while the first one's lines were being written)
        _stop(jobs)
    except BaseException as e:  # noqa: BLE001 - at exit: one line, never a traceback
        fail()
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
    global _interrupted, _presses
    waiting: list[_Job] = []
    for j in jobs:
        if j.work.pending() is None:
            continue
        if _interrupted:
            _lose(j, "exit interrupted")
        elif j.timeout <= 0:
            if final:  # the first pass leaves it: the non-daemon threads may add to it still
                _lose(j, "exit_timeout is 0 (nothing is finished at exit)", failed=False)
        elif time.monotonic() >= j.deadline:
            _lose(j, f"exit_timeout ({shown_seconds(j.timeout)}) passed")
        else:
            waiting.append(j)
    started = time.monotonic()
    report = started + PROGRESS_AFTER
    while waiting:
        try:
            now = time.monotonic()
            if now >= report:
                for j in waiting:
                    left = j.work.pending()
                    if left is not None:
                        log.warning("tierfs: finishing at exit: %s; waiting up to %s more (exit_timeout; %s)", left,
                                    shown_seconds(round(max(0.0, j.deadline - now), 1)), _stops(_presses))
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
                except KeyboardInterrupt:
                    raise
                except Exception as e:  # noqa: BLE001 - the work failed: reported in one line
                    waiting.remove(j)
                    _lose(j, short(e))
                    continue
                if done:
                    waiting.remove(j)
        except KeyboardInterrupt:
            _presses += 1
            if _presses + main_interrupted() < 2:  # the first Ctrl-C: say what is left, go on
                for j in waiting:
                    left = j.work.pending()
                    if left is not None:
                        log.warning("tierfs: Ctrl-C: still finishing at exit: %s; press Ctrl-C again to stop "
                                    "waiting and leave it unfinished", left)
                continue
            _stop(waiting)


def _stop(jobs: list[_Job]) -> None:
    """Ctrl-C ends the exit's waits: one line for each job left unfinished, then the process ends by SIGINT."""
    global _interrupted
    _interrupted = True
    try:  # no further Ctrl-C cuts the lines short
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:  # not the main thread
        pass
    fail()
    said = False
    for j in jobs:
        try:
            if j.obj not in _settled and j.work.pending() is not None:
                _lose(j, "exit interrupted by Ctrl-C")
                said = True
        except Exception as e:  # noqa: BLE001 - the others are still said
            log.warning("tierfs: at exit, cannot look at %r (%s)", j.obj, short(e, with_type=True))
    if not said:
        log.warning("tierfs: exit interrupted by Ctrl-C; background work may be left unfinished (its data stays "
                    "where it is)")
    die_by_sigint()


def _stops(presses: int, already: int | None = None) -> str:
    """How to stop a wait: ``"Ctrl-C stops waiting"``, or twice when nothing was pressed yet."""
    pressed = presses + (main_interrupted() if already is None else already)
    return "Ctrl-C stops waiting" if pressed else "Ctrl-C twice stops waiting"


def _lose(job: _Job, reason: str, failed: bool = True) -> None:
    """Report ``job``'s work as unfinished, once (``failed``: the process will exit with status 1)."""
    if job.obj in _settled:
        return
    _settled.add(job.obj)
    _report(job, reason, failed)


def _report(job: _Job, reason: str, failed: bool = True) -> None:
    """The one warning line of ``job``'s work left unfinished or failed for ``reason``."""
    if failed:
        fail()
    try:
        line = job.work.lost(reason)
    except Exception as e:  # noqa: BLE001 - the reason alone, still one line
        line = f"tierfs: at exit, {reason}; background work of {job.obj!r} is unfinished ({short(e)})"
    log.warning("%s", line)


def wait_for(work: Work, what: str) -> None:
    """Wait until ``work`` is done, saying what it waits for: the wait of a call such as
    ``TieredStore.close()``, as the exit waits (see the module docstring), without a bound.

    Past :data:`PROGRESS_AFTER` seconds, and every :data:`PROGRESS_EVERY` seconds after, one line (logger
    ``tierfs``, WARNING): ``tierfs: <what>: waiting for <work.pending()> (<t> so far; Ctrl-C ...)``.

    Ctrl-C: the first press says what it still waits for and goes on waiting, then raises
    KeyboardInterrupt once the work is done (the program stops, as asked, with its data durable). The next
    press (the first, when the caller is already handling a KeyboardInterrupt: ``close()`` from a ``with``
    block that Ctrl-C ended) stops waiting at once: one line (``work.lost``) says what is not durable and
    where it is, and KeyboardInterrupt is raised from here (no frames of threading's waits).

    Parameters
    ----------
    work : Work
        What is left to do; its ``wait`` raises a failure of the work (a failed copy), which is raised
        from here as it is.
    what : str
        What the caller is doing, for the lines: ``"closing the store"``.

    Raises
    ------
    KeyboardInterrupt
        Ctrl-C (see above).
    """
    already = int(isinstance(sys.exc_info()[1], KeyboardInterrupt))
    presses = 0
    start = time.monotonic()
    report = start + PROGRESS_AFTER
    while True:
        try:
            try:
                if work.wait(max(0.0, min(report - time.monotonic(), PROGRESS_EVERY))):
                    break
                now = time.monotonic()
                if now >= report:
                    left = work.pending()
                    if left is not None:
                        log.warning("tierfs: %s: waiting for %s (%s so far; %s)", what, left,
                                    shown_seconds(round(now - start)), _stops(presses, already))
                    report = now + PROGRESS_EVERY
                continue
            except KeyboardInterrupt:
                presses += 1
                if presses + already < 2:  # the first: say what is left, go on
                    left = work.pending()
                    if left is not None:
                        log.warning("tierfs: %s: Ctrl-C: still waiting for %s; press Ctrl-C again to stop waiting "
                                    "and leave it unfinished", what, left)
                    continue
        except KeyboardInterrupt:  # pressed again while the first press was answered
            presses += 1
        _give_up(work, what)
        raise KeyboardInterrupt from None
    if presses:
        raise KeyboardInterrupt  # asked for while the work finished: it is done now


def _give_up(work: Work, what: str) -> None:
    """The one line of :func:`wait_for` stopped by Ctrl-C (a further Ctrl-C meanwhile is ignored)."""
    try:
        previous: Any = signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:  # not the main thread: no Ctrl-C arrives here
        previous = None
    try:
        line = work.lost("interrupted by Ctrl-C")
        prefix = "tierfs: at exit, "
        log.warning("%s", f"tierfs: {what}, {line[len(prefix):]}" if line.startswith(prefix) else line)
    except Exception as e:  # noqa: BLE001 - still one line
        log.warning("tierfs: %s, interrupted by Ctrl-C: background work is unfinished (%s)", what, short(e))
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
