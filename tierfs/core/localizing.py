"""Localize: a shard a restore read from elsewhere (a peer, a slower tier) written into the first tier and
committed there, so that readers without collectives (DCP's reader) find the step in RAM."""

from __future__ import annotations

import logging

import numpy as np

from .. import _copy
from .._stages import stage
from ..dist import Group
from ..errors import TierfsError
from ..format import Marker, manifest_filename
from ..protocol import commit
from .parts import Parts
from .reading import Shard
from .restoreplan import RestoreInfo

log = logging.getLogger("tierfs")


def adopt(parts: Parts, group: Group, s: int, info: RestoreInfo, shard: Shard) -> None:
    """Write this rank's shard of step ``s``, read from ``info.tier``, into the first tier; each node's owner
    commits it there once all of the node's ranks have theirs (collective over ``group``). A failure only
    costs speed: it is logged."""
    first = parts.first
    wrote = False
    if info.tier != first.name:
        shard = shard.whole()
        try:
            with stage("localize", s, first.name):
                bufs = first.stage(s, shard.manifest.files)
                for name, data in _copy.shard_views(shard.manifest, shard.files).items():
                    np.copyto(bufs[name], data)
                first.write_staged(s)
                first.write_file(s, manifest_filename(parts.group.rank), shard.mbytes)
            wrote = True
        except Exception as e:  # noqa: BLE001 - only speed is lost: the other ranks must not wait
            first.discard_staged(s)
            log.warning("step %d: could not copy this rank's shard into tier %s (%s)", s, first.name, e)
    wrote_by = group.all_gather(wrote)
    if parts.owns(first) and any(wrote_by[r] for r in parts.sharing(first)):
        marker = Marker.from_bytes(shard.marker)
        try:
            commit(first, s, shard.marker, parts.expected_manifests(first, marker))
        except (TierfsError, OSError) as e:
            log.warning("step %d: not committed in tier %s (%s)", s, first.name, e)
    group.barrier()
    parts.refresh()
