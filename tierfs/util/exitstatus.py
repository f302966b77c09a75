"""The exit status of a process whose background work at exit failed or was cut short (see
:mod:`tierfs.util.exitwork`): status :data:`FAILED_STATUS` (1), or death by SIGINT when the program ended by Ctrl-C.

Its exit handler is registered when tierfs is imported (by :mod:`tierfs.util.exitwork`, before any handler of
its own), so it runs last, after every exit handler registered since.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import sys

log = logging.getLogger("tierfs")

_failed_pid: int | None = None  # the process whose work at exit failed or was cut short: it exits with 1
#: the exit status of a process whose work at exit failed or was cut short by its bound
FAILED_STATUS = 1


def main_interrupted() -> int:
    """1 when the program ended by an uncaught KeyboardInterrupt (its first Ctrl-C), else 0."""
    last = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    return int(isinstance(last, KeyboardInterrupt))


def fail() -> None:
    """This process's work at exit failed or was cut short: it exits with :data:`FAILED_STATUS`."""
    global _failed_pid
    _failed_pid = os.getpid()


def flush() -> None:
    """Write out what was logged and printed, before the process ends without the rest of its exit."""
    for h in [*logging.getLogger().handlers, *log.handlers, logging.lastResort]:
        try:
            if h is not None:
                h.flush()
        except Exception:  # noqa: BLE001 - a handler that cannot flush: nothing more to do
            pass
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except Exception:  # noqa: BLE001 - a closed stream
            pass


def die_by_sigint() -> None:
    """End the process now, as an uncaught Ctrl-C ends it (killed by SIGINT; status 130 where that fails)."""
    flush()
    try:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    except (OSError, ValueError):  # not the main thread, or no such signal here
        pass
    os._exit(130)


def _exit_status() -> None:
    """The last exit handler (registered when tierfs is imported): a process whose work at exit failed or
    was cut short exits with :data:`FAILED_STATUS` (or by SIGINT, when the program ended by Ctrl-C)."""
    if _failed_pid != os.getpid():
        return
    if main_interrupted():
        die_by_sigint()
    flush()
    os._exit(FAILED_STATUS)


atexit.register(_exit_status)
