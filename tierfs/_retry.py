"""Retry with backoff: the one policy for requests to remote storage (the object tier and the fsspec drain).

A request that fails with an error retrying cannot fix (:data:`PERMANENT`: a missing file, no permission,
a bad argument) is raised at once; any other error counts as transient (a connection reset, a timeout, a
5xx) and the request is tried again after 0.2 s, 0.4 s, 0.8 s, ... until ``attempts`` are used up.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, TypeVar

log = logging.getLogger("tierfs")
T = TypeVar("T")

#: errors that retrying cannot fix
PERMANENT: tuple[type[BaseException], ...] = (
    FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, FileExistsError, ValueError,
    TypeError)
#: seconds before the first retry; each further one waits twice as long
BASE_DELAY = 0.2


def retry(fn: Callable[[], T], *, attempts: int, what: str, label: str,
          sleep: Callable[[float], None] = time.sleep) -> T:
    """``fn()``, tried up to ``attempts`` times while it fails with a transient error.

    Parameters
    ----------
    fn
        The request.
    attempts
        Tries in all (at least 1).
    what, label
        For the log line of each retry: ``"<label>: <what> failed (<reason>); retry k/n in <d>s"``.
    sleep
        Waits between tries (tests pass a fake).
    """
    attempts = max(1, int(attempts))
    for attempt in range(attempts):
        try:
            return fn()
        except PERMANENT:
            raise
        except Exception as e:  # noqa: BLE001 - transient until proven otherwise
            if attempt + 1 == attempts:
                raise
            delay = BASE_DELAY * 2**attempt
            log.warning("%s: %s failed (%s); retry %d/%d in %.1fs", label, what, short(e), attempt + 1,
                        attempts - 1, delay)
            sleep(delay)
    raise AssertionError("unreachable")


def short(e: BaseException, *, with_type: bool = False) -> str:
    """An exception as one short line: its message's first line (``Type: line`` with ``with_type``)."""
    text = str(e).strip()
    line = text.splitlines()[0] if text else ""
    if with_type:
        return f"{type(e).__name__}: {line}"[:240]
    return (line or type(e).__name__)[:200]
