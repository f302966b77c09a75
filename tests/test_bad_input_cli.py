"""Bad input at the command line and in tier directories: one clear line, never a traceback.

Every ``tierfs`` command answers bad input with exit status 2 (usage) or 1 and one line ``tierfs: error:
...`` on stderr. A tier directory that is a system directory is refused and left untouched, a shared
(sticky) one is refused, one the user cannot write is one clear error, and one off tmpfs works with a
warning.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import stat
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest

from tierfs import ArgumentError, TieredStore, TierUnavailableError
from tierfs.cli import main
from tierfs.fs import TieredFileSystem
from tierfs.tiers import MemoryTier

sys.path.insert(0, str(Path(__file__).parent))
from _badinput import ENTRY_SYNTAX, SYSTEM_DIRS, Ctx, assert_clear, context, small_state  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


@pytest.fixture
def ctx(shm_dir, tmp_path):
    yield from context(shm_dir, tmp_path)


def test_system_directories_are_left_untouched():
    before = {d: os.stat(d).st_mode for d in SYSTEM_DIRS}
    for d in SYSTEM_DIRS:
        with pytest.raises(ArgumentError):
            MemoryTier(d)
    assert {d: os.stat(d).st_mode for d in SYSTEM_DIRS} == before


def test_shared_directory_is_refused(shm_dir):
    shared = Path(shm_dir) / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    with pytest.raises(ArgumentError) as info:
        TieredStore([MemoryTier(shared)])
    assert_clear(info.value, ArgumentError, str(shared), "shared directory", "below it")
    assert stat.S_IMODE(shared.stat().st_mode) == 0o1777  # not made private


def test_not_writable_directory_is_one_clear_error():
    """A directory this user cannot write is one clear error when the store opens the tier. Root may write
    anywhere, so as root the tier is opened (what ``TieredStore`` does first) in a child that drops to
    ``nobody``; the directory is on /dev/shm, which ``nobody`` can enter."""
    parent = Path("/dev/shm") / f"tierfs-ro-{os.getpid()}"
    parent.mkdir(mode=0o755)
    os.chmod(parent, 0o755)
    try:
        target = parent / "job"
        if os.geteuid() != 0:
            os.chmod(parent, 0o555)
            with pytest.raises(TierUnavailableError) as info:
                TieredStore([MemoryTier(target)])
            kind, msg = type(info.value).__name__, str(info.value)
        else:
            kind, msg = _as_nobody(lambda: MemoryTier(target).open())
        assert kind == "TierUnavailableError", (kind, msg)
        assert "\n" not in msg and "not writable" in msg and str(target) in msg
        assert not target.exists()
    finally:
        os.chmod(parent, 0o755)
        os.rmdir(parent)


def _as_nobody(fn: Callable[[], Any], timeout: float = 60.0) -> tuple[str, str]:
    """``(exception class name, message)`` of ``fn()`` run in a forked child as user nobody (killed after
    ``timeout`` seconds: a child of a threaded process must not hang the suite)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report and leave at once, whatever happens
        try:
            os.close(r)
            os.setgid(65534)
            os.setuid(65534)
            try:
                fn()
                out = "none:no error"
            except BaseException as e:  # noqa: BLE001 - reported to the parent
                out = f"{type(e).__name__}:{e}"
            os.write(w, out.encode())
        finally:
            os._exit(0)
    os.close(w)
    data = b""
    deadline = time.monotonic() + timeout
    try:
        while select.select([r], [], [], max(0.0, deadline - time.monotonic()))[0]:
            chunk = os.read(r, 65536)
            if not chunk:
                break
            data += chunk
        else:
            os.kill(pid, signal.SIGKILL)
    finally:
        os.close(r)
        os.waitpid(pid, 0)
    kind, _, msg = data.decode().partition(":")
    return kind, msg


def test_a_disk_directory_works_with_a_warning(tmp_path, caplog):
    from tierfs.tiers.rootdir import filesystem_type

    if filesystem_type(tmp_path) in ("tmpfs", "ramfs"):
        pytest.skip("tmp_path is on tmpfs here")
    caplog.set_level(logging.WARNING, logger="tierfs")
    with TieredStore([MemoryTier(tmp_path / "ram")]) as store:
        assert store.save(1, small_state())
        state, info = store.restore()
        assert info.step == 1 and np.array_equal(state["w"], small_state()["w"])
    warned = [r.getMessage() for r in caplog.records if "not tmpfs" in r.getMessage()]
    assert warned and str(tmp_path / "ram") in warned[0] and "/dev/shm" in warned[0]
    caplog.clear()
    fs = TieredFileSystem(str(tmp_path / "fsram"), fo=f"file://{tmp_path}/t", skip_instance_cache=True)
    fs.pipe(f"{tmp_path}/t/a.bin", b"abc")
    fs.flush()
    assert fs.cat(f"{tmp_path}/t/a.bin") == b"abc"
    assert any("not tmpfs" in r.getMessage() for r in caplog.records)


# -- the command line ---------------------------------------------------------------------------------
def _ram_dir(c: Ctx) -> str:
    c.store.close()
    return str(c.shm / "ram")


CLI_CASES = [
    pytest.param(lambda c: ["ls", "/proc"], 2, ["/proc", "system directory"], id="ls-proc"),
    pytest.param(lambda c: ["verify", "/etc"], 2, ["/etc", "system directory"], id="verify-etc"),
    pytest.param(lambda c: ["verify", "/"], 2, ["system directory"], id="verify-root"),
    pytest.param(lambda c: ["gc", "/usr", "--keep", '{"latest": 1}'], 2, ["/usr"], id="gc-usr"),
    pytest.param(lambda c: ["verify", _ram_dir(c), "--step", "-1"], 2, ["--step", "-1"], id="verify-step-negative"),
    pytest.param(lambda c: ["verify", _ram_dir(c), "--step", "10000000000000"], 2, ["--step", "999999999999"],
                 id="verify-step-too-large"),
    pytest.param(lambda c: ["verify", _ram_dir(c), "--step", "seven"], 2, ["--step", "seven"], id="verify-step-str"),
    pytest.param(lambda c: ["cp", _ram_dir(c), str(c.tmp / "out"), "--step", "-3"], 2, ["--step"], id="cp-step"),
    pytest.param(lambda c: ["cp", _ram_dir(c), "/etc"], 2, ["DEST", "/etc", "system directory"], id="cp-to-etc"),
    pytest.param(lambda c: ["cp", _ram_dir(c), "tiered::file:///tmp", "-O", f'tiered={{"path": "{c.tmp}/t"}}'], 2,
                 ["DEST", "/tmp", "system directory"], id="cp-to-chained-tmp"),
    pytest.param(lambda c: ["cp", _ram_dir(c), "file:///usr"], 2, ["DEST", "/usr"], id="cp-to-usr-url"),
    pytest.param(lambda c: ["gc", "file:///etc", "--keep", '{"latest": 1}'], 2, ["/etc"], id="gc-etc-url"),
    pytest.param(lambda c: ["ls", str(c.a_file)], 1, ["is a file"], id="ls-a-file"),
    pytest.param(lambda c: ["ls", str(c.shm / "nothing-here")], 1, ["no such directory"], id="ls-missing"),
    pytest.param(lambda c: ["verify", _ram_dir(c), "--tier", "s3"], 2, ["'s3'"], id="verify-unknown-tier"),
    pytest.param(lambda c: ["gc", _ram_dir(c), "--keep", '{"latest": 0}'], 2, ["--keep", "latest"], id="gc-keep"),
    pytest.param(lambda c: ["gc", _ram_dir(c), "--keep", "[1"], 2, ["--keep"], id="gc-keep-json"),
    pytest.param(lambda c: ["export", _ram_dir(c), str(c.tmp / "out")], 2, ["--dcp"], id="export-no-format"),
    pytest.param(lambda c: ["export", _ram_dir(c), str(c.tmp / "out"), "--dcp", "--step", "-2"], 2, ["--step"],
                 id="export-step"),
    pytest.param(lambda c: ["export", "/sys", str(c.tmp / "out"), "--dcp"], 2, ["/sys"], id="export-sys"),
    pytest.param(lambda c: ["plan", "--params", "70B"], 2, ["--hosts"], id="plan-no-hosts"),
    pytest.param(lambda c: ["plan", "--params", "lots", "--hosts", "2"], 2, ["lots"], id="plan-bad-count"),
    pytest.param(lambda c: ["simulate", "--params", "7B", "--hosts", "2"], 2, ["--mttf"], id="simulate-no-mttf"),
    pytest.param(lambda c: ["bench", "--ram-dir", "/dev", "--size", "1MB"], 2, ["/dev", "system directory"],
                 id="bench-ram-dir-dev"),
    pytest.param(lambda c: ["bench", "--ram-dir", str(c.a_file), "--size", "1MB"], 1, ["is a file"],
                 id="bench-ram-dir-file"),
    pytest.param(lambda c: ["frobnicate"], 2, ["frobnicate"], id="unknown-command"),
]


@pytest.mark.parametrize("argv, code, needles", CLI_CASES)
def test_cli_bad_input_is_one_line(ctx, capsys, argv, code, needles):
    args = argv(ctx)
    capsys.readouterr()
    got = main(args)
    out, err = capsys.readouterr()
    assert got == code, (got, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tierfs: error: "), err
    assert "Traceback" not in err + out
    for n in needles:
        assert n in lines[0], (n, lines[0])
    assert not ENTRY_SYNTAX.search(lines[0])


def test_cli_unexpected_error_is_one_line(monkeypatch, capsys, shm_dir):
    """A bug inside a command still comes out as one line (TIERFS_DEBUG=1 shows the traceback)."""
    from tierfs.cli import inspect

    def boom(tier):
        raise KeyError("surprise")
    monkeypatch.setattr(inspect, "list_tier", boom)
    monkeypatch.delenv("TIERFS_DEBUG", raising=False)
    TieredStore([MemoryTier(shm_dir)]).close()
    assert main(["ls", shm_dir]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unexpected KeyError" in err and "TIERFS_DEBUG" in err


@pytest.mark.parametrize("config, needles", [("missing.json", ["cannot be read", "missing.json"]),
                                             ("not-json.json", ["not a JSON file"])])
def test_export_checks_its_config_before_writing_anything(ctx, capsys, config, needles):
    """``export --safetensors --config`` reads and checks the config first: a bad one leaves DIR as it was."""
    (ctx.tmp / "not-json.json").write_text("hidden_size = 8\n")
    out = ctx.tmp / "export"
    capsys.readouterr()
    assert main(["export", _ram_dir(ctx), str(out), "--safetensors", "--config", str(ctx.tmp / config)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("tierfs: error: ") and all(n in err for n in needles), err
    assert not out.exists()
