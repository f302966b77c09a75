"""Ranks fail together within a bound: a failure injected at each stage on one rank of a 2-process gloo job
(through the documented ``stage`` test hook) reaches every rank, naming the rank and the stage, or is
handled where a copy failing is not an error (another source serves; the step is not replicated); the
store stays usable for the next step. A rank SIGKILLed mid-save, or one that stops answering, makes the
other raise RankWaitError (within the timeout). Which ranks share a RAM directory is observed: per-rank
directories without TIERFS_NODE_RANK simply work (with DCP too), and node numbers that contradict the
directories are one error on every rank."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

import gloo_job

HERE = Path(__file__).parent
CHILDREN = HERE / "children"
CHILD = CHILDREN / "fault_child.py"


def run(tmp_path: Path, stage: str, failing: int, tier: str | None = None) -> list[dict]:
    args = [str(tmp_path / "shm"), str(tmp_path / "obj"), stage, str(failing)] + ([tier] if tier else [])
    return gloo_job.run_job(2, CHILD, *args, timeout=120)


@pytest.mark.parametrize("stage, tier", [("staging", None), ("checksum", None), ("manifest", None),
                                         ("marker", "ram")])
def test_a_failed_commit_stage_is_raised_by_every_rank(tmp_path, stage, tier):
    outs = run(tmp_path, stage, 1, tier)
    mine, other = outs[1]["calls"]["save2"], outs[0]["calls"]["save2"]
    assert mine[0] == "TierfsError" and f"injected failure at {stage}" in mine[1]
    assert other[0] == "TierfsError" and f"rank 1 failed in {stage} of step 2" in other[1], other
    assert all(o["tiers2"] == [] for o in outs)  # step 2 committed nowhere
    assert all(o["after"] == [9, "ram"] for o in outs)  # and the store goes on


def test_a_failed_copy_to_the_slow_tier_is_raised_by_every_rank(tmp_path):
    outs = run(tmp_path, "copy", 1)
    for o in outs:
        assert o["calls"]["save2"] == ["ok", True, None] or o["calls"]["save2"][:2] == ["ok", True]
        kind, why = o["calls"]["wait2"][:2]
        assert kind == "BackgroundError" and ("rank 1 failed in copy of step 2 on file" in why
                                              or "injected failure at copy" in why), why
        assert o["tiers2"] == ["ram"]  # never counted on the object tier
        assert o["after"] == [9, "ram"]


def test_a_failed_marker_on_the_shared_tier_is_raised_by_every_rank(tmp_path):
    outs = run(tmp_path, "marker", 0, "file")  # rank 0 owns the shared tier's markers
    assert "rank 0 failed in marker of step 2 on file" in outs[1]["calls"]["wait2"][1]
    assert "injected failure at marker" in outs[0]["calls"]["wait2"][1]
    assert all(o["tiers2"] == ["ram"] for o in outs)
    assert all(o["after"] == [9, "ram"] for o in outs)


def test_a_failed_retention_is_raised_by_every_rank_at_the_next_save(tmp_path):
    outs = run(tmp_path, "retention", 1)
    assert all(o["calls"]["save2"][:2] == ["ok", True] for o in outs)  # step 2 is committed
    assert outs[1]["calls"]["save3"][0] == "BackgroundError"
    assert "rank 1 failed in retention" in outs[0]["calls"]["save3"][1], outs[0]["calls"]["save3"]
    assert all(o["after"] == [9, "ram"] for o in outs)


def test_a_failed_restore_plan_is_raised_by_every_rank(tmp_path):
    outs = run(tmp_path, "planning", 1)
    assert "injected failure at planning" in outs[1]["calls"]["restore"][1]
    assert "rank 1 failed in planning" in outs[0]["calls"]["restore"][1]
    assert all(o["after"] == [9, "ram"] for o in outs)


def test_a_failed_read_falls_back_to_the_next_tier_and_says_why(tmp_path):
    outs = run(tmp_path, "read", 1)
    assert outs[0]["info"][:2] == [2, "ram"]
    step, tier, skipped = outs[1]["info"]
    assert (step, tier) == (2, "file") and "injected failure at read" in skipped[0][2]
    assert all(o["after"] == [9, "ram"] for o in outs)


def test_a_failed_replication_leaves_the_step_in_ram_and_every_rank_says_so(tmp_path):
    outs = run(tmp_path, "replication", 1)
    for o in outs:
        assert o["calls"]["save2"][:2] == ["ok", True] and o["calls"]["wait2"][0] == "ok"
        assert any("step 2 is not replicated" in w and "injected failure at replication" in w
                   for w in o["warnings"]), o["warnings"]
        assert "peer" not in o["tiers2"]
        assert o["after"] == [9, "ram"]


@pytest.mark.parametrize("stage, failing", [("fetch", 0), ("localize", 1), ("reseed", 0)])
def test_failures_restoring_a_lost_node_are_handled_and_said(tmp_path, stage, failing):
    """Node 1 lost its RAM: its shard comes from its peer (rank 0), then it is written into its RAM
    (localize) and rank 0's replica is sent back to it (re-seed). A failure there costs only speed."""
    outs = run(tmp_path, stage, failing)
    assert all(o["calls"]["restore"][:2] == ["ok", 2] for o in outs), [o["calls"] for o in outs]
    if stage != "localize":
        assert all(o["exact"] for o in outs)
    said = {"fetch": "unusable", "localize": "could not copy", "reseed": "re-seeding"}[stage]
    assert any(said in w and "injected failure" in w for o in outs for w in o["warnings"]), \
        [o["warnings"] for o in outs]
    assert all(o["after"] == [9, "ram"] for o in outs)


def test_a_rank_killed_mid_save_makes_the_other_raise_at_once(tmp_path):
    procs = gloo_job.start_job(2, CHILD, str(tmp_path / "shm"), str(tmp_path / "obj"), "kill", "1")
    out0, err0 = procs[0].communicate(timeout=120)
    procs[1].communicate(timeout=120)
    assert procs[1].returncode == -signal.SIGKILL
    import json
    kind, why, ranks = json.loads(out0.strip().splitlines()[-1])["calls"]["save2"]
    assert kind == "RankWaitError" and "commit step 2" in why and "[1]" in why and "gone" in why, why
    assert ranks == [1]


def test_a_rank_that_stops_answering_is_a_timeout_naming_it(tmp_path):
    procs = gloo_job.start_job(2, CHILD, str(tmp_path / "shm"), str(tmp_path / "obj"), "hang", "1")
    try:
        out0, _ = procs[0].communicate(timeout=120)
    finally:
        procs[1].kill()
        procs[1].communicate()
    import json
    kind, why, ranks = json.loads(out0.strip().splitlines()[-1])["calls"]["save2"]
    assert kind == "RankWaitError" and "within 3 s" in why and "commit step 2" in why, why
    assert ranks == [1]


def test_timeouts_are_accepted_in_every_form_and_checked():
    """``timeout`` takes seconds or a timedelta everywhere it is accepted; a bad one is a clear error."""
    import datetime

    import fsspec

    from tierfs import CheckpointManager, TieredStore
    from tierfs.adapters.dcp import TieredReader, TieredWriter
    from tierfs.tiers import MemoryTier

    import tempfile
    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
        with TieredStore([MemoryTier(f"{d}/a")], timeout=datetime.timedelta(seconds=90)) as store:
            assert store.timeout == 90.0
            assert TieredWriter(store, 1, timeout=5).timeout == 5.0
            assert TieredReader(store, timeout=datetime.timedelta(minutes=1)).timeout == 60.0
        with CheckpointManager([MemoryTier(f"{d}/b")], timeout=30) as mgr:
            assert mgr.store.timeout == 30.0
        fs = fsspec.filesystem("tiered", path=f"{d}/c", target_protocol="file", timeout="12",
                               skip_instance_cache=True)
        assert fs.timeout == 12.0
        for bad in (0, -1, "soon", True):
            with pytest.raises(ValueError, match="timeout must be a positive number of seconds"):
                TieredStore([MemoryTier(f"{d}/e")], timeout=bad)
