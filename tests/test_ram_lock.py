"""One job per RAM directory: a second job gets one error naming the directory and the holder's pid, and
harms nothing of the first; readers open beside it; the directory is free again once the job closes or is
killed. The other jobs are real processes (tests/children/ram_lock_child.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np

from tierfs import TieredStore, TierUnavailableError
from tierfs.policies import LatestN
from tierfs.testing import hooks
from tierfs.tiers import MemoryTier

from _ports import free_port
from ram_lock_child import state_for, write

HERE = Path(__file__).parent
CHILDREN = HERE / "children"
ENV = os.environ | {"PYTHONPATH": str(CHILDREN)}


def run(ram: Path, mode: str) -> Any:
    """What ram_lock_child.py said, run as a job of its own."""
    proc = subprocess.run([sys.executable, str(CHILDREN / "ram_lock_child.py"), str(ram), mode], capture_output=True,
                          text=True, timeout=120, env=ENV)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


def hold(ram: Path, env: dict[str, str] | None = None) -> tuple[subprocess.Popen[str], int]:
    """A job holding ``ram`` (step 1 saved) until its stdin closes, and its pid."""
    proc = subprocess.Popen([sys.executable, str(CHILDREN / "ram_lock_child.py"), str(ram), "hold"], text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=ENV | (env or {}))
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line, f"the holding job ended (exit code {proc.wait()})"
    return proc, json.loads(line)["pid"]


def assert_names_holder(got: dict[str, Any], ram: Path, pid: int) -> None:
    assert got.get("error") == "TierUnavailableError", got
    msg = got["message"]
    assert str(ram) in msg and f"pid {pid}" in msg and "another job" in msg and "\n" not in msg, msg


def restored(ram: Path, step: int) -> dict[str, Any]:
    with TieredStore([MemoryTier(ram)], cleanup=False) as store:
        return store.restore(step)[0]


def test_a_second_job_gets_one_error_and_a_reader_opens_beside_the_first(shm_dir):
    ram = Path(shm_dir) / "ram"
    with TieredStore([MemoryTier(ram)]) as store:
        store.save(1, state_for(1))
        assert_names_holder(run(ram, "write"), ram, os.getpid())
        assert run(ram, "read") == {"step": 1, "same": True}
        store.save(2, state_for(2))  # the first job goes on
        assert sorted(store.steps()) == [1, 2]
    assert run(ram, "write") == {"saved": 3}  # closed: the directory is free


def test_a_second_job_leaves_the_first_jobs_step_in_flight_alone(shm_dir):
    """The second job's cleanup of uncommitted steps would delete the first's step being committed."""
    ram = Path(shm_dir) / "ram"
    reached, go = threading.Event(), threading.Event()

    def pause(stage: str, step: int, tier: str | None) -> None:
        if stage == "marker" and step == 2:
            reached.set()
            assert go.wait(60)

    with TieredStore([MemoryTier(ram)]) as store, hooks.on("stage", pause):
        store.save(1, state_for(1))
        store.save(2, state_for(2), blocking=False)
        assert reached.wait(60)
        try:
            assert store.steps() == {1: ["ram"]}  # step 2: its files written, no marker yet
            assert_names_holder(run(ram, "write"), ram, os.getpid())
        finally:
            go.set()
        store.wait_until_finished()
        assert np.array_equal(store.restore(2)[0]["w"], state_for(2)["w"])


def test_a_killed_job_leaves_the_directory_free(shm_dir):
    ram = Path(shm_dir) / "ram"
    proc, pid = hold(ram)
    try:
        got = write(str(ram))  # this process: a job of its own
        assert_names_holder(got, ram, pid)
        assert pid in MemoryTier(ram).live_users()
    finally:
        os.kill(pid, signal.SIGKILL)
        proc.wait()
    assert write(str(ram)) == {"saved": 2}  # the kernel dropped the killed job's lock
    assert np.array_equal(restored(ram, 1)["w"], state_for(1)["w"])


def test_the_processes_of_one_job_share_the_directory(shm_dir, monkeypatch):
    """Ranks of one torch.distributed job (one rendezvous address) share it; another job's do not."""
    port = free_port()
    job = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    ram = Path(shm_dir) / "ram"
    proc, pid = hold(ram, job)
    try:
        for k, v in job.items():
            monkeypatch.setenv(k, v)
        assert write(str(ram)) == {"saved": 2}
        monkeypatch.setenv("MASTER_PORT", str(port + 1))
        assert_names_holder(write(str(ram)), ram, pid)
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        assert proc.wait(timeout=60) == 0


def test_a_reader_in_the_writers_process_leaves_its_lock_and_buffers_alone(shm_dir):
    ram = Path(shm_dir) / "ram"
    tier = MemoryTier(ram, keep=LatestN(1))
    with TieredStore([tier]) as store:
        for s in range(1, 4):
            store.save(s, state_for(s))
        with TieredStore([MemoryTier(ram)], cleanup=False) as reader:  # this process: the same job
            assert reader.restore()[0]["step"] == 3
        assert_names_holder(run(ram, "write"), ram, os.getpid())  # still held
        reused = tier.stats()["reused"]
        store.save(4, state_for(4))
        assert tier.stats()["reused"] > reused  # the pooled buffers are still there
    assert sorted(os.listdir(ram)) == ["step_000000000004"]  # nothing of the job's lock is left


def test_a_tier_told_to_lock_when_it_opens_fails_there(shm_dir):
    """What a store that writes asks of its RAM tier: the second job fails when it opens, not later."""
    ram = Path(shm_dir) / "ram"
    with TieredStore([MemoryTier(ram)]) as store:
        store.save(1, state_for(1))
        proc = subprocess.run([sys.executable, "-c", (
            "import sys\n"
            "from tierfs.errors import TierUnavailableError\n"
            "from tierfs.tiers import MemoryTier\n"
            "t = MemoryTier(sys.argv[1])\n"
            "t.lock_on_open = True\n"
            "try:\n"
            "    t.open()\n"
            "except TierUnavailableError as e:\n"
            "    print(e)\n"), str(ram)], capture_output=True, text=True, timeout=60, env=ENV)
        assert proc.returncode == 0, proc.stderr
        assert str(ram) in proc.stdout and f"pid {os.getpid()}" in proc.stdout
