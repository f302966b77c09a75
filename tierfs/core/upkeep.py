"""The part of :class:`~tierfs.TieredStore`'s interface that looks after its background work and its steps'
retention: waiting for the commits and copies (a save's from GPU memory too), raising their failures,
applying the keep policies now, deleting a step."""

from __future__ import annotations

import logging
from typing import Sequence

from ..util import args as _args
from .calls import Calls, serial
from ..device.copies import Copies
from .context import Context
from .retention import Retention
from .saving import SavePath
from ..errors import TierfsError

log = logging.getLogger("tierfs")


class Upkeep:
    """Background work and retention (a base of :class:`~tierfs.TieredStore`). Waiting for background work
    and raising its failures take no lock: any thread may, while another calls the store."""

    _ctx: Context
    _retention: Retention
    _calls: Calls
    _saving: SavePath

    # -- background ---------------------------------------------------------------------------------
    def raise_background_errors(self) -> None:
        """Raise the first error background work hit since the last call, if any."""
        self._ctx.work.raise_errors()

    def wait_until_committed(self) -> None:
        """Block until every save so far is committed in the first tier (copies may still run)."""
        self._ctx.work.commits.join()

    def wait_until_finished(self) -> None:
        """Block until every background commit, copy and deletion is done; raise the first failure."""
        self._ctx.work.finish()

    @property
    def copies(self) -> Copies | None:
        """The newest save's copies from GPU memory (and an overlapped save's), or None when that save left
        none to tierfs's copy thread: ``wait()`` returns once they are complete (raising
        :class:`~tierfs.errors.DeviceError` if one failed), ``done()`` says whether they are."""
        copies: Copies | None = self._saving.copies
        return copies

    # -- retention ----------------------------------------------------------------------------------
    @serial
    def retention_plan(self) -> dict[str, list[int]]:
        """``{tier: [steps its keep policy would delete now]}``, deleting nothing: a step is kept when the
        tier's policy keeps it, when it is being read or copied, or when it is the only copy of the newest
        step. Steps this process did not save get their time and metrics from their marker and manifest."""
        self.wait_until_finished()
        return self._retention.plan()

    @serial
    def apply_retention(self) -> dict[str, list[int]]:
        """Apply every tier's keep policy now (see :meth:`retention_plan`); returns the steps deleted."""
        doomed = self.retention_plan()
        for tier in self._ctx.tiers:
            for s in doomed[tier.name]:
                log.info("tier %s: retention deletes step %d", tier.name, s)
                self._retention.delete(tier, s)
        return doomed

    def in_progress(self, step: int) -> bool:
        """Whether a save of ``step``, or a copy of it to a slower tier, is still under way."""
        return self._ctx.ledger.busy(_args.step(step))

    @serial
    def delete(self, step: int, tiers: Sequence[str] | None = None, *, wait: bool = True) -> None:
        """Delete ``step`` from the named tiers (default: all), once all background work is done; with
        ``wait=False`` at once, without waiting for other steps' work (``step`` itself must not be
        :meth:`in_progress`)."""
        step, tiers = _args.step(step), _args.names(tiers, "tiers", self._ctx.names)
        if not _args.flag(wait, "wait"):
            if self._ctx.ledger.busy(step):
                raise TierfsError(f"step {step} is still being saved or copied; delete it once "
                                  "in_progress(step) is False, or with wait=True")
        else:
            self.wait_until_finished()
        for t in self._ctx.tiers:
            if tiers is None or t.name in tiers:
                self._retention.delete(t, step)
        if tiers is None:
            self._calls.forget(step)  # gone: a save below it removes nothing
