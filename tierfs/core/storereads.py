"""The part of :class:`~tierfs.TieredStore`'s interface that reads committed steps without collectives: any
rank may read any rank's marker, manifest or entries (DCP's reader reshards that way; the tools verify).
Each read takes the fastest tier holding a copy that verifies (:mod:`tierfs.core.reads`)."""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

from ..util import args as _args
from .context import Context
from .reads import Reader
from .restore.sources import Skipped
from ..errors import TierfsError
from ..format import Entry, Manifest, Marker
from ..ranks import Group
from ..tiers.base import Tier


class ShardReads:
    """Reads of committed steps without collectives (a base of :class:`~tierfs.TieredStore`)."""

    _ctx: Context
    _reader: Reader
    group: Group

    def read_marker(self, step: int, *, tiers: Sequence[str] | None = None) -> Marker:
        """The commit marker of ``step`` from the fastest tier holding a readable one."""
        return self._reader.read_marker(_args.step(step), _args.names(tiers, "tiers", self._ctx.names))

    def read_manifest(self, step: int, rank: int, *, tiers: Sequence[str] | None = None
                      ) -> tuple[Manifest, str]:
        """Any rank's manifest of ``step``, checked against the marker, from the fastest tier holding it.

        Returns ``(manifest, tier name)``. Needs no collective (any rank may call it alone). The manifest is
        parsed once per step and shared by every later read of it: treat it as read-only.
        """
        return self._reader.read_manifest(_args.step(step), _args.integer(rank, "rank", 0),
                                          _args.names(tiers, "tiers", self._ctx.names))

    def read_entries(self, step: int, rank: int, names: Sequence[str] | None = None, *,
                     tiers: Sequence[str] | None = None,
                     consume: Callable[[Mapping[str, tuple[Entry, Any]], str], None]) -> tuple[str, Skipped]:
        """Read entries of any rank's shard of ``step`` from the fastest tier whose copy verifies.

        For each tier holding the step, fastest first: check the manifest against the marker, read the
        needed shard files (RAM: mapped views, no copy), verify every block of the wanted entries, then
        call ``consume({name: (entry, value)}, tier_name)`` while the tier's files are pinned. ``value``
        is a read-only 1-D uint8 array for array entries (valid only during the call: copy out of it) and
        the JSON value for json entries. A tier that fails before ``consume`` is called is skipped and the
        next one tried. Returns ``(tier name, skipped)`` with ``skipped`` as in :class:`RestoreInfo`.
        Needs no collective (any rank may read any rank's shard, e.g. to reshard).
        """
        return self._reader.read_entries(_args.step(step), _args.integer(rank, "rank", 0), names,
                                         _args.names(tiers, "tiers", self._ctx.names), consume)

    def manifest(self, step: int) -> Manifest:
        """This rank's manifest of ``step`` (metadata, metrics, entries), from the first tier holding it."""
        return self.read_manifest(step, self.group.rank)[0]

    def verify(self, step: int, tier: str) -> Manifest:
        """Check every checksum of this rank's copy of ``step`` on ``tier``; raise on the first problem."""
        step, t = _args.step(step), self._ctx.tier(_args.name(tier, "tier"))
        if not isinstance(t, Tier):
            raise TierfsError(f"tier {tier!r} keeps other ranks' copies; verify a tier that holds files")
        return self._reader.verify(step, t)
