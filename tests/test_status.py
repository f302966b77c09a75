"""``tierfs status``: a live job (its object tier's upload of a step in flight) and the same job after a
SIGKILL, read from the tiers alone by another process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np

from tierfs.cli import main

CHILD = Path(__file__).resolve().parent / "children" / "status_child.py"


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_status_of_a_live_job_then_of_the_same_job_killed(shm_dir, tmp_path, capsys):
    ram, obj = os.path.join(shm_dir, "ram"), str(tmp_path / "obj")
    cfg = tmp_path / "tiers.json"
    cfg.write_text(json.dumps({"tiers": [{"kind": "memory", "path": ram, "name": "ram"},
                                         {"kind": "object", "url": f"file://{obj}", "name": "disk"}]}))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(CHILD.parent), os.environ.get("PYTHONPATH", "")])}
    job = subprocess.Popen([sys.executable, str(CHILD), ram, obj], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True, env=env)
    try:
        assert job.stdout is not None and job.stdout.readline().strip() == "READY", job.stderr.read()  # type: ignore[union-attr]
        code, out, err = run(capsys, "status", cfg)
        assert code == 0, err
        ram_line, disk_line = out.splitlines()
        assert ram_line.startswith(f"tier ram (memory, {ram}): step 4, committed ") and "ago" in ram_line
        assert ram_line.endswith(f"in use by 1 process(es) (pid {job.pid}): a job is running"), ram_line
        assert disk_line.startswith(f"tier disk (object, file://{obj}): step 3, committed "), disk_line
        assert ", 1 step behind; step 4 in flight: " in disk_line and " so far, last written " in disk_line
        assert "process" not in disk_line  # who uses an object store is not known from here
        code, out, _ = run(capsys, "status", cfg, "--json")
        got = json.loads(out)
        assert code == 0 and got["running"] is True
        assert [(t["name"], t["newest"], t["behind"], [f["step"] for f in t["in_flight"]]) for t in got["tiers"]] \
            == [("ram", 4, 0, []), ("disk", 3, 1, [4])]
    finally:
        job.send_signal(signal.SIGKILL)
        job.wait(timeout=60)
    code, out, err = run(capsys, "status", cfg)
    assert code == 0, err
    ram_line, disk_line = out.splitlines()
    assert ram_line.endswith("no process uses it: no job is running on this node"), ram_line
    assert "step 4 left by an interrupted save (removed when a store opens): " in disk_line, disk_line
    code, out, _ = run(capsys, "status", cfg, "--watch", "0")
    assert code == 2


def test_status_shows_a_replication_in_flight_as_the_peer_copies_lagging(shm_dir, tmp_path, capsys):
    """A 2-node job with a peer tier whose replication of step 2 is held: on node 0, the RAM tier has step 2
    and the copies node 0 keeps for node 1 are still at step 1, one step behind."""
    import gloo_job

    ram = os.path.join(shm_dir, "node0")
    cfg = tmp_path / "tiers.json"
    cfg.write_text(json.dumps({"tiers": [{"kind": "memory", "path": ram, "name": "ram"}, {"kind": "peer"}]}))
    procs = gloo_job.start_job(2, CHILD.parent / "status_peer_child.py", shm_dir)
    try:
        for p in procs:
            assert p.stdout.readline().strip() == "READY", p.stderr.read()
        code, out, err = run(capsys, "status", cfg)
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=60)
    assert code == 0, err
    ram_line, copies_line = out.splitlines()
    assert ram_line.startswith(f"tier ram (memory, {ram}): step 2, committed "), ram_line
    assert copies_line.startswith(f"tier ram/peers/rank_00000 (PeerTier copies for other nodes, {ram}/peers/"
                                  "rank_00000): step 1, committed "), copies_line
    assert ", 1 step behind" in copies_line and "a job is running" in copies_line, copies_line


def test_watch_prints_the_status_again_until_interrupted(shm_dir, tmp_path):
    """``--watch``: a report, then another, each headed by the time; Ctrl-C (SIGINT) ends it with status 0."""
    from tierfs import TieredStore
    from tierfs.tiers import MemoryTier

    with TieredStore([MemoryTier(shm_dir)]) as store:
        store.save(1, {"w": np.ones(3)})
    env = {**os.environ, "PYTHONPATH": str(CHILD.parent.parent.parent)}
    # SIGINT as a terminal's Ctrl-C delivers it: a suite run in the background (``make test &``) has it ignored,
    # which the child would inherit
    p = subprocess.Popen([sys.executable, "-m", "tierfs.cli", "status", shm_dir, "--watch", "0.05"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        heads = []
        while len(heads) < 2:
            line = p.stdout.readline()
            assert line, p.stderr.read()
            if line.startswith("tierfs status "):
                heads.append(line)
                assert "(every 0.05 s; Ctrl-C ends)" in line
            elif line.strip():
                assert line.startswith(f"tier ram (memory, {shm_dir}): step 1, committed "), line
        p.send_signal(signal.SIGINT)
        p.communicate(timeout=60)  # read what it printed meanwhile: a full pipe would hold its exit
        assert p.returncode == 0
    finally:
        if p.poll() is None:
            p.kill()
