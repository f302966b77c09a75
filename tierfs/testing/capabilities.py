"""One conformance suite per tier capability (:mod:`tierfs.tiers.capabilities`), beside :class:`TierTests`.

A tier with a capability adds its suite to its test class::

    class TestMyTier(TierTests, LocalFilesTests):
        @pytest.fixture
        def make_tier(self, tmp_path):
            return lambda **kw: MyTier(tmp_path / "tier", **kw)

Each suite first checks that the tier has the capability (it implements the protocol), then what the store
relies on it for. They use the ``make_tier`` and ``tier`` fixtures of :class:`TierTests`.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np
import pytest

from ..format import MARKER
from ..tiers import Tier
from ..tiers.capabilities import FileDeletes, LocalFiles, SharedDirectory, Staging, ZeroCopy
from .tiers import MakeTier, TierTests, _fill

__all__ = ["FileDeletesTests", "LocalFilesTests", "SharedDirectoryTests", "StagingTests", "ZeroCopyTests"]

_BIN = "rank_00000.0000.bin"


class StagingTests(TierTests):
    """A :class:`~tierfs.tiers.capabilities.Staging` tier: the buffers it hands out are what it persists."""

    def test_staged_buffers_become_the_files(self, tier: Tier) -> None:
        assert isinstance(tier, Staging)
        data = {_BIN: np.random.default_rng(2).bytes(70_000), "rank_00000.0001.bin": b"\x01\x02"}
        bufs = tier.buffers(4, {n: len(b) for n, b in data.items()})
        assert {n: (b.dtype, b.size, b.flags.writeable) for n, b in bufs.items()} == \
            {n: (np.dtype(np.uint8), len(b), True) for n, b in data.items()}
        for n, b in data.items():
            bufs[n][:] = np.frombuffer(b, dtype=np.uint8)
            memo = tier.buffer_memo(4, n)
            assert memo is None or isinstance(memo, dict)
        tier.persist(4)
        tier.write_marker(4, b"m")
        assert tier.committed_steps() == [4]
        assert {n: bytes(tier.read_file(4, n)) for n in data} == data

    def test_a_discarded_stage_leaves_nothing(self, tier: Tier) -> None:
        assert isinstance(tier, Staging)
        tier.buffers(5, {_BIN: 1000})
        tier.discard(5)
        assert 5 not in tier.list_steps()
        tier.prepare(5, {_BIN: 1000})  # getting ready for the next save changes nothing on the tier
        tier.drop_spares()
        assert tier.list_steps() == {}


class SharedDirectoryTests(TierTests):
    """A :class:`~tierfs.tiers.capabilities.SharedDirectory` tier: two tiers on one place say so, and each
    rank takes back only its own files."""

    @pytest.fixture
    def other(self, make_tier: MakeTier) -> Iterator[Tier]:
        """A second tier on the same place (as another rank of the node opens it)."""
        t = make_tier()
        t.open()
        yield t
        t.close()

    def test_the_same_place_has_the_same_identity(self, tier: Tier, other: Tier) -> None:
        assert isinstance(tier, SharedDirectory) and isinstance(other, SharedDirectory)
        assert tier.identity() == other.identity()
        assert isinstance(tier.lock_on_open, bool)

    def test_each_rank_releases_its_own_files(self, tier: Tier) -> None:
        assert isinstance(tier, SharedDirectory)
        _fill(tier, 3, {"rank_00000.0000.bin": b"a" * 10, "rank_00001.0000.bin": b"b" * 10})
        tier.write_marker(3, b"m")
        tier.release(3, 0, marker=True)  # the owner: its files and the marker
        assert set(tier.file_sizes(3)) == {"rank_00001.0000.bin"} and not tier.committed_steps()
        tier.release(3, 1, marker=False)  # the last one out: the step is gone
        assert tier.list_steps() == {}


class FileDeletesTests(TierTests):
    """A :class:`~tierfs.tiers.capabilities.FileDeletes` tier: the named files go, the others stay, and the
    step's directory goes with its last file."""

    def test_each_rank_deletes_its_own_files_after_the_marker(self, tier: Tier) -> None:
        assert isinstance(tier, FileDeletes)
        _fill(tier, 3, {"rank_00000.0000.bin": b"a" * 10, "rank_00001.0000.bin": b"b" * 10})
        tier.write_marker(3, b"m")
        tier.delete_files(3, [MARKER])  # the owner: the step is no longer committed
        assert tier.list_steps() == {3: False}
        tier.delete_files(3, ["rank_00000.0000.bin", "rank_00000.0001.bin"])  # one missing: no error
        tier.remove_if_empty(3)  # a file is left: the step stays
        assert tier.file_sizes(3) == {"rank_00001.0000.bin": 10}
        tier.delete_files(3, ["rank_00001.0000.bin"])
        tier.remove_if_empty(3)  # the last one out
        assert tier.list_steps() == {}
        tier.remove_if_empty(3)  # nothing left to remove: no error
        tier.delete_files(3, [])


class LocalFilesTests(TierTests):
    """A :class:`~tierfs.tiers.capabilities.LocalFiles` tier: it says which directories it creates."""

    def test_it_names_the_directories_it_creates(self, make_tier: MakeTier) -> None:
        t = make_tier()
        assert isinstance(t, LocalFiles)
        dirs = t.local_dirs()
        t.open()
        try:
            assert all(d.is_dir() for d in t.local_dirs()), t.local_dirs()
            assert t.local_dirs() == dirs  # known before it opens, so a failed open can remove them
            assert t.live_users() == []  # none but this process
        finally:
            t.close()


class ZeroCopyTests(TierTests):
    """A :class:`~tierfs.tiers.capabilities.ZeroCopy` tier: views of the stored bytes, and a write into a view
    handed to the user never reaches the file."""

    def test_views_are_the_bytes_and_writes_never_reach_the_file(self, tier: Tier) -> None:
        assert isinstance(tier, ZeroCopy)
        data = np.random.default_rng(3).bytes(50_000)
        _fill(tier, 6, {_BIN: data})
        tier.write_marker(6, b"m")
        assert bytes(tier.view(6, _BIN)) == data
        exported = tier.export(6, _BIN)
        assert bytes(exported) == data
        if exported.flags.writeable:
            exported[:10] = 0xFF  # lands in this process's copy, not in the file
        assert bytes(tier.read_file(6, _BIN)) == data and bytes(tier.read_file(6, MARKER)) == b"m"
