"""The conformance suite (tierfs.testing.TierTests) for every tier backend of tierfs: MemoryTier on a
tmpfs directory; ObjectTier on memory://, file://, a moto S3 server (s3fs), SeaweedFS (a production S3
server, s3fs) and gcp-storage-emulator (gcsfs). A new backend is one more subclass with its ``make_tier``
fixture."""

from __future__ import annotations

import uuid

import fsspec
import pytest

from tierfs.testing import TierTests
from tierfs.tiers import MemoryTier, ObjectTier


class TestMemoryTier(TierTests):
    @pytest.fixture
    def make_tier(self, shm_dir):
        return lambda **kw: MemoryTier(shm_dir, **kw)


class TestObjectTierOnMemory(TierTests):
    @pytest.fixture
    def make_tier(self):
        root = f"memory://tierfs-test/{uuid.uuid4().hex}"
        yield lambda **kw: ObjectTier(root, **kw)
        mfs = fsspec.filesystem("memory")
        if mfs.exists(root):
            mfs.rm(root.removeprefix("memory://"), recursive=True)


class TestObjectTierOnFile(TierTests):
    @pytest.fixture
    def make_tier(self, tmp_path):
        return lambda **kw: ObjectTier(f"file://{tmp_path}/objects", **kw)


@pytest.mark.s3
class TestObjectTierOnS3(TierTests):
    @pytest.fixture
    def make_tier(self, s3_url):
        url, opts = s3_url
        return lambda **kw: ObjectTier(url, storage_options=opts, **kw)


@pytest.mark.s3
class TestObjectTierOnSeaweedFS(TierTests):
    @pytest.fixture
    def make_tier(self, seaweed_url):
        url, opts = seaweed_url
        return lambda **kw: ObjectTier(url, storage_options=opts, **kw)


@pytest.mark.gcs
class TestObjectTierOnGCS(TierTests):
    @pytest.fixture
    def make_tier(self, gcs_url):
        url, opts = gcs_url
        return lambda **kw: ObjectTier(url, storage_options=opts, **kw)
