"""Retry with backoff: the one policy for requests to remote storage (the object tier and the fsspec drain).

A request that fails with an error retrying cannot fix (:data:`PERMANENT`: a missing file, no permission,
a bad argument) is raised at once. A store that says it is overloaded (:func:`throttled`: S3's 503
SlowDown, GCS's 429 and 503) is waited out: the request is tried again after a jittered, exponentially
growing wait (at most :data:`MAX_DELAY`), for as long as the store keeps saying so, up to ``patience``
seconds; those tries do not count against ``attempts``, so throttling makes a transfer late, never
failed. Any other error counts as transient (a connection reset, a timeout, a 500) and the request is
tried again after 0.2 s, 0.4 s, 0.8 s, ... until ``attempts`` are used up.
"""

from __future__ import annotations

import logging
import random
import time
from typing import Callable, TypeVar

from .. import metrics as _metrics
from ..errors import TierUnavailableError

log = logging.getLogger("tierfs")
T = TypeVar("T")

#: errors that retrying cannot fix
PERMANENT: tuple[type[BaseException], ...] = (
    FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, FileExistsError, ValueError,
    TypeError)
#: seconds before the first retry; each further one waits twice as long
BASE_DELAY = 0.2
#: the longest wait between two tries of a throttled request (each wait is drawn from 0 to its bound)
MAX_DELAY = 20.0
#: seconds a request keeps being retried while the store says it is overloaded
PATIENCE = 1800.0
#: what S3, GCS and their clients say when a request is refused for the rate (codes and messages)
THROTTLE_WORDS = ("slowdown", "slow down", "reduce your request rate", "toomanyrequests", "too many requests",
                  "ratelimitexceeded", "rate limit", "throttl", "requestlimitexceeded")
THROTTLE_STATUS = (429, 503)


class Throttled(TierUnavailableError):
    """A request the store kept refusing for the rate for longer than the caller's patience."""


def throttled(e: BaseException) -> bool:
    """Whether ``e`` (or an error it was raised from) is the store refusing a request for the rate."""
    seen: set[int] = set()
    x: BaseException | None = e
    while x is not None and id(x) not in seen:
        seen.add(id(x))
        if isinstance(x, Throttled):
            return False  # patience ran out: no longer waited out
        for attr in ("code", "status", "status_code"):
            if getattr(x, attr, None) in THROTTLE_STATUS:
                return True
        response = getattr(x, "response", None)  # botocore's ClientError
        if isinstance(response, dict):
            meta, err = response.get("ResponseMetadata") or {}, response.get("Error") or {}
            if meta.get("HTTPStatusCode") in THROTTLE_STATUS or str(err.get("Code", "")) in ("503", "429"):
                return True
        text = str(x).lower()
        if any(w in text for w in THROTTLE_WORDS):
            return True
        x = x.__cause__ or x.__context__
    return False


def retry(fn: Callable[[], T], *, attempts: int, what: str, label: str,
          sleep: Callable[[float], None] = time.sleep, patience: float = PATIENCE,
          clock: Callable[[], float] = time.monotonic) -> T:
    """``fn()``, tried again while it fails with a transient error (see the module docstring).

    Parameters
    ----------
    fn
        The request.
    attempts
        Tries in all (at least 1) for errors that are neither permanent nor throttling.
    what, label
        For the log line of each retry: ``"<label>: <what> failed (<reason>); retry k/n in <d>s"``.
    sleep, clock
        Waits between tries, and the time (tests pass fakes).
    patience
        Seconds a throttled request is waited out; past them it raises :class:`Throttled`.
    """
    attempts = max(1, int(attempts))
    failed, slowed, since = 0, 0, None
    while True:
        try:
            return fn()
        except PERMANENT:
            raise
        except Exception as e:  # noqa: BLE001 - transient until proven otherwise
            if throttled(e):
                _metrics.SINK.request_fault(label.removeprefix("tier "), "throttled")
                since = clock() if since is None else since
                waited = clock() - since
                if waited >= patience:
                    raise Throttled(f"{label}: {what}: the store refused it for the request rate for {waited:.0f} s "
                                    f"({short(e)}); lower the job's request rate (ObjectTier requests_per_second) "
                                    "or ask the provider for more") from e
                delay = random.uniform(0.0, min(MAX_DELAY, BASE_DELAY * 2 ** min(slowed, 16)))
                slowed += 1
                if slowed in (1, 4) or slowed % 16 == 0:  # a few lines, not one per try
                    log.warning("%s: %s throttled by the store (%s), try %d; waiting it out (its copy lags; "
                                "nothing is lost)", label, what, short(e), slowed)
                sleep(min(delay, max(0.0, patience - waited)))
                continue
            failed += 1
            _metrics.SINK.request_fault(label.removeprefix("tier "), "transient")
            if failed >= attempts:
                raise
            delay = BASE_DELAY * 2 ** (failed - 1)
            log.warning("%s: %s failed (%s); retry %d/%d in %.1fs", label, what, short(e), failed,
                        attempts - 1, delay)
            sleep(delay)


def short(e: BaseException, *, with_type: bool = False) -> str:
    """An exception as one short line: its message's first line (``Type: line`` with ``with_type``)."""
    text = str(e).strip()
    line = text.splitlines()[0] if text else ""
    if with_type:
        return f"{type(e).__name__}: {line}"[:240]
    return (line or type(e).__name__)[:200]


def renamed(e: BaseException, message: str) -> BaseException:
    """An exception of ``e``'s type saying ``message`` (``e`` itself when its type needs other arguments)."""
    try:
        named = type(e)(message)
    except Exception:  # noqa: BLE001 - a type built otherwise: the original says less, but says it
        return e
    return named if str(named) == message else e
