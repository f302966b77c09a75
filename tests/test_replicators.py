"""The Replicator conformance suite (tierfs.testing.ReplicatorTests) for the peer tier: a real gloo job
of 3 processes, each its own node with its own RAM directory, as a third party would run it for theirs."""

from __future__ import annotations

from tierfs.testing import ReplicatorTests
from tierfs.tiers import PeerTier
from tierfs.tiers.peer import Wire


def peer_tier() -> PeerTier:
    """The replicator each rank builds: one copy per shard, in small messages (several per shard file)."""
    return PeerTier(replicas=1, wire=Wire(chunk=64 << 10))


class TestPeerTier(ReplicatorTests):
    factory = "test_replicators:peer_tier"

    def test_the_refused_copy_names_the_checksum_that_failed(self, report):
        assert "checksum mismatch" in report[0]["fetch_corrupt"]["why"]
