"""``tierfs doctor``: every check passes on a good node, and each bad setup gives its ✘ line with the fix and a
non-zero exit status. The object store is moto, through s3fs; a read-only prefix is the fault proxy
answering 403 AccessDenied to every write, as an IAM deny policy would."""

from __future__ import annotations

import json
import os
import resource
import time
from pathlib import Path

import pytest
import s3fs

from _faultproxy import FaultProxy
from tierfs.cli import main
from tierfs.cli.doctor import check_memlock, check_object, check_open_files
from tierfs.tiers import ObjectTier

def run(capsys, *argv) -> tuple[int, list[str], str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out.splitlines(), err


def config(tmp_path: Path, shm_dir: str, url: str, opts: dict, budget: int | None = None) -> Path:
    cfg = tmp_path / "tiers.json"
    cfg.write_text(json.dumps({"tiers": [
        {"kind": "memory", "path": os.path.join(shm_dir, "job"), "budget": budget},
        {"kind": "object", "url": url, "storage_options": opts}]}))
    return cfg


def test_every_check_passes_on_a_good_node_and_the_probe_object_is_gone(launch_ready_node, s3_url, shm_dir, tmp_path, capsys):
    url, opts = s3_url
    code, lines, err = run(capsys, "doctor", config(tmp_path, shm_dir, url, opts), "--state-size", "1MB",
                           "--world-size", "4")
    assert code == 0, (lines, err)
    names = [ln.split(": ", 1)[0] for ln in lines]
    assert names == ["✔ torch", "✔ node identity", f"✔ RAM tier ram ({shm_dir}/job, tmpfs)", "✔ locked memory",
                     "✔ open files", f"✔ object tier s3 ({url})"], lines
    assert "write, read and delete work; clock within" in lines[-1]
    assert "needed for 976.6 KiB per node" in lines[2]
    assert not Path(shm_dir, "job").exists()  # nothing made
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **opts)
    assert not fs.exists(url) or fs.find(url) == []  # the probe object removed
    code, lines, _ = run(capsys, "doctor", config(tmp_path, shm_dir, url, opts), "--json")
    got = json.loads("\n".join(lines))
    assert code == 0 and [c["ok"] for c in got] == [True] * 6 and got[1]["detail"] == "node 0 (TIERFS_NODE_RANK)"


def test_a_ram_budget_beyond_the_free_tmpfs_is_a_cross_with_the_fix(launch_ready_node, shm_dir, tmp_path, capsys):
    sv = os.statvfs(shm_dir)
    free = sv.f_bavail * sv.f_frsize
    cfg = tmp_path / "tiers.json"
    cfg.write_text(json.dumps({"tiers": [{"kind": "memory", "path": shm_dir, "budget": free + (8 << 30)}]}))
    code, lines, _ = run(capsys, "doctor", cfg)
    assert code == 1
    bad = [ln for ln in lines if ln.startswith("✘")]
    assert len(bad) == 1 and bad[0].startswith(f"✘ RAM tier ram ({shm_dir}, tmpfs): the budget "), lines
    assert "fix: lower the tier's budget to at most" in bad[0] and "sizeLimit" in bad[0]
    code, lines, _ = run(capsys, "doctor", "--ram", shm_dir, "--state-size", str(free))  # 3 steps of it needed
    assert code == 1 and "needed for" in lines[2] and "keep fewer steps in RAM" in lines[2], lines


def test_a_read_only_object_prefix_is_a_cross_naming_the_permission(launch_ready_node, s3_url, capsys):
    url, opts = s3_url
    with FaultProxy(opts["endpoint_url"]) as proxy:
        proxy.set_faults(1.0, ["denied"], match=lambda r: r.method in ("PUT", "POST", "DELETE"))
        code, lines, _ = run(capsys, "doctor", url, "--storage-options",
                             json.dumps({**opts, "endpoint_url": proxy.url, "skip_instance_cache": True}))
    assert code == 1
    assert lines[-1].startswith(f"✘ object tier s3 ({url}): cannot write under the prefix (PermissionError"), lines
    assert lines[-1].endswith(f"fix: grant the job's credentials write permission on {url}/* (S3: s3:PutObject; "
                              "GCS: roles/storage.objectAdmin), check the URL and the endpoint"), lines


def test_a_missing_node_identity_is_a_cross_with_the_fix(launch_ready_node, monkeypatch, capsys):
    monkeypatch.delenv("TIERFS_NODE_RANK")
    monkeypatch.setenv("SLURM_NODEID", "3")
    code, lines, _ = run(capsys, "doctor")
    assert code == 1
    assert lines[1].startswith("✘ node identity: no TIERFS_NODE_RANK, GROUP_RANK or LOCAL_WORLD_SIZE"), lines
    assert lines[1].endswith("fix: export TIERFS_NODE_RANK=<this node's index> (this is Slurm node 3: "
                             "TIERFS_NODE_RANK=$SLURM_NODEID), or launch with torchrun, which sets GROUP_RANK")
    monkeypatch.setenv("TIERFS_NODE_RANK", "one")
    code, lines, _ = run(capsys, "doctor")
    assert code == 1 and lines[1] == ("✘ node identity: TIERFS_NODE_RANK='one' is not a node number; fix: set "
                                      "TIERFS_NODE_RANK to this node's index, 0 to the number of nodes - 1")


def test_a_clock_off_the_store_s_is_a_cross(s3_url):
    url, opts = s3_url
    ahead = check_object(ObjectTier(url, opts), clock=lambda: time.time() + 600)
    assert not ahead.ok and "this clock is" in ahead.detail and "ahead of the store's" in ahead.detail
    assert ahead.fix == "synchronise the clock (chrony or ntpd)"
    assert check_object(ObjectTier(url, opts)).ok


def test_limits_too_low_for_the_job_are_crosses_with_the_fix():
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    low = 64 << 10 if hard == resource.RLIM_INFINITY else min(64 << 10, hard)
    resource.setrlimit(resource.RLIMIT_MEMLOCK, (low, hard))
    try:
        with_gpu, without = check_memlock(cuda=True), check_memlock(cuda=False)
    finally:
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (soft, hard))
    assert not with_gpu.ok and with_gpu.fix.startswith("ulimit -l unlimited") and without.ok
    files = check_open_files(world=10**7)  # gloo's socket per peer rank: beyond any limit here
    assert not files.ok and "needs about 10004135" in files.detail
    assert files.fix.startswith("ulimit -n 10004135") or files.fix.startswith("raise the hard limit")
