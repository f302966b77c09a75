"""The ``tiered::`` fsspec filesystem: a write-back RAM tier in front of file://, S3 (moto) and GCS
(emulator) targets. Real servers, real files; durability is checked by reading the target directly."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import uuid

import fsspec
import numpy as np
import pytest
from fsspec.tests.abstract import AbstractCopyTests, AbstractGetTests, AbstractPutTests
from fsspec.tests.abstract import AbstractFixtures
from fsspec.tests.abstract.open import AbstractOpenTests
from fsspec.tests.abstract.pipe import AbstractPipeTests

from tierfs.errors import BackgroundError, CapacityError
from tierfs.fs import TieredFileSystem


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


class _TieredMemoryFixtures(AbstractFixtures):
    """Over memory:// with the drain running: files move to the target while the suite works on them."""

    @pytest.fixture
    def fs(self, shm_dir):
        fs = fsspec.filesystem("tiered", path=shm_dir, target_protocol="memory", skip_instance_cache=True)
        yield fs
        fs.flush()  # every upload the suite caused succeeded
        assert fs.pending() == []

    @pytest.fixture
    def fs_path(self, request):
        return f"/tiered-abstract/{uuid.uuid4().hex}"


class TestTieredCopy(_TieredFileFixtures, AbstractCopyTests):
    pass


class TestTieredCopyDraining(_TieredMemoryFixtures, AbstractCopyTests):
    pass


class TestTieredPutDraining(_TieredMemoryFixtures, AbstractPutTests):
    pass


class TestTieredGet(_TieredFileFixtures, AbstractGetTests):
    pass


class TestTieredPut(_TieredFileFixtures, AbstractPutTests):
    pass


class TestTieredOpen(_TieredFileFixtures, AbstractOpenTests):
    pass


class TestTieredPipe(_TieredFileFixtures, AbstractPipeTests):
    pass


# -- write-back to object storage --------------------------------------------------------------------
def _tiered(url: str, opts: dict, ram: str, **tiered) -> tuple[TieredFileSystem, str]:
    proto = url.split("://", 1)[0]
    return fsspec.url_to_fs(f"tiered::{url}", tiered={"path": ram, **tiered}, **{proto: opts})


def _direct(url: str, opts: dict):
    """The target itself, through a fresh client (no caches shared with the tiered filesystem)."""
    return fsspec.url_to_fs(url, skip_instance_cache=True, **opts)


@pytest.fixture(params=["s3", "gcs"])
def bucket_url(request):
    """("s3://..." or "gs://...", storage options) on the moto server or the GCS emulator."""
    fixture = "s3_url" if request.param == "s3" else "gcs_url"
    return request.getfixturevalue(fixture)


def test_writes_land_in_private_ram_then_flush_makes_them_durable(bucket_url, shm_dir):
    url, opts = bucket_url
    fs, root = _tiered(url, opts, shm_dir, drain="manual")
    assert isinstance(fs, TieredFileSystem) and root == url.split("://", 1)[1]
    files = {f"{root}/a.bin": _data(3 << 20, 1), f"{root}/sub/b.bin": _data(1000, 2), f"{root}/c": b""}
    fs.pipe(files)
    with fs.open(f"{root}/sub/d.txt", "w") as f:
        f.write("text\n")
    files[f"{root}/sub/d.txt"] = b"text\n"
    # nothing has reached the target yet (manual drain), and the RAM copy is private
    tfs, _ = _direct(url, opts)
    assert not tfs.exists(f"{root}/a.bin")
    assert sorted(fs.pending()) == sorted(files)
    ram_file = os.path.join(shm_dir, root, "sub", "b.bin")
    assert stat.S_IMODE(os.stat(os.path.join(shm_dir, root)).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(ram_file).st_mode) == 0o600  # writable = not yet durable
    fs.flush()
    assert fs.pending() == []
    assert stat.S_IMODE(os.stat(ram_file).st_mode) == 0o400  # read-only = durable on the target
    tfs.invalidate_cache()
    for path, data in files.items():
        assert tfs.cat_file(path) == data
    assert fs.stats()["uploads"] == len(files)


def test_background_drain_and_flush_from_any_instance(s3_url, shm_dir):
    """zarr's own async instance writes; a sync instance made elsewhere flushes every write."""
    url, opts = s3_url
    writer, root = _tiered(url, opts, shm_dir, asynchronous=True)  # as zarr makes them
    other = fsspec.filesystem("tiered", path=shm_dir, target_protocol="s3", target_options=opts)
    assert other is not writer
    blobs = {f"{root}/k{i}": _data(200_000 + i, i) for i in range(6)}

    async def write():
        for k, v in blobs.items():
            await writer._pipe_file(k, v)
    fsspec.asyn.sync(fsspec.asyn.get_loop(), write)
    other.flush()
    tfs, _ = _direct(url, opts)
    assert {k: tfs.cat_file(k) for k in blobs} == blobs


def test_reads_come_from_ram_while_it_holds_the_file(s3_url, shm_dir, tmp_path):
    url, opts = s3_url
    fs, root = _tiered(url, opts, shm_dir)
    data = _data(1 << 20, 3)
    fs.pipe_file(f"{root}/x.bin", data)
    fs.flush()
    # remove the object behind the filesystem's back: reads still succeed, so they are served by RAM
    tfs, _ = _direct(url, opts)
    tfs.rm_file(f"{root}/x.bin")
    before = fs.stats()
    assert fs.cat_file(f"{root}/x.bin") == data
    assert fs.cat_file(f"{root}/x.bin", start=-100) == data[-100:]
    assert fs.cat_ranges([f"{root}/x.bin"] * 2, [0, 10], [5, 20]) == [data[:5], data[10:20]]
    with fs.open(f"{root}/x.bin", "rb") as f:
        f.seek(1000)
        assert f.read(10) == data[1000:1010]
    after = fs.stats()
    assert after["target_reads"] == before["target_reads"]
    assert after["ram_reads"] - before["ram_reads"] == 5  # one per read, ranges included
    # a RAM directory that does not hold the file: reads go to the target
    tfs.pipe_file(f"{root}/y.bin", data)
    cold, _ = _tiered(url, opts, str(tmp_path / "empty-ram"))
    assert cold.cat_file(f"{root}/y.bin") == data
    assert cold.stats()["target_reads"] == 1 and cold.stats()["ram_reads"] == 0


def test_listing_is_the_union_and_rm_removes_everywhere(s3_url, shm_dir):
    url, opts = s3_url
    fs, root = _tiered(url, opts, shm_dir, drain="manual")
    tfs, _ = _direct(url, opts)
    tfs.pipe({f"{root}/remote_only": b"r", f"{root}/both": b"old", f"{root}/d/remote": b"rr"})
    fs.pipe({f"{root}/ram_only": b"m", f"{root}/both": b"new", f"{root}/d/ram": b"mm"})
    names = [f"{root}/{n}" for n in ("both", "d", "ram_only", "remote_only")]
    assert fs.ls(root, detail=False) == names
    assert fs.find(root) == [f"{root}/{n}" for n in ("both", "d/ram", "d/remote", "ram_only", "remote_only")]
    assert fs.glob(f"{root}/d/*") == [f"{root}/d/ram", f"{root}/d/remote"]
    assert fs.info(f"{root}/both")["size"] == 3 and fs.info(f"{root}/both")["tier"] == "ram"
    assert fs.info(f"{root}/remote_only")["tier"] == "target"
    assert fs.cat_file(f"{root}/both") == b"new"
    fs.flush()
    fs.rm(f"{root}/both")
    fs.rm(f"{root}/d", recursive=True)
    tfs.invalidate_cache()
    assert not fs.exists(f"{root}/both") and not tfs.exists(f"{root}/both")
    assert fs.find(root) == [f"{root}/ram_only", f"{root}/remote_only"]
    assert tfs.find(root) == [f"{root}/ram_only", f"{root}/remote_only"]


def test_rewrite_while_uploading_ends_with_the_newest_bytes(s3_url, shm_dir):
    url, opts = s3_url
    fs, root = _tiered(url, opts, shm_dir)
    for i in range(5):
        fs.pipe_file(f"{root}/same", _data(300_000, 10 + i))
    fs.flush()
    tfs, _ = _direct(url, opts)
    assert tfs.cat_file(f"{root}/same") == _data(300_000, 14)


def test_bucket_deleted_surfaces_on_flush_and_nothing_is_reported_durable(s3_url, shm_dir):
    url, opts = s3_url
    fs, root = _tiered(url, opts, shm_dir, drain="manual")
    fs.pipe_file(f"{root}/ok", b"first")
    fs.flush()
    bucket = root.split("/", 1)[0]
    tfs, _ = _direct(url, opts)
    tfs.rm(bucket, recursive=True)  # objects, then the bucket
    assert not tfs.exists(bucket)
    fs.pipe_file(f"{root}/lost", b"second")
    with pytest.raises(BackgroundError) as e:
        fs.flush()
    msg = str(e.value)
    assert "\n" not in msg and "NOT durable" in msg and f"{root}/lost" in msg and "flush() again" in msg
    assert fs.pending() == [f"{root}/lost"]
    ram_file = os.path.join(shm_dir, root, "lost")
    assert stat.S_IMODE(os.stat(ram_file).st_mode) == 0o600  # still marked not durable
    assert fs.cat_file(f"{root}/lost") == b"second"  # the RAM copy is kept
    with pytest.raises(BackgroundError):  # asking again does not turn it durable
        fs.flush()
    tfs.mkdir(bucket)  # the target is back: the next flush uploads it
    fs.flush()
    tfs.invalidate_cache()
    assert tfs.cat_file(f"{root}/lost") == b"second" and fs.pending() == []


def test_stopped_server_surfaces_on_flush(shm_dir):
    """A target that goes away during the drain (a private moto server, stopped): flush() raises."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    opts = {"endpoint_url": f"http://{host}:{port}", "key": "testing", "secret": "testing",
            "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 2}}
    try:
        s3, _ = _direct("s3://stopme", opts)
        s3.mkdir("stopme")
        fs, root = _tiered("s3://stopme/run", opts, shm_dir, drain="manual", retries=1)
        fs.pipe_file(f"{root}/a", b"kept")
        fs.flush()
    finally:
        server.stop()
    fs.pipe_file(f"{root}/b", b"not durable")
    with pytest.raises(BackgroundError, match=r"1 of 1 file\(s\) are NOT durable"):
        fs.flush()
    assert fs.pending() == [f"{root}/b"]
    assert fs.cat_file(f"{root}/a") == b"kept"  # served from RAM while the target is down


def test_budget_evicts_durable_copies_and_refuses_what_cannot_fit(s3_url, shm_dir):
    url, opts = s3_url
    fs, root = _tiered(url, opts, shm_dir, drain="manual", budget=1000, when_full="raise")
    fs.pipe_file(f"{root}/a", b"a" * 600)
    with pytest.raises(CapacityError) as e:
        fs.pipe_file(f"{root}/b", b"b" * 600)
    assert "\n" not in str(e.value) and "budget=" in str(e.value)
    assert not fs.exists(f"{root}/b")
    with pytest.raises(CapacityError):
        fs.pipe_file(f"{root}/big", b"x" * 1001)
    fs.flush()  # a is durable now: it may be evicted to make room
    fs.pipe_file(f"{root}/b", b"b" * 600)
    assert fs.stats()["evictions"] == 1
    assert not os.path.exists(os.path.join(shm_dir, root, "a"))
    assert fs.cat_file(f"{root}/a") == b"a" * 600  # from the target
    assert fs.stats()["target_reads"] == 1


def test_budget_waits_for_the_drain_when_asked(s3_url, shm_dir):
    url, opts = s3_url
    fs, root = _tiered(url, opts, shm_dir, budget=1 << 20)  # background drain, when_full="wait"
    blobs = {f"{root}/f{i}": _data(400_000, 20 + i) for i in range(8)}
    for k, v in blobs.items():
        fs.pipe_file(k, v)
    fs.flush()
    tfs, _ = _direct(url, opts)
    assert {k: tfs.cat_file(k) for k in blobs} == blobs
    assert fs.stats()["evictions"] >= 5


def test_names_cannot_leave_the_ram_directory(shm_dir, tmp_path):
    fs = fsspec.filesystem("tiered", path=shm_dir, target_protocol="file", skip_instance_cache=True)
    for bad in (f"{tmp_path}/../x", f"{tmp_path}/./x", f"{tmp_path}/.tierfs-tmp-1-1"):
        with pytest.raises(ValueError, match="unsafe path"):
            fs.pipe_file(bad, b"x")


def test_listings_never_show_writes_in_flight(tmp_path, shm_dir, monkeypatch):
    """A temporary name is not a file: ls/find/glob/walk leave out writes in flight in RAM, the drain's
    upload to a local target (listed from inside that upload) and what a crashed writer left."""
    from tierfs.util.fileio import is_tmp_name
    from tierfs.fs import upload as _upload

    target = tmp_path / "t"
    fs, root = fsspec.url_to_fs(f"tiered::file://{target}", tiered={"path": shm_dir, "drain": "manual"})
    fs.pipe({f"{root}/a": b"1", f"{root}/d/b": b"2"})
    seen: dict[str, list] = {}

    def spy(path, data, **kwargs):  # the drain's atomic write to the local target, listed mid-write
        def write(f):
            data(f)
            f.flush()
            seen.setdefault("on disk", []).extend(os.listdir(os.path.dirname(path)))
            seen.setdefault("listed", []).append(fs.find(root, withdirs=True))
        real(path, write, **kwargs)
    real = _upload.atomic_write
    monkeypatch.setattr(_upload, "atomic_write", spy)
    fs.flush()
    assert any(is_tmp_name(n) for n in seen["on disk"])  # the upload's temporary name was there...
    assert all(not any(is_tmp_name(p.rsplit("/", 1)[-1]) for p in names) for names in seen["listed"])  # ...unseen
    (target / "d" / ".tierfs-tmp-999999-1").write_bytes(b"left by a crashed writer")
    with fs.open(f"{root}/d/c", "wb") as f:  # in flight in RAM
        f.write(b"3")
        assert fs.ls(f"{root}/d", detail=False) == [f"{root}/d/b"]
        assert fs.find(root) == [f"{root}/a", f"{root}/d/b"]
        assert [p for p in fs.find(root, withdirs=True) if p != root] == [f"{root}/a", f"{root}/d", f"{root}/d/b"]
        assert fs.glob(f"{root}/d/*") == [f"{root}/d/b"]
        assert [files for _, _, files in fs.walk(root)] == [["a"], ["b"]]
    assert fs.ls(f"{root}/d", detail=False) == [f"{root}/d/b", f"{root}/d/c"]


def test_transaction_and_context_manager_flush(tmp_path, shm_dir):
    target = tmp_path / "t"
    fs, root = fsspec.url_to_fs(f"tiered::file://{target}", tiered={"path": shm_dir, "drain": "manual"})
    with fs.transaction:
        with fs.open(f"{root}/in-tx", "wb") as f:
            f.write(b"tx")
        assert not fs.exists(f"{root}/in-tx")  # deferred until the transaction commits
    assert (target / "in-tx").read_bytes() == b"tx"
    with fs:
        fs.pipe_file(f"{root}/in-with", b"w")
    assert (target / "in-with").read_bytes() == b"w"
    with pytest.raises(RuntimeError):
        with fs.open(f"{root}/failed", "wb") as f:
            f.write(b"half")
            raise RuntimeError("boom")
    assert not fs.exists(f"{root}/failed")  # an interrupted write never becomes a file


def test_registered_under_tiered_in_a_fresh_interpreter(s3_url, tmp_path):
    """The fsspec.specs entry point: a new process finds the protocol by name alone."""
    url, opts = s3_url
    ram = str(tmp_path / "ram")
    code = (
        "import fsspec, json, sys\n"
        "opts = json.loads(sys.argv[1])\n"
        f"fs, root = fsspec.url_to_fs('tiered::{url}', tiered={{'path': {ram!r}}}, s3=opts)\n"
        "fs.pipe_file(root + '/from-child', b'child')\n"
        "fs.flush()\n"
        "print(type(fs).__module__, type(fs).__name__, root)\n"
        # options from the environment (FSSPEC_<PROTOCOL>[_<KWARG>]), as DCP's url_to_fs(id) needs them
        f"fs2, _ = fsspec.url_to_fs('tiered::{url}')\n"
        "assert fs2.cat_file(root + '/from-child') == b'child' and fs2.stats()['ram_reads'] >= 1\n"
    )
    import json

    env = {**os.environ, "FSSPEC_TIERED_PATH": ram, "FSSPEC_TIERED_BUDGET": str(64 << 20),
           "FSSPEC_S3": json.dumps(opts)}
    out = subprocess.run([sys.executable, "-c", code, json.dumps(opts)], capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["tierfs.fs.filesystem", "TieredFileSystem", url.split("://", 1)[1]]
    tfs, _ = _direct(url, opts)
    assert tfs.cat_file(url + "/from-child") == b"child"


# -- an existing pipeline, changed only in its URL ------------------------------------------------------
def export_parts(url: str, rows: list[str], **storage_options) -> None:
    """A pipeline as found in the wild: one text file per part, through fsspec.open."""
    for i, row in enumerate(rows):
        with fsspec.open(f"{url}/part-{i:03d}.csv", "w", **storage_options) as f:
            f.write(row)


def test_a_plain_fsspec_open_loop_gains_the_ram_tier_by_its_url_alone(s3_url, shm_dir, monkeypatch):
    url, opts = s3_url
    rows = [f"id,value\n{i},{i * i}\n" for i in range(20)]
    monkeypatch.setitem(fsspec.config.conf, "tiered", {"path": shm_dir})  # or tiered={...} per call
    export_parts(f"tiered::{url}", rows, s3=opts)  # was: export_parts(url, rows, **opts)
    fs, root = fsspec.url_to_fs(f"tiered::{url}", s3=opts)
    fs.flush()
    tfs, _ = _direct(url, opts)
    assert [tfs.cat_file(f"{root}/part-{i:03d}.csv").decode() for i in range(20)] == rows
    assert len(os.listdir(os.path.join(shm_dir, root))) == 20  # and RAM still holds them for reads


# -- DCP's own FsspecWriter / FsspecReader with a tiered:: checkpoint id ------------------------------
def _dcp_state(torch):
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(256, 64, generator=g), "b": torch.randn(64, generator=g).to(torch.bfloat16),
            "step": torch.tensor(7), "ids": torch.randint(0, 1 << 30, (1000,), generator=g)}


def _bits(t):
    return t.reshape(-1).view(__import__("torch").uint8)


@pytest.mark.parametrize("backend", ["file", "s3"])
def test_dcp_fsspec_writer_with_a_tiered_id(backend, request, tmp_path, monkeypatch):
    """DCP rebuilds its filesystem from the checkpoint id (``url_to_fs(id)``), so options come from
    fsspec's config: ``fsspec.config.conf["tiered"]`` for the RAM tier and ``conf["s3"]`` for the target."""
    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    if backend == "s3":
        url, opts = request.getfixturevalue("s3_url")
        monkeypatch.setitem(fsspec.config.conf, "s3", opts)
    else:
        url, opts = f"file://{tmp_path}/target", {}
    ckpt = f"tiered::{url}/ckpt/step_1"
    ram1, ram2 = tmp_path / "ram-node1", tmp_path / "ram-node2"
    monkeypatch.setitem(fsspec.config.conf, "tiered", {"path": str(ram1)})
    state = _dcp_state(torch)
    dcp.save(state, storage_writer=FsspecWriter(ckpt, thread_count=2))
    fs, root = fsspec.url_to_fs(ckpt)
    assert isinstance(fs, TieredFileSystem)
    fs.flush()  # durable on the target
    direct, troot = _direct(url + "/ckpt/step_1", opts)
    assert ".metadata" in [p.rsplit("/", 1)[-1] for p in direct.ls(troot, detail=False)]
    # a new node: empty RAM, everything comes from the target
    monkeypatch.setitem(fsspec.config.conf, "tiered", {"path": str(ram2)})
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(out, storage_reader=FsspecReader(ckpt))
    assert all(torch.equal(_bits(out[k]), _bits(v)) for k, v in state.items())  # bit-exact
    fs2, _ = fsspec.url_to_fs(ckpt)
    assert fs2.stats()["ram_reads"] == 0 and fs2.stats()["target_reads"] > 0
    # the first node still holds it in RAM and serves DCP from there
    monkeypatch.setitem(fsspec.config.conf, "tiered", {"path": str(ram1)})
    before = fs.stats()
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(out, storage_reader=FsspecReader(ckpt))
    assert all(torch.equal(_bits(out[k]), _bits(v)) for k, v in state.items())
    assert fs.stats()["target_reads"] == before["target_reads"]


def test_chained_options_follow_fsspec_conventions(tmp_path, shm_dir):
    target = tmp_path / "t"
    target.mkdir()
    by_fo = fsspec.filesystem("tiered", fo=f"file://{target}", path=shm_dir, skip_instance_cache=True)
    by_proto = fsspec.filesystem("tiered", target_protocol="file", path=shm_dir, skip_instance_cache=True)
    by_fs = fsspec.filesystem("tiered", fs=fsspec.filesystem("file"), path=shm_dir, skip_instance_cache=True)
    for fs in (by_fo, by_proto, by_fs):
        assert fs.target.protocol[0] in ("file", "local")
    assert by_fo.drain is by_proto.drain is by_fs.drain  # one drain per RAM directory and target
    by_fo.pipe_file(f"{target}/x", b"1")
    by_proto.flush()  # the same RAM directory and target: one drain
    assert (target / "x").read_bytes() == b"1"
    with pytest.raises(ValueError, match="needs a target"):
        fsspec.filesystem("tiered", path=shm_dir, skip_instance_cache=True)
    with pytest.raises(ValueError, match="drain must be"):
        fsspec.filesystem("tiered", target_protocol="file", path=shm_dir, drain="sometimes",
                          skip_instance_cache=True)
