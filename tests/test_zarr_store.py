"""zarr's own store test suite (``zarr.testing.store.StoreTests``) against zarr's ``FsspecStore`` over
``tiered::``, with three targets: ``file://``, S3 (moto) and GCS (the emulator).

The suite's ``set``/``get`` bypass the store: ``set`` writes straight to the target (the store must read
it through), ``get`` waits for the drain and reads the target through a fresh client (what the store
wrote must be durable there). The drain runs in the background, so listings happen while uploads are in
flight: they must never show a temporary name.

The suite's tests are coroutines (zarr runs them with pytest-asyncio, which this project does not use);
each runs here in a fresh event loop on the main thread, as pytest-asyncio runs them (fsspec's instance
cache is per thread, so the pickling test needs the fixture's thread).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import uuid
from typing import Any

import fsspec
import pytest
from fsspec.utils import tokenize

pytest.importorskip("zarr")

from zarr.abc.store import SuffixByteRequest  # noqa: E402
from zarr.core.buffer import Buffer, cpu  # noqa: E402
from zarr.storage import FsspecStore  # noqa: E402
from zarr.testing.store import StoreTests  # noqa: E402

from tierfs.fs import TieredFileSystem  # noqa: E402


_DIRECT: dict[str, fsspec.AbstractFileSystem] = {}


def _direct(store: FsspecStore) -> fsspec.AbstractFileSystem:
    """The store's target through a client of its own: no caches shared with the tiered filesystem
    (one per target, kept across tests: a new S3 or GCS client costs a tenth of a second)."""
    target = store.fs.target
    proto = target.protocol if isinstance(target.protocol, str) else target.protocol[0]
    opts = {k: v for k, v in target.storage_options.items() if k not in ("asynchronous", "loop")}
    if proto in ("file", "local"):
        opts["auto_mkdir"] = True
    key = tokenize(proto, opts)
    if key not in _DIRECT:
        _DIRECT[key] = fsspec.filesystem(proto, skip_instance_cache=True, **opts)
    fs = _DIRECT[key]
    fs.invalidate_cache()
    return fs


class _TieredStoreTests(StoreTests[FsspecStore, cpu.Buffer]):
    store_cls = FsspecStore
    buffer_cls = cpu.Buffer

    @pytest.fixture
    def target(self) -> tuple[str, dict[str, Any]]:  # (URL, storage options) of the target
        raise NotImplementedError

    @pytest.fixture
    def store_kwargs(self, target: tuple[str, dict[str, Any]], shm_dir: str) -> dict[str, Any]:
        url, opts = target
        proto = url.split("://", 1)[0]
        fs, path = fsspec.url_to_fs(f"tiered::{url}", tiered={"path": shm_dir, "asynchronous": True},
                                    **{proto: opts})  # as FsspecStore.from_url makes it
        assert isinstance(fs, TieredFileSystem)
        return {"fs": fs, "path": path}

    # StoreTests' own ``store``/``store_not_open`` fixtures are coroutines too
    @pytest.fixture
    def store(self, open_kwargs: dict[str, Any]) -> FsspecStore:
        return asyncio.run(self.store_cls.open(**open_kwargs))

    @pytest.fixture
    def store_not_open(self, store_kwargs: dict[str, Any]) -> FsspecStore:
        return self.store_cls(**store_kwargs)

    async def set(self, store: FsspecStore, key: str, value: Buffer) -> None:
        _direct(store).pipe_file(f"{store.path}/{key}", value.to_bytes())

    async def get(self, store: FsspecStore, key: str) -> Buffer:
        await store.fs._flush()
        return self.buffer_cls.from_bytes(_direct(store).cat_file(f"{store.path}/{key}"))

    def test_store_repr(self, store: FsspecStore) -> None:
        assert str(store) == f"<FsspecStore(TieredFileSystem, {store.path})>"

    def test_store_supports_writes(self, store: FsspecStore) -> None:
        assert store.supports_writes

    def test_store_supports_listing(self, store: FsspecStore) -> None:
        assert store.supports_listing


def _in_a_loop(test: Any) -> Any:
    @functools.wraps(test)  # keeps the parametrize marks and the signature pytest reads
    def run(*args: Any, **kwargs: Any) -> Any:
        return asyncio.run(test(*args, **kwargs))
    return run


for _name, _test in vars(StoreTests).items():
    if _name.startswith("test_") and inspect.iscoroutinefunction(_test):
        setattr(_TieredStoreTests, _name, _in_a_loop(_test))


class TestTieredFileStore(_TieredStoreTests):
    @pytest.fixture
    def target(self, tmp_path) -> tuple[str, dict[str, Any]]:
        return f"file://{tmp_path}/target", {}


@pytest.fixture(scope="module")
def s3_bucket(s3_server) -> tuple[str, dict[str, Any]]:
    """A bucket on the session's moto server, made once for this module. (conftest's ``s3_url`` resets
    moto and makes new S3 clients for every test: about 0.4 s each, half a minute for this suite; a
    unique prefix per test keeps the tests apart just as well.)"""
    opts = {"endpoint_url": s3_server, "key": "testing", "secret": "testing"}  # as conftest's s3_url
    s3 = fsspec.filesystem("s3", skip_instance_cache=True, **opts)
    if not s3.exists("tierfs-zarr-store"):
        s3.mkdir("tierfs-zarr-store")
    return "s3://tierfs-zarr-store", opts


class TestTieredS3Store(_TieredStoreTests):
    @pytest.fixture
    def target(self, s3_bucket) -> tuple[str, dict[str, Any]]:
        bucket, opts = s3_bucket
        return f"{bucket}/{uuid.uuid4().hex}", opts


class TestTieredGCSStore(_TieredStoreTests):
    @pytest.fixture
    def target(self, gcs_url) -> tuple[str, dict[str, Any]]:
        return gcs_url

    @pytest.fixture(autouse=True)
    def _emulator_limits(self, request) -> None:
        callspec = getattr(request.node, "callspec", None)
        byte_range = callspec.params.get("byte_range") if callspec else None
        if request.node.originalname == "test_get" and isinstance(byte_range, SuffixByteRequest):
            pytest.skip("gcp-storage-emulator ignores suffix ranges (Range: bytes=-N matches none of its "
                        "patterns) and returns the whole object; real GCS honours them")
