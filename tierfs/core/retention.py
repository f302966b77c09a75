"""Retention: which committed steps each tier deletes, and deleting them.

A step is kept when its tier's keep policy keeps it, when it is being read or copied (pinned), when it
is transient (staged in the first tier only to be copied on), or when it is the only copy of the newest
step any tier holds. The rules are :func:`doomed`, a pure function of a ledger snapshot; the store runs
them after every save on the tiers it touched, and ``tierfs gc`` on every tier at once.
"""

from __future__ import annotations

import logging
from typing import Callable, Mapping

from .._stages import stage
from ..errors import TierfsError
from ..policies import StepInfo
from ..tiers.base import AnyTier, Tier
from ..tiers.capabilities import SharedDirectory
from .ledger import Snapshot
from .context import Context
from .reads import Reader

log = logging.getLogger("tierfs")


def doomed(tier: AnyTier, snap: Snapshot, held: Mapping[str, set[int]] | None = None) -> list[int]:
    """The steps of ``tier`` that retention deletes, given what every tier holds (default: the snapshot's
    holdings): not kept by the tier's policy, not pinned, not transient, and not the only copy of the
    newest step."""
    held = snap.held if held is None else held
    committed = sorted(held[tier.name] - snap.transient)
    if not committed:
        return []
    keep = tier.keep_policy.keep([snap.info.get(s, StepInfo(s)) for s in committed])
    newest = max(max(h) for h in held.values() if h)
    return [s for s in committed if s not in keep and s not in snap.pinned[tier.name]
            and not (s == newest and not any(s in h for n, h in held.items() if n != tier.name))]


class Retention:
    """Applies the keep policies of a store's tiers."""

    def __init__(self, ctx: Context, reader: Reader) -> None:
        self.ctx, self.reader = ctx, reader

    def apply(self, tier: AnyTier, on_error: Callable[[BaseException], None] | None = None) -> None:
        """Delete what ``tier``'s keep policy lets go now; a failure is raised, or handed to ``on_error``."""
        try:
            for s in doomed(tier, self.ctx.ledger.snapshot()):
                log.debug("tier %s: retention deletes step %d", tier.name, s)
                self.delete(tier, s)
        except Exception as e:
            if on_error is None:
                raise
            log.error("tier %s: retention failed (%s); raised by the next call", tier.name, e)
            on_error(e)

    def pending(self, tier: AnyTier) -> bool:
        """Whether ``tier`` holds a step its keep policy lets go that is still being read or copied (its
        space comes free once that is done)."""
        snap = self.ctx.ledger.snapshot()
        committed = sorted(snap.held[tier.name] - snap.transient)
        keep = set(tier.keep_policy.keep([snap.info.get(s, StepInfo(s)) for s in committed])) if committed else set()
        return any(s not in keep and s in snap.pinned[tier.name] for s in committed)

    def plan(self) -> dict[str, list[int]]:
        """``{tier: [steps its keep policy would delete now]}``, deleting nothing, for every tier, as the
        deletions would go tier by tier. Steps this process did not save get their commit time and metrics
        from their marker and manifest first."""
        p = self.ctx
        p.refresh()
        for s in p.ledger.unknown_info():
            when, metrics = 0.0, {}
            try:
                when = float(self.reader.read_marker(s).committed or 0.0)
                metrics = dict(self.reader.read_manifest(s, p.group.rank)[0].metrics)
            except (TierfsError, OSError, ValueError, KeyError) as e:
                log.warning("step %d: no readable marker or manifest (%s); its time and metrics are unknown", s, e)
            p.ledger.learn(s, StepInfo(s, when, metrics))
        snap = p.ledger.snapshot()
        held = {n: set(h) for n, h in snap.held.items()}
        out: dict[str, list[int]] = {}
        for tier in p.tiers:
            out[tier.name] = doomed(tier, snap, held)
            held[tier.name] -= set(out[tier.name])
        return out

    def delete(self, tier: AnyTier, step: int) -> None:
        """Delete ``step`` from ``tier``, as this rank's part: ranks sharing a node's directory each take
        back their own files and the owner drops the marker; elsewhere the owner deletes the step."""
        p = self.ctx
        if not p.ledger.claim(tier.name, step):
            return
        with stage("retention", step, tier.name):
            self._delete(tier, step)

    def _delete(self, tier: AnyTier, step: int) -> None:
        p = self.ctx
        if tier is p.replicator:
            tier.delete_step(step)  # the copies this rank keeps
            return
        assert isinstance(tier, Tier)
        if isinstance(tier, SharedDirectory) and len(p.ranks.sharing(tier)) > 1:
            tier.release(step, p.group.rank, marker=p.ranks.owns(tier))
        elif p.ranks.owns(tier):
            tier.delete_step(step)
