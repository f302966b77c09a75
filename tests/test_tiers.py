"""The conformance suite: every tier backend passes the same tests.

Backends: MemoryTier on a tmpfs directory; ObjectTier on memory://, file://, a moto S3 server (s3fs) and
gcp-storage-emulator (gcsfs). Add a backend to BACKENDS and it runs everything here.
"""

from __future__ import annotations

import uuid

import numpy as np
import pytest

from tierfs import FormatError, TieredStore
from tierfs.format import MARKER, Manifest, Marker, manifest_filename
from tierfs.tiers import Capacity, MemoryTier, ObjectTier, Tier

BACKENDS = ["memory", "obj-memory", "obj-file", "obj-s3", "obj-gcs"]


@pytest.fixture(params=BACKENDS)
def make_tier(request, shm_dir, tmp_path):
    """A factory for tiers of one backend, all pointing at the same place."""
    kind = request.param
    if kind == "memory":
        yield lambda **kw: MemoryTier(shm_dir, **kw)
    elif kind == "obj-memory":
        root = f"memory://tierfs-test/{uuid.uuid4().hex}"
        yield lambda **kw: ObjectTier(root, **kw)
        import fsspec

        mfs = fsspec.filesystem("memory")
        if mfs.exists(root):
            mfs.rm(root.removeprefix("memory://"), recursive=True)
    elif kind == "obj-file":
        yield lambda **kw: ObjectTier(f"file://{tmp_path}/objects", **kw)
    else:
        url, opts = request.getfixturevalue("s3_url" if kind == "obj-s3" else "gcs_url")
        yield lambda **kw: ObjectTier(url, storage_options=opts, **kw)


@pytest.fixture
def tier(make_tier) -> Tier:
    t = make_tier()
    t.open()
    yield t
    t.close()


def _fill(tier: Tier, step: int, files: dict[str, bytes]) -> None:
    bufs = tier.stage(step, {n: len(b) for n, b in files.items()})
    for n, b in files.items():
        bufs[n][:] = np.frombuffer(b, dtype=np.uint8)
    tier.write_staged(step)


def test_empty_tier_lists_nothing(tier):
    assert tier.list_steps() == {}
    assert tier.committed_steps() == []
    assert isinstance(tier.capacity(), Capacity)


def test_files_round_trip_and_commit(tier):
    rng = np.random.default_rng(1)
    # gcp-storage-emulator drops a trailing b"\r" of small uploads (real GCS does not): end with \x00.
    files = {"rank_00000.0000.bin": rng.bytes(3 << 20), "rank_00000.0001.bin": rng.bytes(999) + b"\x00",
             "rank_00000.0002.bin": b""}
    _fill(tier, 7, files)
    tier.write_file(7, "rank_00000.manifest.json", b'{"x": 1}')
    assert tier.list_steps() == {7: False}, "a step without its marker is not committed"
    tier.write_marker(7, b"marker")
    assert tier.list_steps() == {7: True}
    assert tier.committed_steps() == [7]
    sizes = tier.file_sizes(7)
    assert sizes == {**{n: len(b) for n, b in files.items()}, "rank_00000.manifest.json": 8, MARKER: 6}
    for n, b in files.items():
        assert bytes(tier.read_file(7, n)) == b
    got = tier.read_files(7, list(files))
    assert {n: bytes(v) for n, v in got.items()} == files
    big = files["rank_00000.0000.bin"]
    assert tier.read_range(7, "rank_00000.0000.bin", 12345, 2 << 20) == big[12345:2 << 20]


def test_steps_sort_and_delete(tier):
    for s in (3, 12, 100):
        _fill(tier, s, {"rank_00000.0000.bin": bytes([s]) * 100})
        tier.write_marker(s, b"m")
    _fill(tier, 200, {"rank_00000.0000.bin": b"partial"})
    assert tier.list_steps() == {3: True, 12: True, 100: True, 200: False}
    tier.delete_step(12)
    tier.delete_step(200)
    assert tier.list_steps() == {3: True, 100: True}
    with pytest.raises(FileNotFoundError):
        tier.read_file(12, "rank_00000.0000.bin")


def test_names_are_validated(tier):
    for bad in ("../escape", "/etc/passwd", "a/b", "..", ".hidden", ""):
        with pytest.raises(FormatError):
            tier.write_file(1, bad, b"x")
        with pytest.raises(FormatError):
            tier.stage(1, {bad: 1})
    with pytest.raises(FormatError):
        tier.write_file(-1, "ok.bin", b"x")


def test_missing_file_raises_file_not_found(tier):
    _fill(tier, 1, {"rank_00000.0000.bin": b"abc"})
    with pytest.raises(FileNotFoundError):
        tier.read_file(1, "rank_00000.0001.bin")


def _state(seed: int) -> dict:
    import torch

    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    return {
        "model": {"w": torch.randn(256, 300, generator=g), "b": torch.randn(7, generator=g).to(torch.bfloat16),
                  "i": torch.arange(10, dtype=torch.int64)},
        "opt.exp_avg": rng.standard_normal((513, 9)).astype(np.float32),
        "mask": rng.integers(0, 2, 33).astype(bool),
        "empty": np.zeros((0, 4), np.float64),
        "blob": b"\x00\x01binary\xff",
        "lr": 3e-4, "name": "run", "epoch": 4,
    }


def _assert_same(a, b):
    import torch

    assert a.keys() == b.keys()
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, dict):
            _assert_same(x, y)
        elif isinstance(x, torch.Tensor):
            assert y.dtype == x.dtype and y.shape == x.shape
            assert torch.equal(x.view(torch.uint8) if x.numel() else x, y.view(torch.uint8) if y.numel() else y)
        elif isinstance(x, np.ndarray):
            assert y.dtype == x.dtype and y.shape == x.shape and x.tobytes() == y.tobytes()
        elif isinstance(x, bytes):
            assert bytes(y) == x
        else:
            assert x == y


def test_store_round_trip_bit_exact(make_tier):
    with TieredStore([make_tier()], file_size=1 << 20, block_size=64 << 10) as store:
        state = _state(0)
        store.save(5, state, metadata={"lr": 3e-4})
        store.wait_until_finished()
        assert store.steps() == {5: [store.tiers[0].name]}
        out, info = store.restore()
        assert info.step == 5 and info.tier == store.tiers[0].name and info.metadata == {"lr": 3e-4}
        _assert_same({**state, "blob": state["blob"]}, {**out, "blob": out["blob"].tobytes()})
        target = _state(1)
        info = store.restore_into(target)
        _assert_same(state, {**target, "blob": target["blob"]} if isinstance(target["blob"], bytes) else target)


def test_marker_and_manifest_are_what_the_store_wrote(make_tier):
    with TieredStore([make_tier()]) as store:
        store.save(2, {"x": np.arange(1000, dtype=np.float32)})
        t = store.tiers[0]
        marker = t.read_marker(2)
        assert isinstance(marker, Marker) and marker.step == 2 and marker.world_size == 1
        m = Manifest.from_bytes(bytes(t.read_file(2, manifest_filename(0))))
        assert [e.name for e in m.entries] == ["x"] and m.entries[0].length == 4000


def test_copy_between_tiers(make_tier, tmp_path):
    with TieredStore([MemoryTier(str(tmp_path / "ram")), make_tier(name="target")]) as store:
        state = _state(3)
        store.save(1, state)
        store.wait_until_finished()
        assert store.steps() == {1: ["ram", "target"]}
        out, info = store.restore(tiers=["target"])
        assert info.tier == "target"
        _assert_same({k: v for k, v in state.items() if k != "blob"}, {k: v for k, v in out.items() if k != "blob"})
