"""Who the ranks are and what they share: which rank owns a tier's commits and deletions, which ranks use
the same storage of a node-local tier (as observed when the store opened, :mod:`tierfs.ranks.nodes`), and
which manifests must be on a tier before its marker."""

from __future__ import annotations

from dataclasses import dataclass

from ..ranks import Group
from ..ranks.nodes import NodeMap
from ..format import Marker, manifest_filename
from ..tiers.base import AnyTier, Replicator, Tier


@dataclass
class Ownership:
    """The ranks of a store's job (``group``) and who shares what (``nodes``; None: each rank its own)."""

    group: Group
    nodes: NodeMap | None = None
    replicator: Replicator | None = None

    def owns(self, tier: AnyTier) -> bool:
        """Whether this rank commits and deletes whole steps on ``tier``: per node for local tiers, rank 0
        for shared ones; on a replicator each rank its own copies."""
        if tier is self.replicator:
            return True
        assert isinstance(tier, Tier)
        return (min(self.sharing(tier)) if tier.is_local else 0) == self.group.rank

    def sharing(self, tier: Tier) -> tuple[int, ...]:
        """The ranks whose ``tier`` is the same storage as this rank's: every rank for a shared tier, the
        ranks using the same directory for a node-local one."""
        if not tier.is_local:
            return tuple(range(self.group.world_size))
        return self.nodes.sharing(tier.name) if self.nodes is not None else (self.group.rank,)

    def expected_manifests(self, tier: Tier, marker: Marker) -> dict[str, int | None]:
        """The manifests that must be on ``tier`` before its marker: this node's ranks' on a local tier,
        every rank's on a shared one."""
        if tier.is_local:
            return {manifest_filename(r): None for r in self.sharing(tier)}
        if marker.commit is not None:  # each rank confirmed its own files before the ranks agreed
            return {}
        return {n: None for n in marker.manifests}
