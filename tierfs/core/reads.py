"""Reads of committed steps without collectives: any rank may read any rank's shard (DCP's reader reshards
that way), a marker or a manifest, from the fastest tier holding a copy that verifies (the restore's own
:func:`~.restore.sources.read_shard` and :func:`~.restore.sources.first_verified`)."""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

from ..errors import RestoreError, StepNotFoundError
from ..format import Entry, Manifest, Marker
from ..policies import StepInfo
from ..protocol import checked_manifest, verify_shard
from ..tiers.base import Tier
from .context import Context
from .restore.sinks import Views
from .restore.sources import Skipped, first_verified, read_shard


class Reader:
    """Reads of committed steps, without collectives."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx

    def holding(self, step: int, tiers: Sequence[str] | None) -> list[Tier]:
        """The file tiers among ``tiers`` (default: all) holding a committed copy of ``step``."""
        usable = self.ctx.usable(tiers)
        self.ctx.refresh()
        before, _, after = self.ctx.roles(usable)  # in the order asked for
        held = [t for t in before + after if step in self.ctx.ledger.holding(t.name)]
        if not held:
            raise StepNotFoundError(f"step {step} is not committed on {[t.name for t in usable]}")
        return held

    def read_marker(self, step: int, tiers: Sequence[str] | None = None) -> Marker:
        skipped: Skipped = []
        found = first_verified(self.holding(step, tiers), step, lambda t: t.read_marker(step), skipped)
        if found is None:
            raise RestoreError(f"step {step}: no readable commit marker ({_reasons(skipped)})")
        return found[1]

    def step_info(self, step: int, tiers: Sequence[Tier]) -> StepInfo:
        """``step``'s commit time (its marker) and this rank's metrics (its manifest; a rank the step's job
        did not have reads the one it would have been, ``rank % world_size``) from the first of ``tiers``
        (fastest first: those known to hold the step, not listed again) whose copies verify, for the keep
        policies that judge by them. RestoreError when none does."""
        rank = self.ctx.group.rank

        def read(t: Tier) -> StepInfo:
            with self.ctx.ledger.pinned(t.name, step):
                marker = t.read_marker(step)
                manifest = checked_manifest(t, step, rank % marker.world_size, marker)[0]
            return StepInfo(step, float(marker.committed or 0.0), dict(manifest.metrics))
        skipped: Skipped = []
        found = first_verified(tiers, step, read, skipped)
        if found is None:
            raise RestoreError(f"step {step}: no verified marker and manifest "
                               f"({_reasons(skipped) if skipped else 'no tier holds it'})")
        return found[1]

    def read_manifest(self, step: int, rank: int, tiers: Sequence[str] | None = None) -> tuple[Manifest, str]:
        def read(t: Tier) -> Manifest:
            with self.ctx.ledger.pinned(t.name, step):
                return checked_manifest(t, step, rank)[0]
        skipped: Skipped = []
        found = first_verified(self.holding(step, tiers), step, read, skipped, f" rank {rank}")
        if found is None:
            raise RestoreError(f"step {step}: no tier holds a verified manifest of rank {rank} "
                               f"({_reasons(skipped)})")
        return found[1], found[0].name

    def read_entries(self, step: int, rank: int, names: Sequence[str] | None, tiers: Sequence[str] | None,
                     consume: Callable[[Mapping[str, tuple[Entry, Any]], str], None]) -> tuple[str, Skipped]:
        """See :meth:`TieredStore.read_entries`."""
        skipped: Skipped = []
        wanted = None if names is None else list(dict.fromkeys(names))
        for t in self.holding(step, tiers):
            sink = Views(wanted)
            with self.ctx.ledger.pinned(t.name, step):
                if first_verified([t], step, lambda t: self._entries(t, step, rank, sink), skipped,
                                  f" rank {rank}") is not None:
                    consume(sink.values, t.name)  # while the tier's files are pinned
                    return t.name, skipped
        raise RestoreError(f"step {step} rank {rank}: no tier holds a verified copy ({_reasons(skipped)})")

    def _entries(self, t: Tier, step: int, rank: int, sink: Views) -> None:
        """Wanted entries of ``rank``'s shard on ``t``; those a shared tier holds in their owners' shards
        read from there."""
        read_shard(self.ctx, t, step, rank, sink)
        for owner, names in sorted(sink.away.items()):
            there = Views(names)
            read_shard(self.ctx, t, step, owner, there)
            sink.values.update(there.values)

    def verify(self, step: int, tier: Tier) -> Manifest:
        """Check every checksum of this rank's copy of ``step`` on ``tier``; raise on the first problem."""
        manifest, _ = checked_manifest(tier, step, self.ctx.group.rank)
        verify_shard(tier, step, manifest, threads=self.ctx.threads)
        return manifest


def _reasons(skipped: Skipped) -> str:
    return "; ".join(f"{t} step {s}: {w}" for t, s, w in skipped)
