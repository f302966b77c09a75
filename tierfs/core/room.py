"""When a save may go on: the in-flight bound, per tier, and waiting for RAM that copies still hold.

- **The in-flight bound** (``max_in_flight``) counts, for each tier, the steps it has still to get: the
  first tier's saves not yet committed, and each slower tier's steps queued or being copied. A save waits
  for the tiers it goes to (or, with ``when_busy="skip"``, leaves out the slow tiers at their bound), so a
  slow upload holds back only the next saves to the object store, never the RAM and peer saves between.
- **RAM held by copies.** A step being copied out of the first tier stays there until its copy ends. A
  save that finds the first tier full while such copies are on their way waits for one to end (and
  retention after it), then tries again; with none on its way the first tier's CapacityError stands.
"""

from __future__ import annotations

import logging
from typing import Callable, TypeVar

from ..errors import CapacityError
from ..tiers.base import AnyTier
from .ledger import StepLedger

log = logging.getLogger("tierfs")

T = TypeVar("T")


def make_room(ledger: StepLedger, first: AnyTier, step: int, chosen: list[AnyTier], max_in_flight: int,
              when_busy: str) -> list[AnyTier]:
    """Apply the in-flight bound to a save of ``step`` to the ``chosen`` tiers: wait, or skip the slow
    tiers at it. Returns the tiers the save goes to."""
    if when_busy == "skip":
        busy = [t.name for t in chosen if t is not first and ledger.on_the_way(t.name) >= max_in_flight]
        if busy:
            log.warning("step %d: %s still %d steps behind, skipping it there", step, busy, max_in_flight)
            chosen = [t for t in chosen if t.name not in busy]
    if chosen:
        ledger.wait_for_room(max_in_flight, [t.name for t in chosen if t is not first])
    return chosen


def when_released(ledger: StepLedger, first: AnyTier, step: int, take: Callable[[], T]) -> T:
    """``take()`` (the first tier's buffers for ``step``), again each time a copy out of the first tier
    ends while it raises CapacityError; the error once no copy is on its way."""
    while True:
        seen = ledger.releases
        try:
            return take()
        except CapacityError as e:
            log.info("step %d waits for a copy out of %s to end: %s", step, first.name, e)
            if not ledger.wait_for_release(seen):
                raise
