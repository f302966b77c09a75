"""Storage tiers: :class:`Tier` (holds files) and :class:`Replicator` (keeps other ranks' shards) are the
interfaces, :mod:`.capabilities` what only some tiers do, :mod:`.registry` the kinds a config file names
(the built-in ones in :mod:`.kinds`), ``tierfs.testing`` the suites a tier passes."""

from . import kinds as _kinds  # noqa: F401 - registers the built-in kinds
from .base import Capacity, AnyTier, Replicator, Tier
from .capabilities import LocalFiles, SharedDirectory, SharedStore, Staging, ZeroCopy
from .erasure import ErasureCodedTier
from .memory import MemoryTier
from .object import ObjectTier
from .peer import PeerTier
from .registry import Kind, register

__all__ = ["Capacity", "AnyTier", "ErasureCodedTier", "Kind", "LocalFiles", "MemoryTier", "ObjectTier", "PeerTier", "Replicator",
           "SharedDirectory", "SharedStore", "Staging", "Tier", "ZeroCopy", "register"]
