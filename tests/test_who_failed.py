"""When a rank fails, the others name exactly the ranks that failed, wait for them once, and exit cleanly.

Real jobs of 2 or 3 processes (gloo on localhost, each its own node and RAM directory under /dev/shm),
through tests/children/who_failed_child.py and lost_exit_child.py:

- a rank SIGKILLed at each stage of committing (staging, manifest, marker) or restoring (read): every
  survivor's error names it, and only it, though a survivor blocked on another survivor in the same
  collective would not see the dead one's connection drop (the first to fail closes its connections, so the
  others fail too and say they are alive);
- rank 0 (the object tier's owner, and the host of the job's key-value store the diagnosis goes through)
  SIGKILLed at the object tier's marker of a 3-rank job on S3 (moto): the survivors name rank 0, never
  gloo's text;
- a rank that stops calling the store (timeout 3 s): the first call waits one timeout and names it;
- after any of these, the next calls raise at once (without a single call into torch.distributed), naming
  the same ranks and saying the job must restart;
- the survivors close their stores and exit through the interpreter's teardown with status 0 (the wait
  for them has a generous bound; it is no timing check): nothing of tierfs's groups joins a thread stuck
  on a dead peer;
- after ``CheckpointLostError`` (two neighbouring nodes' shards lost) every rank exits with status 0, and
  the groups of its closed stores ended as they closed (gloo's threads are gone), not in the interpreter's
  teardown.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

import gloo_job

pytest.importorskip("torch")

CHILDREN = Path(__file__).parent / "children"
#: seconds a process of a job may take at most (a bound against hangs, far above what it takes)
DEADLINE = 120


def run(world: int, shm: str, obj: str, victim: int, mode: str, stage: str, tier: str = "-",
        timeout: float = 60.0, env: dict[str, str | None] | None = None) -> tuple[dict[int, Any], dict[int, int]]:
    """Every survivor's JSON line and every rank's exit status."""
    procs = gloo_job.start_job(world, CHILDREN / "who_failed_child.py", shm, obj, str(victim), mode, stage, tier,
                               str(timeout), env=env)
    outs, codes, errs = {}, {}, {}
    try:
        for r, p in enumerate(procs):
            try:
                out, errs[r] = p.communicate(timeout=DEADLINE)
            except subprocess.TimeoutExpired:
                p.kill()
                out, errs[r] = p.communicate()
                errs[r] = f"(did not exit within {DEADLINE} s)\n{errs[r]}"
            codes[r] = p.returncode
            if r != victim or mode == "idle":
                lines = out.strip().splitlines()
                assert lines, f"rank {r} printed nothing (exit {p.returncode}):\n{errs[r][-3000:]}"
                outs[r] = json.loads(lines[-1])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    for r, code in codes.items():
        if r != victim or mode == "idle":
            assert code == 0, f"rank {r} exited with {code}:\n{errs[r][-3000:]}"
    return outs, codes


def check_later_calls(o: dict[str, Any], ranks: list[int], seen: str) -> None:
    """The calls after the failure raise at once: no call into torch.distributed, the same ranks, a restart."""
    for call in ("second", "third"):
        kind, message, named, _, _, calls = o[call]
        assert kind == "RankWaitError" and named == ranks, o[call]
        assert calls == 0, f"{call} call waited on the other ranks again ({calls} calls): {message}"
        assert f"rank(s) {ranks}" in message and f"seen in {seen}" in message, message
        assert "the job must restart" in message, message


def no_backend_text(message: str) -> None:
    for raw in ("gloo", "pair.cc", "GLHF", "Connection reset", "Connection closed", "Broken pipe"):
        assert raw not in message, message


@pytest.mark.parametrize("stage, victim", [("staging", 1), ("manifest", 2), ("marker", 2), ("read", 1)])
def test_a_rank_killed_while_committing_is_the_only_one_named(shm_dir, stage, victim):
    outs, codes = run(3, shm_dir, "none", victim, "kill", stage)
    assert codes[victim] == -signal.SIGKILL
    seen = "restore step 2" if stage == "read" else "commit step 2"
    for r, o in outs.items():
        kind, message, ranks, _, _, calls = o["first"]
        assert kind == "RankWaitError" and ranks == [victim], (r, o["first"])
        if stage == "staging" and message.startswith("save step 2"):  # it stages while the ranks agree:
            seen = "save step 2"  # killed before its part of that agreement was through
        assert message.startswith(f"{seen}: rank(s) [{victim}] is gone (its process ended)"), message
        assert calls > 0  # (the count works: this call did wait on the others)
        no_backend_text(message)
        check_later_calls(o, [victim], seen)


def test_rank_0_killed_at_the_object_marker_on_s3_is_named_by_every_survivor(shm_dir, s3_url):
    url, opts = s3_url
    env = {"TIERFS_TEST_STORAGE_OPTIONS": json.dumps(opts)}
    outs, codes = run(3, shm_dir, url, 0, "kill", "marker", "s3", env=env)
    assert codes[0] == -signal.SIGKILL
    for r, o in outs.items():
        kind, message, _, cause, ranks, _ = o["first"]
        assert kind == "BackgroundError" and cause == "RankWaitError" and ranks == [0], (r, o["first"])
        assert "copy step 2 to s3: rank(s) [0] is gone (its process ended" in message, message
        no_backend_text(message)
        check_later_calls(o, [0], "copy step 2 to s3")


def test_after_a_timeout_the_next_calls_raise_at_once(shm_dir):
    outs, codes = run(2, shm_dir, "none", 1, "idle", "-", timeout=3.0)
    o = outs[0]
    kind, message, ranks, _, _, _ = o["first"]
    assert kind == "RankWaitError" and ranks == [1], o["first"]
    assert message.startswith("save step 2: rank(s) [1] did not arrive within 3 s"), message
    check_later_calls(o, [1], "save step 2")
    assert codes == {0: 0, 1: 0}


def test_every_rank_exits_cleanly_after_a_checkpoint_is_lost(shm_dir):
    def job(mode: str) -> list[dict[str, Any]]:
        procs = gloo_job.start_job(3, CHILDREN / "lost_exit_child.py", shm_dir, mode)
        outs = []
        try:
            for r, p in enumerate(procs):
                out, err = p.communicate(timeout=DEADLINE)
                assert p.returncode == 0, f"rank {r} ({mode}) exited with {p.returncode}:\n{err[-3000:]}"
                outs.append(json.loads(out.strip().splitlines()[-1]))
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.communicate()
        return outs

    job("run")
    for node in (1, 2):  # replaced: rank 1's shard and its only replica (on rank 2) are gone
        shutil.rmtree(Path(shm_dir) / f"node{node}")
    for o in job("lost"):
        assert o["store"] == "CheckpointLostError" and o["manager"] == "CheckpointLostError", o
        before, during, after = o["gloo_threads"]
        assert during > before and after == before, o  # the stores' groups ended as they closed
