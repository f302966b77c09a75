"""A rank's share of the job's request rate to an object store, which the object tier spends before every
request it makes (retries included).

Object stores serve a prefix at a limited rate (S3: about 3,500 writes and 5,500 reads per second per
prefix partition; GCS ramps up from about 1,000 writes per second) and answer beyond it with 503 SlowDown
or 429. A budget for the whole job, ``requests_per_second``, split evenly over its ranks, keeps every rank
within its share without talking to the others: the job as a whole never asks for more than the budget.
The pacing is the background throttle's (:class:`tierfs.util.worker.Throttle`), counting requests, not bytes.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Callable

from ..util.worker import Throttle


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


class JobBudget:
    """The job's ``per_second`` requests (None: no budget), this rank taking its share in bursts of up to a
    second's worth: sized on first use, once the job's size is known (``world``: given instead)."""

    def __init__(self, per_second: float | None, *, world: int | None = None,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> None:
        self.per_second, self.world = per_second, world
        self.share: Throttle | None = None
        self._clock, self._sleep = clock, sleep

    def take(self, n: int = 1) -> None:
        """Spend ``n`` requests of this rank's share; sleeps while they would go past it."""
        if self.per_second is None:
            return
        if self.share is None:
            rate = self.per_second / (self.world or job_size())
            self.share = Throttle(rate, max(1, int(rate)), clock=self._clock, sleep=self._sleep)
        self.share.consume(n)
