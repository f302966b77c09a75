"""Work left at interpreter exit is finished there, within ``exit_timeout``; a failed constructor leaves
nothing behind.

Each exit test runs a real child interpreter that writes through ``tiered::`` (or saves with a store or a
manager left open) and exits without ``flush()``/``close()``; the parent then reads the target directly.
Transfers that must outlast the bound are held back by the bandwidth throttle: a burst of 64 MiB passes,
the rest waits for hours at 1 kB/s, so the bound always passes first.
"""

from __future__ import annotations

import gc
import json
import os
import stat
import subprocess
import sys
import textwrap
import threading
import weakref
from pathlib import Path

import fsspec
import numpy as np
import pytest

from tierfs import CheckpointManager, TieredStore
from tierfs.util import exitwork as _exit
from tierfs.errors import ArgumentError, TierfsError, TierUnavailableError
from tierfs.tiers import MemoryTier, ObjectTier, PeerTier

MiB = 1 << 20
SLOW = 1000.0  # bytes/s: whatever passes the throttle's burst waits for hours
CHILD_TIMEOUT = 300  # generous: only "it exits" is checked, never how fast


def _data(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def _state(seed: int, n: int = 1 << 16) -> dict[str, np.ndarray]:
    return {"w": np.random.default_rng(seed).standard_normal(n).astype(np.float32),
            "b": np.arange(seed, seed + 7, dtype=np.int64)}


def _child(code: str, *args: str, env: dict[str, str] | None = None,
           status: int = 0) -> subprocess.CompletedProcess:
    """Run ``code`` (with ``args`` in ``sys.argv[1:]``) in a fresh interpreter that exits with ``status`` (1:
    its work at exit failed or outlasted the bound); it must never print a traceback."""
    prelude = textwrap.dedent("""
        import json, os, sys
        import numpy as np
        def _data(n, seed):
            return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()
        def _state(seed, n=1 << 16):
            return {"w": np.random.default_rng(seed).standard_normal(n).astype(np.float32),
                    "b": np.arange(seed, seed + 7, dtype=np.int64)}
    """)
    out = subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code), *args], capture_output=True, text=True,
                         timeout=CHILD_TIMEOUT, env={**os.environ, **(env or {})})
    assert out.returncode == status, out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    return out


def _lost_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "NOT durable" in line]


FILES = {"a.bin": (3 * MiB + 17, 1), "sub/b.bin": (1, 2), "sub/deeper/c.bin": (256 * 1024, 3), "empty.bin": (0, 4)}

WRITE_FILES = """
    import fsspec
    url, opts, files = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
    fs, root = fsspec.url_to_fs(url, **opts)
    for name, (n, seed) in files.items():
        with fsspec.open(f"{url}/{name}", "wb", **opts) as f:  # as pandas' to_csv/to_parquet do
            f.write(_data(n, seed))
    with fsspec.open(f"{url}/table.csv", "w", **opts) as f:
        f.write("id,value\\n" + "".join(f"{i},{i * i}\\n" for i in range(1000)))
    print("written, not flushed")
"""


def _write_files(url: str, opts: dict, files: dict = FILES, env: dict[str, str] | None = None, status: int = 0
                 ) -> subprocess.CompletedProcess:
    return _child(WRITE_FILES, url, json.dumps(opts), json.dumps(files), env=env, status=status)


def _expected_table() -> str:
    return "id,value\n" + "".join(f"{i},{i * i}\n" for i in range(1000))


# -- tiered:: ---------------------------------------------------------------------------------------
def test_tiered_files_reach_a_file_target_at_exit(shm_dir, tmp_path):
    target = tmp_path / "target"
    out = _write_files(f"tiered::file://{target}", {"tiered": {"path": shm_dir}})
    assert "written, not flushed" in out.stdout
    assert not _lost_lines(out.stderr), out.stderr
    for name, (n, seed) in FILES.items():
        assert (target / name).read_bytes() == _data(n, seed), name  # bit-exact
    assert (target / "table.csv").read_text() == _expected_table()
    ram = Path(shm_dir) / str(target).lstrip("/")
    for name in [*FILES, "table.csv"]:  # each RAM copy is marked durable (read-only)
        assert stat.S_IMODE((ram / name).stat().st_mode) == 0o400, name


def test_tiered_files_reach_s3_at_exit(s3_url, shm_dir):
    url, opts = s3_url
    out = _write_files(f"tiered::{url}", {"tiered": {"path": shm_dir}, "s3": opts})
    assert not _lost_lines(out.stderr), out.stderr
    s3 = fsspec.filesystem("s3", skip_instance_cache=True, **opts)
    for name, (n, seed) in FILES.items():
        assert s3.cat_file(f"{url}/{name}") == _data(n, seed), name
    assert s3.cat_file(f"{url}/table.csv").decode() == _expected_table()


def test_a_manual_drain_is_finished_at_exit_with_progress_lines(shm_dir, tmp_path):
    """Two files of 40 MiB at 10 MB/s: the second waits for the first one's bytes to be due (over 4 s),
    so the exit waits past a second and says what is left."""
    target = tmp_path / "target"
    files = {"x.bin": (40 * MiB, 5), "y.bin": (40 * MiB, 6)}
    out = _write_files(f"tiered::file://{target}", {"tiered": {"path": shm_dir, "drain": "manual",
                                                             "drain_bandwidth": 10e6}}, files)
    progress = [line for line in out.stderr.splitlines() if "finishing at exit" in line]
    assert progress and "not yet on file://" in progress[0] and "MiB" in progress[0], out.stderr
    assert not _lost_lines(out.stderr), out.stderr
    for name, (n, seed) in files.items():
        assert (target / name).read_bytes() == _data(n, seed), name


@pytest.mark.parametrize("how", ["option", "fsspec config", "environment"])
def test_opting_out_leaves_the_files_in_ram_with_one_warning(shm_dir, tmp_path, how):
    target = tmp_path / "target"
    tiered: dict = {"path": shm_dir, "drain": "manual"}  # nothing uploads before the exit
    env = {}
    if how == "option":
        tiered["exit_timeout"] = 0
    elif how == "fsspec config":
        env["FSSPEC_TIERED_EXIT_TIMEOUT"] = "0"
    else:
        env["TIERFS_EXIT_TIMEOUT"] = "0"
    out = _write_files(f"tiered::file://{target}", {"tiered": tiered}, env=env)
    lost = _lost_lines(out.stderr)
    assert len(lost) == 1, out.stderr
    assert "exit_timeout is 0" in lost[0] and f"remain in RAM at {shm_dir}" in lost[0]
    assert f"{len(FILES) + 1} file(s)" in lost[0]
    assert not target.exists() or not any(p.is_file() for p in target.rglob("*"))
    ram = Path(shm_dir) / str(target).lstrip("/")
    for name, (n, seed) in FILES.items():  # still in RAM, writable: not yet durable
        assert (ram / name).read_bytes() == _data(n, seed)
        assert (ram / name).stat().st_mode & stat.S_IWUSR
    # the next process using the RAM directory and target uploads them
    _child(f"""
        import fsspec
        fs, _ = fsspec.url_to_fs("tiered::file://{target}", tiered={{"path": {shm_dir!r}}})
        fs.flush()
    """)
    for name, (n, seed) in FILES.items():
        assert (target / name).read_bytes() == _data(n, seed), name


def test_a_bound_too_short_exits_with_one_warning_naming_what_is_not_durable(shm_dir, tmp_path):
    target = tmp_path / "target"
    files = {"x.bin": (40 * MiB, 7), "y.bin": (40 * MiB, 8)}  # one passes the burst, the other waits
    out = _write_files(f"tiered::file://{target}", {"tiered": {"path": shm_dir, "drain_bandwidth": SLOW,
                                                             "exit_timeout": 1}}, files, status=1)
    lost = _lost_lines(out.stderr)
    assert len(lost) == 1, out.stderr
    assert "exit_timeout (1 s) passed" in lost[0] and f"remain in RAM at {shm_dir}" in lost[0]
    assert f"file://{target}" in lost[0]
    named = Path(lost[0].split("(e.g. ", 1)[1].split(")", 1)[0])  # one of the files not durable
    assert named.parent == target and not named.exists(), out.stderr
    ram = Path(shm_dir) / str(target).lstrip("/")
    assert (ram / named.name).stat().st_mode & stat.S_IWUSR  # not marked durable: the next process uploads it
    missing = [name for name in files if not (target / name).exists()]
    assert missing, out.stderr
    for name in missing:
        assert (ram / name).read_bytes() == _data(*files[name])


def test_an_upload_failing_at_exit_is_one_warning(shm_dir, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_bytes(b"")  # the target directory cannot be made below a file
    out = _write_files(f"tiered::file://{blocker}/target", {"tiered": {"path": shm_dir, "drain": "manual"}},
                       status=1)
    lost = _lost_lines(out.stderr)
    assert len(lost) == 1, out.stderr
    assert "upload(s)" in lost[0] and "failed" in lost[0] and f"remain in RAM at {shm_dir}" in lost[0]


def test_exit_timeout_option_is_checked():
    with pytest.raises(ArgumentError, match="exit_timeout"):
        fsspec.filesystem("tiered", path="/dev/shm/tierfs-never-made", target_protocol="memory", exit_timeout=-1,
                          skip_instance_cache=True)
    with pytest.raises(ArgumentError, match="exit_timeout"):
        _exit.exit_seconds("soon")
    assert _exit.exit_seconds("2.5") == 2.5 and _exit.exit_seconds(0) == 0.0


# -- TieredStore and CheckpointManager left open ----------------------------------------------------
STORE_LEFT_OPEN = """
    from tierfs import TieredStore
    from tierfs.tiers import MemoryTier, ObjectTier
    store = TieredStore([MemoryTier({ram!r}), ObjectTier({url!r})]{kwargs})
    for step in (1, 2):
        store.save(step, _state(step), blocking=False)
    print("saved, not closed")
"""


def test_a_store_left_open_commits_its_steps_on_the_object_tier_at_exit(shm_dir, tmp_path):
    url = f"file://{tmp_path / 'obj'}"
    out = _child(STORE_LEFT_OPEN.format(ram=shm_dir, url=url, kwargs=""))
    assert "saved, not closed" in out.stdout and not _lost_lines(out.stderr), out.stderr
    with TieredStore([ObjectTier(url)]) as store:
        assert store.steps() == {1: ["file"], 2: ["file"]}
        for step in (1, 2):
            state, _ = store.restore(step)
            for k, v in _state(step).items():
                assert state[k].tobytes() == v.tobytes()  # bit-exact
    assert not list(Path(shm_dir).glob(".pool.*"))  # the store was closed after its work


def test_a_manager_left_open_commits_its_step_on_the_object_tier_at_exit(shm_dir, tmp_path):
    obj = tmp_path / "obj"
    out = _child(f"""
        from tierfs import CheckpointManager
        from tierfs.tiers import MemoryTier, ObjectTier
        mgr = CheckpointManager([MemoryTier({shm_dir!r}), ObjectTier("file://{obj}")])
        mgr.save(3, _state(3))
    """)
    assert not _lost_lines(out.stderr), out.stderr
    with CheckpointManager(directory=str(obj)) as mgr:
        assert mgr.all_steps() == [3]
        state = mgr.restore()
        for k, v in _state(3).items():
            assert state[k].tobytes() == v.tobytes()


@pytest.mark.parametrize("bound", [0, 1])
def test_a_store_whose_copy_outlasts_the_bound_exits_with_one_warning(shm_dir, tmp_path, bound):
    """80 MiB at 1 kB/s: the copy never ends; exit_timeout=0 does not wait, 1 waits a second."""
    url = f"file://{tmp_path / 'obj'}"
    out = _child(f"""
        from tierfs import TieredStore
        from tierfs.tiers import MemoryTier, ObjectTier
        store = TieredStore([MemoryTier({shm_dir!r}), ObjectTier({url!r})], background_bandwidth={SLOW},
                            exit_timeout={bound})
        store.save(1, {{"big": np.arange(20 << 20, dtype=np.float32)}})  # committed in RAM, then copied
    """, status=0 if bound == 0 else 1)
    lost = _lost_lines(out.stderr)
    assert len(lost) == 1, out.stderr
    assert ("exit_timeout is 0" if bound == 0 else "exit_timeout (1 s) passed") in lost[0]
    assert f"step 1 is NOT durable on tier 'file' ({url})" in lost[0]
    assert f"committed only in the RAM tier at {shm_dir}" in lost[0]
    with TieredStore([MemoryTier(shm_dir), ObjectTier(url)], cleanup=False) as store:
        assert store.steps() == {1: ["ram"]}  # committed in RAM, not on the object tier


def test_a_copy_failing_before_exit_is_one_warning(shm_dir, tmp_path):
    obj = tmp_path / "obj"
    out = _child(f"""
        import shutil
        from tierfs import TieredStore
        from tierfs.tiers import MemoryTier, ObjectTier
        store = TieredStore([MemoryTier({shm_dir!r}), ObjectTier("file://{obj}", retries=1)])
        shutil.rmtree({str(obj)!r})
        open({str(obj)!r}, "w").close()  # the object tier's root is now a file: the copy fails
        store.save(1, _state(1))
    """, status=1)
    lost = _lost_lines(out.stderr)
    assert len(lost) == 1, out.stderr
    assert "background copy failed" in lost[0] and f"RAM tier stay at {shm_dir}" in lost[0]


def test_closed_stores_are_not_finished_again_and_registering_keeps_none_alive(shm_dir, tmp_path):
    store = TieredStore([MemoryTier(shm_dir), ObjectTier(f"file://{tmp_path / 'obj'}")], exit_timeout=5)
    assert store in _exit._registry and store.exit_timeout == 5.0
    store.save(1, _state(1))
    store.close()
    assert store not in _exit._registry
    ref = weakref.ref(TieredStore([MemoryTier(shm_dir)]))
    gc.collect()
    assert ref() is None


def test_a_store_closed_before_exit_is_left_alone(shm_dir, tmp_path):
    url = f"file://{tmp_path / 'obj'}"
    out = _child(f"""
        from tierfs import TieredStore
        from tierfs.tiers import MemoryTier, ObjectTier
        store = TieredStore([MemoryTier({shm_dir!r}), ObjectTier({url!r})], exit_timeout=0)
        store.save(1, _state(1))
        store.close()
    """)
    assert out.stderr.strip() == "", out.stderr
    with TieredStore([ObjectTier(url)]) as store:
        assert store.steps() == {1: ["file"]}


# -- a failed constructor leaves nothing behind -----------------------------------------------------
def _no_bucket(s3_url) -> ObjectTier:
    url, opts = s3_url
    return ObjectTier("s3://no-such-bucket-here/run", opts)


def test_a_store_that_cannot_reach_its_object_tier_removes_the_ram_directory_it_made(shm_dir, s3_url):
    new = Path(shm_dir) / "job" / "ram"
    with pytest.raises(TierUnavailableError, match="does not exist"):
        TieredStore([MemoryTier(new), _no_bucket(s3_url)])
    assert not (Path(shm_dir) / "job").exists()
    assert Path(shm_dir).is_dir()  # it existed before: it stays


def test_a_failure_after_the_tiers_opened_removes_their_new_directories(shm_dir, tmp_path):
    ram, obj = Path(shm_dir) / "new-ram", tmp_path / "new" / "obj"
    with pytest.raises(TierfsError, match="PeerTier needs a job of several processes"):  # after both opened
        TieredStore([MemoryTier(ram), PeerTier(), ObjectTier(f"file://{obj}")])
    assert not ram.exists() and not (tmp_path / "new").exists()
    assert tmp_path.is_dir()


def test_a_failed_constructor_keeps_a_directory_that_existed_with_its_contents(shm_dir, s3_url):
    Path(shm_dir, "notes.txt").write_text("mine")
    with TieredStore([MemoryTier(shm_dir)]) as store:
        store.save(1, _state(1))
    with pytest.raises(TierUnavailableError):
        TieredStore([MemoryTier(shm_dir), _no_bucket(s3_url)])
    assert Path(shm_dir, "notes.txt").read_text() == "mine"
    assert not list(Path(shm_dir).glob(".pool.*"))
    with TieredStore([MemoryTier(shm_dir)]) as store:
        assert store.steps() == {1: ["ram"]}


def test_a_manager_that_fails_after_its_store_opened_closes_it_and_removes_its_directory(shm_dir):
    ram = Path(shm_dir) / "mgr" / "ram"
    errors: list[BaseException] = []

    def make() -> None:  # SIGTERM handlers can be installed from the main thread only
        try:
            CheckpointManager([MemoryTier(ram)], handle_sigterm=True)
        except BaseException as e:  # noqa: BLE001 - checked below
            errors.append(e)
    t = threading.Thread(target=make)
    t.start()
    t.join()
    assert len(errors) == 1 and isinstance(errors[0], ValueError)
    assert not (Path(shm_dir) / "mgr").exists()
    assert not [o for o in _exit._registry if isinstance(o, TieredStore) and o._ctx.first.location == str(ram)]
