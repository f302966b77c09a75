"""The store's background work: its workers, their groups, the throttle, and what they failed at.

One worker commits saves in order (and keeps the first tier's buffers ready), one per slower tier copies
steps to it, one finishes the part of a restore that goes on after this rank returned. Each thread role
has a group of its own, so collectives from different threads never interleave. A failure is kept (in
the ledger, or for a restore's background part here) and raised by the store's next call
(:meth:`Background.raise_errors`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable

from ..util import hooks as _hooks
from ..util import stages as _stages
from ..util.worker import Throttle, Worker
from ..ranks import Group
from ..errors import BackgroundError, TierfsError
from .helper import Helper
from .ledger import StepLedger

log = logging.getLogger("tierfs")


class CopyGivenUp(TierfsError):
    """An upload stopped because the process ends once a later step is durable (a SIGTERM's)."""


@dataclass
class Background:
    """The workers of one store and their failures."""

    ledger: StepLedger
    throttle: Throttle
    commits: Worker  # commits and the first tier's upkeep, in order
    copies: dict[str, Worker]  # one per slower tier: a slow upload never holds back the replicas
    commit_group: Group  # the commit worker's collectives
    copy_groups: dict[str, Group]  # each slower file tier's copy worker's collectives
    helper: Helper | None = None  # the process this rank's uploads run in (TieredStore(helper=True))
    # the part of a restore that goes on after this rank returned (see core.restore.pipeline), its failures
    restores: Worker = field(init=False)
    restore_failures: list[BaseException] = field(init=False)
    #: uploads of steps below this one stop (:meth:`give_up_below`)
    given_up_below: int = field(init=False, default=-1)

    def __post_init__(self) -> None:
        self.restore_failures = []
        self.restores = Worker("tierfs-restore", self.restore_failures.append, nice=0)

    def pace(self, step: int, tier: str, stoppable: bool = False) -> Callable[[int], None]:
        """The throttle of a background copy of ``step`` to ``tier`` (with its test hook). A ``stoppable``
        copy (an upload, which every rank's agreement ends together) stops at its next chunk once the
        process gives up the copies of steps before a later one (:meth:`give_up_below`)."""
        def pace(nbytes: int) -> None:
            _hooks.at("transfer", step=step, tier=tier, nbytes=nbytes)
            if stoppable and step < self.given_up_below:
                raise CopyGivenUp(f"the copy of step {step} to {tier} was given up: the process ends once step "
                                  f"{self.given_up_below} is durable")
            self.throttle.consume(nbytes)
        return pace

    def give_up_below(self, step: int) -> None:
        """Stop the uploads of the steps before ``step``, at their next chunk, and skip those not started:
        the process is about to end (SIGTERM) once ``step`` is durable, and must not wait for older steps
        queued before it. Every rank's upload of such a step fails together (its agreement), so the ranks go
        on to the next copy alike; the steps stay in the first tier."""
        if step > self.given_up_below:
            self.given_up_below = step
            log.warning("tierfs: uploads of steps before %d not finished are given up: the process ends once step %d "
                        "is durable", step, step)

    def settle(self) -> None:
        """Wait for the rest of the last restore (if this rank returned before it finished); raise its
        failure here, on this rank alone (the other ranks raised theirs in the restore)."""
        self.restores.join()
        if self.restore_failures:
            failure = self.restore_failures.pop(0)
            self.restore_failures.clear()
            raise failure

    def raise_errors(self) -> None:
        """Raise the first failure of background work since the last call (a restore's first), if any, as
        a BackgroundError naming the stage, step and tier it failed in."""
        self.settle()
        errors = self.ledger.take_errors()
        if errors:
            first = errors[0]
            more = f" (and {len(errors) - 1} more, see the log)" if len(errors) > 1 else ""
            where = _stages.of(first)  # e.g. "copy of step 7 on s3": the step and the tier
            said = str(first) if isinstance(first, TierfsError) else f"{type(first).__name__}: {first}"
            where = f" ({where})" if where and where not in said else ""
            err = BackgroundError(f"background copy failed{where}: {said}{more}")
            err.tierfs_stage = _stages.of(first)  # type: ignore[attr-defined]
            raise err from first

    def join(self) -> None:
        """Wait until every background job submitted so far has run."""
        self.restores.join()  # first: it may submit copies (re-seeding peers)
        self.commits.join()
        for w in self.copies.values():
            w.join()
        self.commits.join()  # what the copies handed back to it (spare buffers made once a copy is done)

    def finish(self) -> None:
        """Wait until every background job is done; raise the first failure."""
        self.join()
        self.raise_errors()

    def workers(self) -> list[Worker]:
        return [self.restores, self.commits, *self.copies.values()]

    def close(self) -> None:
        self.restores.close()
        self.commits.close()
        for w in self.copies.values():
            w.close()
        if self.helper is not None:
            self.helper.close()
