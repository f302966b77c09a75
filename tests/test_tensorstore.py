"""tensorstore: arrays (zarr3 driver, sharded) as regular tierfs steps, and tensorstore's own kvstores on
the RAM tier (``file``) and on the object tier (``s3`` against moto, ``gcs`` against the emulator)."""

from __future__ import annotations

import os

import fsspec
import numpy as np
import pytest

ts = pytest.importorskip("tensorstore")
torch = pytest.importorskip("torch")

from tierfs import TieredStore  # noqa: E402
from tierfs.adapters.tensorstore import (read_arrays, restore_tensorstore, save_tensorstore,  # noqa: E402
                                         write_arrays)
from tierfs.errors import FormatError  # noqa: E402
from tierfs.tiers import MemoryTier, ObjectTier  # noqa: E402

from tierfs.testing import assert_states_equal  # noqa: E402


def _arrays(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    g = torch.Generator().manual_seed(seed)
    return {
        "emb": {"weight": torch.randn(500, 64, generator=g), "bf16": torch.randn(40, generator=g).to(torch.bfloat16)},
        "x": rng.standard_normal((300_000,)).astype(np.float32),
        "ids": rng.integers(0, 1 << 40, (7, 3)), "flag": np.array(True), "h": np.arange(6, dtype=np.float16),
        "epoch": 4,
    }


def test_tensorstore_step_through_the_ram_tier(shm_dir):
    arrays = _arrays()
    with TieredStore([MemoryTier(shm_dir)]) as store:
        assert save_tensorstore(store, 3, arrays, {"run": "a"})
        manifest = store.verify(3, "ram")
        names = {e.name for e in manifest.entries}
        assert {"tierfs.json", "x/zarr.json", "emb/weight/c/0/0"} <= names
        assert_states_equal(restore_tensorstore(store), arrays)
        store.save(4, {"plain": np.ones(2)})
        with pytest.raises(FormatError, match="not saved by save_tensorstore"):
            restore_tensorstore(store)


@pytest.mark.parametrize("backend", ["s3", "gcs"])
def test_tensorstore_step_through_the_object_tier(backend, request, shm_dir):
    url, opts = request.getfixturevalue("s3_url" if backend == "s3" else "gcs_url")
    arrays = _arrays(1)
    with TieredStore([MemoryTier(shm_dir), ObjectTier(url, opts, name="obj")]) as store:
        save_tensorstore(store, 5, arrays)
        store.wait_until_finished()
        assert store.steps() == {5: ["ram", "obj"]}
        store.verify(5, "obj")
        assert_states_equal(restore_tensorstore(store, 5, tiers=["obj"]), arrays)


def test_tensorstore_file_kvstore_on_the_ram_tier_of_a_tiered_fs(s3_url, s3_server, shm_dir):
    """tensorstore writes with its ``file`` kvstore into the tiered filesystem's RAM directory; adopt()
    queues the files, flush() makes them durable; tensorstore's ``s3`` kvstore reads them from moto."""
    url, opts = s3_url
    fs, root = fsspec.url_to_fs(f"tiered::{url}", tiered={"path": shm_dir}, s3=opts)
    arrays = _arrays(2)
    local = fs.ram_path(f"{root}/ts")
    assert local.startswith(shm_dir)
    write_arrays({"driver": "file", "path": local + "/"}, arrays)
    assert fs.adopt(f"{root}/ts") >= len(arrays)
    fs.flush()
    assert_states_equal(read_arrays({"driver": "file", "path": local + "/"}), arrays)  # from RAM
    bucket, prefix = root.split("/", 1)
    s3 = {"driver": "s3", "bucket": bucket, "path": f"{prefix}/ts/", "endpoint": s3_server,
          "aws_region": "us-east-1"}
    ctx = ts.Context({"aws_credentials": {"type": "environment"}})  # AWS_* from the s3_server fixture
    assert_states_equal(read_arrays(s3, context=ctx), arrays)  # from the target, through tensorstore's own S3 client
    in_ram = sorted(os.path.relpath(os.path.join(d, f), shm_dir) for d, _, fs_ in os.walk(local) for f in fs_)
    direct, _ = fsspec.url_to_fs(url, skip_instance_cache=True, **opts)
    assert direct.find(f"{root}/ts") == in_ram and fs.pending() == []


def test_write_arrays_overwrites_in_place(shm_dir):
    spec = {"driver": "file", "path": f"{shm_dir}/ts/"}
    write_arrays(spec, {"a": np.arange(5.0), "s": np.array(7)})
    write_arrays(spec, {"a": np.zeros(5), "s": np.array(0)})  # equal to the fill value: still written
    assert_states_equal(read_arrays(spec), {"a": np.zeros(5), "s": np.array(0)})


def test_tensorstore_s3_kvstore_against_moto(s3_url, s3_server):
    url, _ = s3_url
    bucket, prefix = url[len("s3://"):].split("/", 1)
    spec = {"driver": "s3", "bucket": bucket, "path": f"{prefix}/arrays/", "endpoint": s3_server,
            "aws_region": "us-east-1"}
    ctx = ts.Context({"aws_credentials": {"type": "environment"}})
    arrays = _arrays(3)
    write_arrays(spec, arrays, context=ctx)
    assert_states_equal(read_arrays(spec, context=ctx), arrays)


def test_tensorstore_gcs_kvstore_against_the_emulator(gcs_url, gcs_server, monkeypatch):
    """``TENSORSTORE_GCS_HTTP_URL`` points tensorstore at the emulator; ``GOOGLE_AUTH_TOKEN_FOR_TESTING``
    skips Google's credential lookup (the emulator checks none)."""
    monkeypatch.setenv("TENSORSTORE_GCS_HTTP_URL", gcs_server)
    monkeypatch.setenv("GOOGLE_AUTH_TOKEN_FOR_TESTING", "emulator")
    url, opts = gcs_url
    bucket, prefix = url[len("gs://"):].split("/", 1)
    spec = {"driver": "gcs", "bucket": bucket, "path": f"{prefix}/arrays/"}
    arrays = _arrays(4)
    write_arrays(spec, arrays)
    assert_states_equal(read_arrays(spec), arrays)
    gfs, _ = fsspec.url_to_fs(url, skip_instance_cache=True, **opts)
    assert f"{bucket}/{prefix}/arrays/tierfs.json" in gfs.find(url)
