"""The Replicator conformance suite (tierfs.testing.ReplicatorTests) for the peer tier and the erasure-coded
tier: a real gloo job of 3 processes, each its own node with its own RAM directory, as a third party would
run it for theirs."""

from __future__ import annotations

from tierfs.testing import ReplicatorTests
from tierfs.tiers import ErasureCodedTier, PeerTier
from tierfs.tiers.erasure import PARITY
from tierfs.tiers.peer import Wire


def peer_tier() -> PeerTier:
    """The replicator each rank builds: one copy per shard, in small messages (several per shard file)."""
    return PeerTier(replicas=1, wire=Wire(chunk=64 << 10))


class TestPeerTier(ReplicatorTests):
    factory = "test_replicators:peer_tier"

    def test_the_refused_copy_names_the_checksum_that_failed(self, report):
        assert "checksum mismatch" in report[0]["fetch_corrupt"]["why"]


def erasure_tier() -> ErasureCodedTier:
    """An erasure-coded tier over the suite's 3 ranks: one group of 2 data + 1 parity, in small blocks."""
    return ErasureCodedTier(data=2, parity=1, block=16 << 10)


def corrupt_parity(rep: ErasureCodedTier, step: int, source: int) -> None:
    """Flip one byte in the middle of the parity this rank keeps of ``step`` (the rebuild of ``source``'s
    shard reads it)."""
    data = bytearray(bytes(rep.local.read_file(step, PARITY)))
    data[len(data) // 2] ^= 0x40
    rep.local.write_file(step, PARITY, bytes(data))


class TestErasureCodedTier(ReplicatorTests):
    factory = "test_replicators:erasure_tier"
    corrupt = "test_replicators:corrupt_parity"

    def test_the_refused_rebuild_names_the_damaged_parity(self, report):
        assert "could not read it" in report[0]["fetch_corrupt"]["why"]
