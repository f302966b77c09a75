"""What follows a restore once every rank has its shard: shards read from elsewhere written into the first
tier (:func:`localize`, so readers without collectives, such as DCP's reader, find the step in RAM), and
the replicas a replaced node lost sent to it again (:func:`reseed`, in the background)."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import numpy as np

from ...format import blockio as _blocks
from ...util import readable as _readable
from ...util.stages import stage
from ...ranks import Group
from ...ranks.agree import any_rank
from ...errors import TierfsError
from ...format import Marker, manifest_filename
from ...protocol import commit
from ...tiers.base import Replicator
from ..context import Context
from .sinks import Shard
from .sources import RestoreInfo

if TYPE_CHECKING:
    from .plan import RestorePlan

log = logging.getLogger("tierfs")


def localize(ctx: Context, group: Group, s: int, info: RestoreInfo, shard: Shard) -> None:
    """Write this rank's shard of step ``s``, read from ``info.tier``, into the first tier; each node's owner
    commits it there once all of the node's ranks have theirs (collective over ``group``). A failure only
    costs speed: it is logged."""
    first = ctx.first
    wrote = False
    if info.tier != first.name:
        shard = shard.whole()
        try:
            with stage("localize", s, first.name):
                bufs = ctx.staging.buffers(s, shard.manifest.files)
                for name, data in _blocks.shard_views(shard.manifest, shard.files).items():
                    np.copyto(bufs[name], data)
                ctx.staging.persist(s)
                first.write_file(s, manifest_filename(ctx.group.rank), shard.mbytes)
            wrote = True
        except Exception as e:  # noqa: BLE001 - only speed is lost: the other ranks must not wait
            ctx.staging.discard(s)
            log.warning("step %d: could not copy this rank's shard into tier %s (%s)", s, first.name, e)
    # one number per rank, whatever the job's size: a node's owner commits the step when some rank wrote
    # and its own tier does not hold it committed yet (a node none of whose ranks could write fails the
    # commit's check of the manifests: said in the log)
    wrote_any = any_rank(group, wrote)
    if ctx.ranks.owns(first) and wrote_any and s not in ctx.ledger.holding(first.name):
        marker = Marker.from_bytes(shard.marker)
        try:
            commit(first, s, shard.marker, ctx.ranks.expected_manifests(first, marker))
        except (TierfsError, OSError) as e:
            log.warning("step %d: not committed in tier %s (%s)", s, first.name, e)
    group.barrier()
    ctx.refresh(shared=group)


def reseed(ctx: Context, rep: Replicator, s: int, plan: RestorePlan, shard: Shard) -> None:
    """After restoring the newest step ``s``, give ranks that lost their replicas the copies they kept for
    others again: in the background, on the replicator's copy worker (every rank submits it here, in the
    same order), so the restore returns as soon as the state is in place."""
    if any(step > s for step, _ in plan.holders) or s in plan.reseeded:
        return  # peers keep a newer step: that one matters; or a restore of this plan re-seeded it already
    plan.reseeded.add(s)
    pairs = plan.lost_replicas(s, rep.targets)
    if not pairs:
        return
    if any(r == ctx.group.rank for r, _ in pairs):
        shard = shard.whole()  # the arrays it landed in are the caller's once the restore returns
    log.info("step %d: re-seeding %d peer copies in the background", s, len(pairs))
    ctx.ledger.pin(ctx.first.name, s)  # the shard this rank sends stays until it is sent
    ctx.work.copies[rep.name].submit(lambda: _send_replicas(ctx, rep, s, pairs, shard))


def _send_replicas(ctx: Context, rep: Replicator, s: int, pairs: list[tuple[int, int]], shard: Shard) -> None:
    t0 = time.perf_counter()
    try:
        error = None
        try:
            with stage("reseed", s, rep.name):  # this rank's part: its shard, as read, is what it sends
                _blocks.shard_views(shard.manifest, shard.files)
                files = {n: shard.files[n] for n in shard.manifest.replica_files}
        except (TierfsError, OSError, ValueError, KeyError) as e:
            error, files = f"{type(e).__name__}: {e}", {}  # still take part: the receivers refuse
        failed = rep.replicate(s, shard.marker, shard.mbytes, files, pairs=pairs, pace=ctx.work.pace(s, rep.name),
                               error=error)
    finally:
        ctx.ledger.unpin(ctx.first.name, s)
    if failed:
        log.warning("step %d: re-seeding %d peer copies failed (e.g. %s)", s, len(failed), failed[0])
        return
    if rep.holdings().get(s):
        ctx.ledger.stored(rep.name, s)
    log.info("step %d: re-seeded %d peer copies in %s", s, len(pairs), _readable.duration(time.perf_counter() - t0))
