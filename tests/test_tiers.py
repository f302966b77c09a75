"""The conformance suites (tierfs.testing.TierTests, and one per capability) for every tier backend of
tierfs: MemoryTier on a tmpfs directory (every capability); ObjectTier on memory://, file:// (local files),
a moto S3 server (s3fs), SeaweedFS (a production S3 server, s3fs) and gcp-storage-emulator (gcsfs); and
DiskTier (tests/_disktier.py), a new kind of tier in one module. A new backend is one more subclass with
its ``make_tier`` fixture, and the suites of its capabilities."""

from __future__ import annotations

import json
import uuid

import fsspec
import numpy as np
import pytest

from _disktier import DiskTier
from tierfs import TieredStore
from tierfs.config import tiers_from_config
from tierfs.testing import (FileDeletesTests, LocalFilesTests, SharedDirectoryTests, StagingTests, TierTests, ZeroCopyTests,
                            assert_states_equal)
from tierfs.tiers import MemoryTier, ObjectTier


class TestMemoryTier(StagingTests, SharedDirectoryTests, LocalFilesTests, ZeroCopyTests):
    @pytest.fixture
    def make_tier(self, shm_dir):
        return lambda **kw: MemoryTier(shm_dir, **kw)


class TestObjectTierOnMemory(FileDeletesTests):
    @pytest.fixture
    def make_tier(self):
        root = f"memory://tierfs-test/{uuid.uuid4().hex}"
        yield lambda **kw: ObjectTier(root, **kw)
        mfs = fsspec.filesystem("memory")
        if mfs.exists(root):
            mfs.rm(root.removeprefix("memory://"), recursive=True)


class TestObjectTierOnFile(LocalFilesTests, FileDeletesTests):
    @pytest.fixture
    def make_tier(self, tmp_path):
        return lambda **kw: ObjectTier(f"file://{tmp_path}/objects", **kw)


@pytest.mark.s3
class TestObjectTierOnS3(FileDeletesTests):
    @pytest.fixture
    def make_tier(self, s3_url):
        url, opts = s3_url
        return lambda **kw: ObjectTier(url, storage_options=opts, **kw)


@pytest.mark.s3
class TestObjectTierOnSeaweedFS(FileDeletesTests):
    @pytest.fixture
    def make_tier(self, seaweed_url):
        url, opts = seaweed_url
        return lambda **kw: ObjectTier(url, storage_options=opts, **kw)


@pytest.mark.gcs
class TestObjectTierOnGCS(FileDeletesTests):
    @pytest.fixture
    def make_tier(self, gcs_url):
        url, opts = gcs_url
        return lambda **kw: ObjectTier(url, storage_options=opts, **kw)


class TestDiskTier(LocalFilesTests):
    @pytest.fixture
    def make_tier(self, tmp_path):
        return lambda **kw: DiskTier(tmp_path / "disk", **kw)


def test_a_registered_kind_is_named_by_a_config_file_and_saves_behind_ram(shm_dir, tmp_path):
    cfg = tmp_path / "tiers.json"
    cfg.write_text(json.dumps({"tiers": [{"kind": "memory", "path": shm_dir},
                                         {"kind": "disk", "path": "disk", "save": {"every_n_steps": 2}}]}))
    tiers = tiers_from_config(cfg)
    assert [type(t).__name__ for t in tiers] == ["MemoryTier", "DiskTier"] and tiers[1].path == tmp_path / "disk"
    state = {"w": np.arange(1000, dtype=np.float32), "step": 4}
    with TieredStore(tiers) as store:
        store.save(4, state)
        store.wait_until_finished()
        assert store.steps() == {4: ["ram", "disk"]}
        assert_states_equal(store.restore(tiers=["disk"])[0], state)
