"""The ``tiered::`` fsspec filesystem: a write-back RAM tier in front of file://, S3 (moto) and GCS
(emulator) targets. Real servers, real files; durability is checked by reading the target directly."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import fsspec
import numpy as np
import pytest
from fsspec.tests.abstract import AbstractCopyTests, AbstractGetTests, AbstractPutTests
from fsspec.tests.abstract import AbstractFixtures
from fsspec.tests.abstract.open import AbstractOpenTests
from fsspec.tests.abstract.pipe import AbstractPipeTests

from tierfs.adapters.fsspec import TieredFileSystem
from tierfs.errors import BackgroundError, CapacityError


def _data(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


# -- fsspec's own abstract suites, over a file:// target ------------------------------------------------
class _TieredFileFixtures(AbstractFixtures):
    @pytest.fixture
    def fs(self, shm_dir, tmp_path):
        return fsspec.filesystem("tiered", path=shm_dir, target_protocol="file", drain="manual",
                                 skip_instance_cache=True)

    @pytest.fixture
    def fs_path(self, tmp_path):
        return str(tmp_path / "remote")


class TestTieredCopy(_TieredFileFixtures, AbstractCopyTests):
    pass


class TestTieredGet(_TieredFileFixtures, AbstractGetTests):
    pass


class TestTieredPut(_TieredFileFixtures, AbstractPutTests):
    pass


class TestTieredOpen(_TieredFileFixtures, AbstractOpenTests):
    pass


class TestTieredPipe(_TieredFileFixtures, AbstractPipeTests):
    pass
