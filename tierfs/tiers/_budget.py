"""A rank's share of the job's request rate to an object store: a token bucket the object tier spends
before every request it makes (retries included).

Object stores serve a prefix at a limited rate (S3: about 3,500 writes and 5,500 reads per second per
prefix partition; GCS ramps up from about 1,000 writes per second) and answer beyond it with 503 SlowDown
or 429. A budget for the whole job, ``requests_per_second``, split evenly over its ranks, keeps every rank
within its share without talking to the others: the job as a whole never asks for more than the budget.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Callable


def job_size() -> int:
    """The processes of the job: torch.distributed's world when it is initialised (never imported here),
    else ``WORLD_SIZE``, else 1."""
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            return max(1, int(dist.get_world_size()))
    except (RuntimeError, ValueError):
        pass
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        return 1


class RequestBudget:
    """``per_second`` requests, at most ``burst`` at once after a pause (default: one second's worth).

    :meth:`take` reserves its requests and sleeps until they are due, so callers on several threads are
    served in the order they asked, and a call needing more than ``burst`` (a multipart upload) waits for
    its whole share instead of never getting it.
    """

    def __init__(self, per_second: float, burst: float | None = None, *,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> None:
        if not per_second > 0:
            raise ValueError(f"a request budget must be positive, got {per_second}")
        self.per_second = float(per_second)
        self.burst = max(1.0, float(burst) if burst is not None else self.per_second)
        self._clock, self._sleep = clock, sleep
        self._tokens, self._at = self.burst, clock()
        self._lock = threading.Lock()
        self.waited = 0.0  # seconds callers slept for the budget, in all (for the log and benchmarks)

    def take(self, n: int = 1) -> float:
        """Spend ``n`` requests; sleeps until they are within the budget. Returns the seconds slept."""
        with self._lock:
            now = self._clock()
            self._tokens = min(self.burst, self._tokens + (now - self._at) * self.per_second)
            self._at = now
            self._tokens -= n
            wait = -self._tokens / self.per_second if self._tokens < 0 else 0.0
            self.waited += wait
        if wait > 0:
            self._sleep(wait)
        return wait


class JobBudget:
    """The job's ``per_second`` requests (None: no budget), this rank taking its share: sized on first use,
    once the job's size is known (:func:`job_size`)."""

    def __init__(self, per_second: float | None) -> None:
        self.per_second = per_second
        self.share: RequestBudget | None = None

    def take(self, n: int = 1) -> float:
        if self.per_second is None:
            return 0.0
        if self.share is None:
            self.share = RequestBudget(self.per_second / job_size())
        return self.share.take(n)


def upload_requests(size: int, part: int) -> int:
    """Requests an upload of ``size`` bytes makes in parts of ``part``: one below two parts (s3fs puts such
    a file whole), else the parts plus two (a multipart upload's start and completion)."""
    return 1 if size < 2 * part else -(-size // part) + 2
