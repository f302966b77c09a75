"""Storage tiers: :class:`Tier` (holds files) and :class:`Replicator` (keeps other ranks' shards) are the
interfaces, ``tierfs.testing`` the suites a tier passes."""

from .base import Capacity, Holder, Replicator, Tier
from .memory import MemoryTier
from .object import ObjectTier
from .peer import PeerTier

__all__ = ["Capacity", "Holder", "MemoryTier", "ObjectTier", "PeerTier", "Replicator", "Tier"]
