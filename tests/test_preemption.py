"""SIGTERM to one rank of a job whose loop never calls ``reached_preemption`` (``handle_sigterm=True``).

Two ranks (gloo, each its own node and RAM directory) save every step: RAM every 5 steps, an S3 object tier
(moto) every 50th step or on preemption, ``background_bandwidth=4e6`` (tests/children/sigterm_ranks_child.py).
The state goes to the store directly, or (a torch tensor) through DCP. Only rank 1 gets SIGTERM, at step 21;
it reads on only once the signal came, so the first save after it is step 22. That save goes to the object
tier on both ranks; once the grace period is over the job stops at its next save (or, when the loop makes no
save call any more, from the watcher), each process ending as an unhandled SIGTERM would, once step 22 is
durable. Last, one process whose first save after the signal comes after the grace."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("moto")
pytest.importorskip("s3fs")

from _ports import free_port  # noqa: E402
import gloo_job  # noqa: E402
from tierfs import CheckpointManager  # noqa: E402
from tierfs.tiers import MemoryTier, ObjectTier  # noqa: E402

HERE = Path(__file__).parent
CHILD = HERE / "children" / "sigterm_ranks_child.py"
GRACE = "3"
PRE = 22  # the first save after the SIGTERM
END = 10 ** 9  # the loop's natural end (the child's END)


def start_train(shm_dir: str, url: str, logdir: Path, opts: dict, *extra: str) -> list[subprocess.Popen]:
    """The two ranks of a ``train`` job, as tests/gloo_job.py starts them, with stdin a pipe (rank 1 reads a
    line at step 21)."""
    port = free_port()
    procs = []
    for rank in range(2):
        env = os.environ | {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                            "WORLD_SIZE": "2", "LOCAL_RANK": "0", "TIERFS_NODE_RANK": str(rank),
                            "PYTHONPATH": str(HERE.parent), "TIERFS_TEST_STORAGE_OPTIONS": json.dumps(opts)}
        procs.append(subprocess.Popen([sys.executable, str(CHILD), "train", shm_dir, url, str(logdir), GRACE, *extra],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, env=env))
    return procs


def sigterm_rank_1(procs: list[subprocess.Popen]) -> list[tuple[int, str]]:
    """SIGTERM to rank 1 at step 21, then let it go on; every rank's exit status and stderr."""
    try:
        one = procs[1]
        line = one.stdout.readline()
        if not line.startswith("reached 21"):
            procs[0].kill()
            pytest.fail(f"rank 1 did not reach step 21: {line!r} {one.communicate()[1][-3000:]}")
        one.send_signal(signal.SIGTERM)
        one.stdin.write("go\n")
        one.stdin.flush()
        ended = []
        for p in procs:
            _, err = p.communicate(timeout=300)
            ended.append((p.returncode, err))
        return ended
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def logged(logdir: Path, rank: int) -> list[tuple[int, bool]]:
    """The steps rank ``rank`` saved, each with what ``save`` returned."""
    words = (logdir / f"rank{rank}.log").read_text().split()
    return [(int(s), v == "True") for s, v in zip(words[::2], words[1::2])]


def check_ended(ended: list[tuple[int, str]], logdir: Path) -> None:
    """Both ranks ended as an unhandled SIGTERM would, after saving step 22 to the preemption tiers, and long
    before the loop's end; each waited for step 22 alone."""
    for rank, (code, err) in enumerate(ended):
        assert code == -signal.SIGTERM, (rank, code, err[-3000:])
        assert "Traceback" not in err, err[-3000:]
        assert f"once step {PRE}, the preemption save, is durable" in err, err[-3000:]
        steps = logged(logdir, rank)
        assert (PRE, True) in steps, steps[:30]
        assert steps[-1][0] < END
    # both ranks made the same saves (the last may be cut short on one of them)
    a, b = (logged(logdir, r) for r in range(2))
    n = min(len(a), len(b))
    assert a[:n] == b[:n]
    assert all(saved == (s % 5 == 0 or s == PRE) for s, saved in a[:n]), [x for x in a[:n] if x[1]][:20]


def check_object_tier(url: str, opts: dict, shm_dir: str, dcp: bool) -> None:
    """The object tier holds step 22 (saved on preemption, not a multiple of 50) and otherwise only multiples
    of 50; step 22 restores bit for bit from it: on both ranks (each saved its own array), or through DCP
    (the tensor every rank held) in this process."""
    committed = ObjectTier(url, opts).committed_steps()
    assert PRE in committed and all(s == PRE or s % 50 == 0 for s in committed), committed
    if dcp:
        want = np.random.default_rng(PRE).standard_normal(20_000).astype(np.float32)  # the child's state_for
        got = {"w": torch.zeros(20_000), "step": 0}
        with CheckpointManager([MemoryTier(os.path.join(shm_dir, "restore")), ObjectTier(url, opts)]) as mgr:
            assert mgr.restore(got, step=PRE) == PRE
            assert mgr.last_restore_info is not None and mgr.last_restore_info.tier == "s3"
        assert got["step"] == PRE and got["w"].numpy().tobytes() == want.tobytes()
        return
    got = gloo_job.run_job(2, CHILD, "restore", shm_dir, url, str(PRE),
                           env={"TIERFS_TEST_STORAGE_OPTIONS": json.dumps(opts)})
    assert [(r["rank"], r["same"], r["tier"]) for r in got] == [(0, True, "s3"), (1, True, "s3")], got


@pytest.mark.parametrize("path", ["store", "dcp"])
def test_sigterm_to_one_rank_saves_on_preemption_everywhere_then_stops_the_job(s3_url, shm_dir, tmp_path, path):
    url, opts = s3_url
    extra = ("dcp",) if path == "dcp" else ()
    ended = sigterm_rank_1(start_train(shm_dir, url, tmp_path, opts, *extra))
    check_ended(ended, tmp_path)
    for _, err in ended:  # stopped at a save, or (a rank whose peer ended first) at the failed save
        assert "did not stop" in err or "the save of step" in err, err[-3000:]
    check_object_tier(url, opts, shm_dir, path == "dcp")


def test_a_loop_that_stops_saving_is_ended_by_the_watcher(s3_url, shm_dir, tmp_path):
    url, opts = s3_url
    ended = sigterm_rank_1(start_train(shm_dir, url, tmp_path, opts, "stall"))
    check_ended(ended, tmp_path)
    for rank, (_, err) in enumerate(ended):
        assert "no save call since" in err, err[-3000:]
        assert logged(tmp_path, rank)[-1][0] == 23
    check_object_tier(url, opts, shm_dir, False)


def test_an_older_upload_queued_before_the_preemption_save_is_given_up(s3_url, shm_dir, tmp_path):
    """The object tier takes every 20th step too, and rank 0's upload of step 20 is held until the process
    says it is ending, so step 22's upload is queued behind it: the older upload is given up on both ranks
    (it stays in RAM), step 22 is uploaded and restores bit for bit, and both processes end as SIGTERM would."""
    url, opts = s3_url
    ended = sigterm_rank_1(start_train(shm_dir, url, tmp_path, opts, "held"))
    check_ended(ended, tmp_path)
    for _, err in ended:
        assert f"uploads of steps before {PRE} not finished are given up" in err, err[-3000:]
    committed = ObjectTier(url, opts).committed_steps()
    assert PRE in committed and 20 not in committed, committed
    got = gloo_job.run_job(2, CHILD, "restore", shm_dir, url, str(PRE),
                           env={"TIERFS_TEST_STORAGE_OPTIONS": json.dumps(opts)})
    assert [(r["rank"], r["same"], r["tier"]) for r in got] == [(0, True, "s3"), (1, True, "s3")], got


def test_a_first_save_after_the_grace_still_goes_to_the_preemption_tiers(shm_dir, tmp_path):
    """One process, no save between SIGTERM and the end of the grace: the next save is the preemption save,
    and the process ends once it is durable; the upload of step 1, still under way, is given up (it stays in
    RAM) (tests/children/sigterm_late_save_child.py)."""
    child = subprocess.run([sys.executable, str(HERE / "children" / "sigterm_late_save_child.py"), shm_dir,
                            str(tmp_path / "o")], capture_output=True, text=True, timeout=300,
                           env=os.environ | {"PYTHONPATH": str(HERE.parent)})
    assert child.returncode == -signal.SIGTERM, child.stderr[-3000:]
    assert child.stdout.split() == ["1", "True"], child.stdout  # step 2's save call never returned
    assert "step 2 went to the preemption tiers" in child.stderr, child.stderr[-3000:]
    tier = ObjectTier(f"file://{tmp_path}/o")
    assert "uploads of steps before 2 not finished are given up" in child.stderr, child.stderr[-3000:]
    assert tier.committed_steps() == [2]
    with CheckpointManager([ObjectTier(f"file://{tmp_path}/o")]) as mgr:
        got = mgr.restore(step=2)
    assert got["w"].tobytes() == np.full(1000, 2, dtype=np.float32).tobytes()
