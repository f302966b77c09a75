"""End-to-end tests of the ``tierfs`` command on real checkpoints (RAM tier on /dev/shm, moto S3)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import gloo_job
from tierfs import TieredStore
from tierfs.cli import main
from tierfs.format import MARKER, manifest_filename, step_dirname
from tierfs.format.keys import key as object_key
from tierfs.policies import FixedIntervalPolicy, PreserveAll
from tierfs.tiers import MemoryTier, ObjectTier

HERE = Path(__file__).resolve().parent
CHILDREN = HERE / "children"
REPO = HERE.parent


def state(step: int) -> dict:
    rng = np.random.default_rng(step)
    return {
        "weights": rng.standard_normal(5000).astype(np.float32),
        "opt": {"m": rng.standard_normal((40, 30)), "lr": 0.01},
        "step": step,
    }


def make_ram_checkpoints(path: str, steps=(1, 2, 3)) -> None:
    with TieredStore([MemoryTier(path, keep=PreserveAll())]) as store:
        for s in steps:
            store.save(s, state(s))


def flip_byte(path: Path, offset: int = 0) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x01]))


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def rows(out: str) -> dict[int, list[str]]:
    """``{step: columns}`` of the step rows in ``ls`` output."""
    table = {}
    for line in out.splitlines():
        cols = line.split()
        if cols and cols[0].isdigit():
            table[int(cols[0])] = cols
    return table


# -- ls ---------------------------------------------------------------------------------------------

def test_ls_lists_steps_and_marks_partial_without_deleting_it(shm_dir, capsys):
    make_ram_checkpoints(shm_dir)
    os.remove(Path(shm_dir) / step_dirname(2) / MARKER)

    code, out, err = run(capsys, "ls", shm_dir)

    assert code == 0, err
    assert err == ""
    assert "tier ram (memory" in out
    table = rows(out)
    assert sorted(table) == [1, 2, 3]
    assert table[1][1] == "committed" and table[3][1] == "committed"
    assert table[2][1] == "partial"
    # committed: shard + manifest + marker, world size 1; partial: no marker, no world size
    assert table[3][2] == "3" and table[3][5] == "1"
    assert table[2][2] == "2" and table[2][5] == "-"
    assert "KiB" in out
    # listing must leave the partial step alone (a TieredStore would have removed it)
    assert (Path(shm_dir) / step_dirname(2) / manifest_filename(0)).exists()
    assert not (Path(shm_dir) / step_dirname(2) / MARKER).exists()


def test_ls_sizes_match_the_files(shm_dir, capsys):
    make_ram_checkpoints(shm_dir, steps=(7,))
    d = Path(shm_dir) / step_dirname(7)
    total = sum(p.stat().st_size for p in d.iterdir())
    code, out, _ = run(capsys, "ls", shm_dir)
    assert code == 0
    cols = rows(out)[7]
    size = float(cols[3])
    assert cols[4] == "KiB"
    assert abs(size * 1024 - total) <= 0.05 * 1024


def test_ls_empty_tier(shm_dir, capsys):
    code, out, err = run(capsys, "ls", shm_dir)
    assert code == 0, err
    assert "(no steps)" in out


def test_ls_and_verify_s3_url_and_config(shm_dir, s3_url, tmp_path, capsys):
    url, opts = s3_url
    tiers = [MemoryTier(shm_dir, keep=PreserveAll()),
             ObjectTier(url, opts, save=FixedIntervalPolicy(2), name="s3")]
    with TieredStore(tiers) as store:
        for s in (1, 2, 3, 4):
            store.save(s, state(s))
        store.wait_until_finished()

    # a URL target, storage options from -o and --storage-options
    so = json.dumps({"key": opts["key"], "secret": opts["secret"]})
    code, out, err = run(capsys, "ls", url, "-o", f"endpoint_url={opts['endpoint_url']}", "--storage-options", so)
    assert code == 0, err
    assert sorted(rows(out)) == [2, 4]
    assert all(r[1] == "committed" for r in rows(out).values())

    # a config file naming both tiers
    cfg = tmp_path / "tiers.json"
    cfg.write_text(json.dumps({"tiers": [
        {"kind": "memory", "path": shm_dir, "budget": None, "name": "ram"},
        {"kind": "object", "url": url, "storage_options": opts, "name": "s3"},
    ]}))
    code, out, err = run(capsys, "ls", str(cfg))
    assert code == 0, err
    assert "newest committed step: ram 4, s3 4\n" in out, out
    ram_part, s3_part = out.split("tier s3 ")
    assert ram_part.startswith("tier ram ")
    assert sorted(rows(ram_part)) == [1, 2, 3, 4]
    assert sorted(rows(s3_part)) == [2, 4]

    code, out, err = run(capsys, "verify", str(cfg))
    assert code == 0, err
    assert "ram (memory): step 4: OK" in out
    assert "s3 (object): step 4: OK" in out
    assert re.search(r"checked \(1 rank\) in [0-9.]+ (ms|s), [0-9.]+ [kMG]?B/s", out), out

    code, out, err = run(capsys, "verify", str(cfg), "--tier", "s3", "--step", "2")
    assert code == 0, err
    assert "s3 (object): step 2: OK" in out and "ram" not in out

    # the durable copy damaged: only that tier fails
    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True, **opts)
    key = f"{url[len('s3://'):]}/{object_key(4, 'rank_00000.0000.bin')}"
    data = bytearray(fs.cat_file(key))
    data[100] ^= 0xFF
    fs.pipe_file(key, bytes(data))
    code, out, err = run(capsys, "verify", str(cfg))
    assert code == 1
    assert "ram (memory): step 4: OK" in out
    assert "s3 (object): FAILED: step 4 rank 0 on s3: rank_00000.0000.bin bytes " in out and "'weights'" in out


def test_ls_says_how_far_a_slower_tier_lags(shm_dir, tmp_path, capsys):
    obj = tmp_path / "obj"
    tiers = [MemoryTier(shm_dir, keep=PreserveAll()), ObjectTier(str(obj), save=FixedIntervalPolicy(5))]
    with TieredStore(tiers) as store:
        for s in (5, 6, 7, 8):
            store.save(s, state(s))
    cfg = tmp_path / "tiers.json"
    cfg.write_text(json.dumps({"tiers": [{"kind": "memory", "path": shm_dir, "budget": None, "name": "ram"},
                                         {"kind": "object", "url": str(obj), "name": "durable"}]}))
    code, out, err = run(capsys, "ls", str(cfg))
    assert code == 0, err
    assert out.rstrip().endswith("newest committed step: ram 8, durable 5 (3 steps behind)"), out


# -- verify -----------------------------------------------------------------------------------------

def test_verify_good_step(shm_dir, capsys):
    make_ram_checkpoints(shm_dir)
    code, out, err = run(capsys, "verify", shm_dir)
    assert code == 0, err
    assert "step 3: OK" in out  # default: the newest committed step
    assert re.search(r"KiB checked \(1 rank\) in [0-9.]+ (ms|s), [0-9.]+ [kMG]?B/s", out), out
    code, out, err = run(capsys, "verify", shm_dir, "--step", "1")
    assert code == 0, err
    assert "step 1: OK" in out


def test_verify_detects_a_flipped_byte(shm_dir, capsys):
    make_ram_checkpoints(shm_dir)
    shard = Path(shm_dir) / step_dirname(3) / "rank_00000.0000.bin"
    flip_byte(shard, 0)  # the first entry of the shard file: "weights"

    code, out, err = run(capsys, "verify", shm_dir)
    assert code == 1
    line = next(ln for ln in out.splitlines() if "FAILED" in ln)
    assert "step 3" in line and "checksum mismatch" in line and "'weights'" in line
    # the damaged file and the bytes in it, not the manifest: "weights" is the file's first entry
    entry = next(e for e in json.loads((shard.parent / manifest_filename(0)).read_text())["entries"]
                 if e["name"] == "weights")
    assert entry["file"] == shard.name and entry["offset"] == 0
    assert f"FAILED: step 3 rank 0 on ram: {shard.name} bytes 0-{entry['length']}, part of 'weights':" in line
    assert manifest_filename(0) not in line
    # an untouched step still verifies
    code, out, _ = run(capsys, "verify", shm_dir, "--step", "2")
    assert code == 0 and "step 2: OK" in out


def test_verify_detects_a_damaged_manifest(shm_dir, capsys):
    make_ram_checkpoints(shm_dir, steps=(5,))
    flip_byte(Path(shm_dir) / step_dirname(5) / manifest_filename(0), 10)
    code, out, _ = run(capsys, "verify", shm_dir)
    assert code == 1
    assert "FAILED" in out and "does not match its commit marker" in out


def test_verify_missing_or_partial_step(shm_dir, capsys):
    make_ram_checkpoints(shm_dir)
    os.remove(Path(shm_dir) / step_dirname(3) / MARKER)
    code, out, err = run(capsys, "verify", shm_dir, "--step", "3", "--tier", "ram")
    assert code == 1
    assert "FAILED" in out and "partial" in out
    code, out, err = run(capsys, "verify", shm_dir, "--step", "99")
    assert code == 1
    assert err.startswith("tierfs: error: nothing was verified") and err.count("\n") == 1
    # without --step: the newest *committed* step, the partial one untouched
    code, out, _ = run(capsys, "verify", shm_dir)
    assert code == 0 and "step 2: OK" in out
    assert (Path(shm_dir) / step_dirname(3)).exists()


def test_verify_checks_every_rank(shm_dir, tmp_path, capsys):
    # a real job: two gloo processes on one node, both ranks' shards in one RAM directory
    gloo_job.run_job(2, CHILDREN / "mp_child.py", shm_dir, str(tmp_path / "obj"), "one-step", same_node=True)
    shm_dir = os.path.join(shm_dir, "node0")

    code, out, err = run(capsys, "ls", shm_dir)
    assert code == 0, err
    assert rows(out)[10][1] == "committed" and rows(out)[10][5] == "2"
    code, out, err = run(capsys, "verify", shm_dir)
    assert code == 0, err
    assert "step 10: OK" in out and "2 ranks" in out

    flip_byte(Path(shm_dir) / step_dirname(10) / "rank_00001.0000.bin", 5)
    code, out, _ = run(capsys, "verify", shm_dir)
    assert code == 1
    assert "FAILED: step 10 rank 1 on ram: rank_00001.0000.bin bytes " in out and "'w'" in out


# -- errors -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, status, needle", [
    (["ls", "/nonexistent/tierfs-dir"], 1, "no such directory"),
    (["verify", "/nonexistent/tiers.json"], 1, "does not exist"),
    (["ls"], 2, "required"),
    (["frobnicate", "x"], 2, "invalid choice"),
    (["verify", "X", "--step", "notanumber"], 2, "invalid int"),
    (["ls", "s3://b/p", "-o", "novalue"], 2, "key=value"),
    (["ls", "s3://b/p", "--storage-options", "{bad"], 2, "not valid JSON"),
])
def test_bad_command_lines_are_one_line_errors(capsys, argv, status, needle):
    code, out, err = run(capsys, *argv)
    assert code == status
    assert err.startswith("tierfs: error: ") and err.count("\n") == 1
    assert needle in err
    assert "Traceback" not in err


def test_bad_config_and_unknown_tier(shm_dir, tmp_path, capsys):
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"tiers": [{"kind": "tape", "path": "/x"}]}))
    code, _, err = run(capsys, "ls", str(cfg))
    assert code == 1 and err.startswith("tierfs: error: ") and "kind" in err and err.count("\n") == 1

    cfg.write_text(json.dumps({"tiers": [{"kind": "memory", "path": shm_dir}]}))
    code, _, err = run(capsys, "verify", str(cfg), "--tier", "s3")
    assert code == 2 and "no tier named 's3'" in err


def test_ls_does_not_create_a_missing_directory(tmp_path, capsys):
    missing = tmp_path / "not-there"
    code, _, err = run(capsys, "ls", f"file://{missing}")
    assert code == 1 and err.startswith("tierfs: error: ")
    assert not missing.exists()


def test_help_for_every_command(capsys):
    for argv in (["--help"], ["ls", "--help"], ["verify", "--help"]):
        code, out, _ = run(capsys, *argv)
        assert code == 0
        assert "usage: tierfs" in out


# -- as a program -----------------------------------------------------------------------------------

def test_module_entry_point(shm_dir):
    make_ram_checkpoints(shm_dir, steps=(4, 8))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-m", "tierfs.cli", "ls", shm_dir], capture_output=True, text=True,
                       env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert sorted(rows(r.stdout)) == [4, 8]

    flip_byte(Path(shm_dir) / step_dirname(8) / "rank_00000.0000.bin", 3)
    r = subprocess.run([sys.executable, "-m", "tierfs.cli", "verify", shm_dir], capture_output=True, text=True,
                       env=env, timeout=120)
    assert r.returncode == 1
    assert "FAILED" in r.stdout and "'weights'" in r.stdout

    r = subprocess.run([sys.executable, "-m", "tierfs.cli", "ls", shm_dir + "/missing"], capture_output=True,
                       text=True, env=env, timeout=120)
    assert r.returncode == 1
    assert r.stderr.startswith("tierfs: error: ") and r.stderr.count("\n") == 1
