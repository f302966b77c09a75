"""Re-seeding: after a restore, ranks that lost the replicas they kept for others (a replaced node) get them
back, in the background, on the replicator's copy worker."""

from __future__ import annotations

import logging
import time

from .. import _copy, _units
from .._stages import stage
from ..errors import TierfsError
from ..tiers.base import Replicator
from .parts import Parts
from .reading import Shard
from .restoreplan import RestorePlan

log = logging.getLogger("tierfs")


def reseed(parts: Parts, rep: Replicator, s: int, plan: RestorePlan, shard: Shard) -> None:
    """After restoring the newest step ``s``, give ranks that lost their replicas the copies they kept for
    others again: in the background, on the replicator's copy worker (every rank submits it here, in the
    same order), so the restore returns as soon as the state is in place."""
    if any(step > s for step, _ in plan.holders):
        return  # peers keep a newer step: that one matters
    pairs = plan.lost_replicas(s, rep.targets)
    if not pairs:
        return
    if any(r == parts.group.rank for r, _ in pairs):
        shard = shard.whole()  # the arrays it landed in are the caller's once the restore returns
    log.info("step %d: re-seeding %d peer copies in the background", s, len(pairs))
    parts.ledger.pin(parts.first.name, s)  # the shard this rank sends stays until it is sent
    parts.copies[rep.name].submit(lambda: _send_replicas(parts, rep, s, pairs, shard))


def _send_replicas(parts: Parts, rep: Replicator, s: int, pairs: list[tuple[int, int]], shard: Shard) -> None:
    t0 = time.perf_counter()
    try:
        error = None
        try:
            with stage("reseed", s, rep.name):  # this rank's part: its shard, as read, is what it sends
                _copy.shard_views(shard.manifest, shard.files)
                files = {n: shard.files[n] for n in shard.manifest.replica_files}
        except (TierfsError, OSError, ValueError, KeyError) as e:
            error, files = f"{type(e).__name__}: {e}", {}  # still take part: the receivers refuse
        failed = rep.replicate(s, shard.marker, shard.mbytes, files, pairs=pairs, pace=parts.pace(s, rep.name),
                               error=error)
    finally:
        parts.ledger.unpin(parts.first.name, s)
    if failed:
        log.warning("step %d: re-seeding %d peer copies failed (e.g. %s)", s, len(failed), failed[0])
        return
    if rep.holdings().get(s):
        parts.ledger.stored(rep.name, s)
    log.info("step %d: re-seeded %d peer copies in %s", s, len(pairs), _units.duration(time.perf_counter() - t0))
