"""Storage tiers. Each implements `tierfs.tiers.base.Tier`."""

from .base import Capacity, Tier
from .memory import MemoryTier
from .object import ObjectTier
from .peer import PeerTier

__all__ = ["Capacity", "MemoryTier", "ObjectTier", "PeerTier", "Tier"]
