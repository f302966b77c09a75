"""A job that goes back: a rollback, a fresh start over an older run, a step lower than the newest. The
steps of the abandoned run are removed by the next save, on every tier and every rank, never restored
again and never in the way of the new ones (:mod:`tierfs.core.timeline`). And a job that lost steps: an
error naming them, never "nothing to restore"."""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from gloo_job import run_job
from tierfs import CheckpointManager, TieredStore
from tierfs.errors import StepExistsError
from tierfs.policies import FixedIntervalPolicy, LatestN
from tierfs.testing import assert_states_equal
from tierfs.tiers import MemoryTier, ObjectTier

HERE = Path(__file__).parent
CHILDREN = HERE / "children"


def state_for(step: int, run: int) -> dict:
    rng = np.random.default_rng([run, step])
    return {"w": rng.standard_normal(5000).astype(np.float32), "b": rng.integers(0, 9, 77), "run": run}


def tiers(shm_dir: str, tmp_path: Path) -> list:
    return [MemoryTier(shm_dir, keep=LatestN(2)),
            ObjectTier(f"file://{tmp_path}/obj", save=FixedIntervalPolicy(10), keep=LatestN(3))]


def test_rollback_through_the_store_then_a_restart_resumes_the_new_timeline(shm_dir, tmp_path):
    with TieredStore(tiers(shm_dir, tmp_path)) as store:
        for step in range(1, 41):
            assert store.save(step, state_for(step, 1))
    with TieredStore(tiers(shm_dir, tmp_path)) as store:
        got, info = store.restore(step=20)  # back, after a loss spike
        assert info.step == 20 and got["run"] == 1
        for step in range(21, 31):
            assert store.save(step, state_for(step, 2)) is True
        store.wait_until_finished()  # no copy failed: no new step was deleted under it
        assert store.steps() == {20: ["file"], 29: ["ram"], 30: ["ram", "file"]}
    with TieredStore(tiers(shm_dir, tmp_path)) as store:
        got, info = store.restore()
        assert info.step == 30
        assert_states_equal(got, state_for(30, 2))
        got, info = store.restore(tiers=["file"])
        assert info.step == 30 and got["run"] == 2


def test_a_fresh_start_over_an_older_run_and_an_older_step(shm_dir, tmp_path):
    with TieredStore(tiers(shm_dir, tmp_path)) as store:
        for step in range(1, 41):
            store.save(step, state_for(step, 1))
    with TieredStore(tiers(shm_dir, tmp_path)) as store:  # no restore: the job starts from scratch
        with pytest.raises(StepExistsError):  # a step the older run saved is replaced only when asked to
            store.save(30, state_for(30, 2))
        assert store.steps()[40] == ["ram", "file"]  # a refused save removes nothing
        for step in range(1, 13):
            assert store.save(step, state_for(step, 2)) is True
        store.wait_until_finished()
        assert store.steps() == {10: ["file"], 11: ["ram"], 12: ["ram"]}
        assert_states_equal(store.restore()[0], state_for(12, 2))
        store.save(11, state_for(11, 3), overwrite=True)  # a step lower than the newest
        assert store.steps() == {10: ["file"], 11: ["ram"]}
    with TieredStore(tiers(shm_dir, tmp_path)) as store:
        assert_states_equal(store.restore()[0], state_for(11, 3))


def model_state(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2 * seed)
    return model, opt


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> dict:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    opt.step()
    return {"model": model.state_dict(), "optim": opt.state_dict()}


def test_rollback_through_the_manager_then_a_restart_resumes_the_new_timeline(shm_dir, tmp_path):
    model, opt = model_state(1)
    with CheckpointManager(tiers(shm_dir, tmp_path)) as mgr:
        assert mgr.restore(train(model, opt, 0)) is None  # nothing was ever saved
        for step in range(1, 31):
            mgr.save(step, train(model, opt, step))
    model, opt = model_state(2)  # the second run: another learning rate from step 20 on
    with CheckpointManager(tiers(shm_dir, tmp_path)) as mgr:
        state = train(model, opt, 0)
        assert mgr.restore(state, step=20) == 20
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        for g in opt.param_groups:
            g["lr"] = 0.05
        assert mgr.save(20, state) is False  # the restored step is not saved again
        for step in range(21, 27):
            state = train(model, opt, step)
            assert mgr.save(step, state) is True
        want = copy.deepcopy(state)
        mgr.wait_until_finished()
        assert mgr.all_steps() == [10, 20, 25, 26]  # 29, 30 of the first run removed (10, 20 are before it)
    with CheckpointManager(tiers(shm_dir, tmp_path)) as mgr:
        got = train(*model_state(3), 0)
        assert mgr.restore(got) == 26
        assert_states_equal(got, want)
        assert got["optim"]["param_groups"][0]["lr"] == 0.05


def test_a_job_of_three_nodes_goes_back_on_every_rank(shm_dir, tmp_path):
    obj = str(tmp_path / "obj")
    run_job(3, CHILDREN / "timeline_child.py", shm_dir, obj, "run")
    back = run_job(3, CHILDREN / "timeline_child.py", shm_dir, obj, "rollback")
    assert [r["restored"] for r in back] == [[6, 1]] * 3
    for r in back:  # step 8 of the first run is gone from RAM and peers, step 7 replaced
        assert r["steps"] == {"3": ["file"], "6": ["file"], "7": ["ram"], "8": ["ram", "peer"]}, r
    again = run_job(3, CHILDREN / "timeline_child.py", shm_dir, obj, "resume")
    assert [(r["step"], r["run"], r["exact"]) for r in again] == [(8, 2, True)] * 3
    for r in again:  # the manager restores once: the store's restore, its plan gathered once, a DCP check
        step, run, exact, calls, reads, _ = r["manager"]
        store_calls, store_reads, plan_calls = r["store_cost"]
        assert (step, run, exact) == (8, 2, True) and reads == store_reads == 1, r
        assert plan_calls > 0 and calls == store_calls + 1, r
    shutil.rmtree(Path(shm_dir) / "node1")  # replaced: its shard of step 8 is only on its peer
    again = run_job(3, CHILDREN / "timeline_child.py", shm_dir, obj, "resume")
    assert [r["manager"][:3] for r in again] == [[8, 2, True]] * 3
    assert [(r["step"], r["run"], r["exact"]) for r in again] == [(8, 2, True)] * 3


def test_newer_steps_a_lost_node_lacks_are_passed_over_and_said(shm_dir, tmp_path):
    obj = str(tmp_path / "obj")
    run_job(4, CHILDREN / "timeline_child.py", shm_dir, obj, "run")  # 7, 8 in RAM and on peers; 3, 6 on file
    for node in (1, 2):  # rank 1's shard of 7 and 8, and its only replica, are gone
        shutil.rmtree(Path(shm_dir) / f"node{node}")
    out = run_job(4, CHILDREN / "timeline_child.py", shm_dir, obj, "resume")
    for r in out:
        assert (r["step"], r["run"], r["exact"]) == (6, 1, True), r
        assert r["manager"][:3] == [6, 1, True] and r["manager"][5] == [7, 8], r  # the manager says it too
        passed = {s: why for s, why in r["skipped"] if s in (7, 8)}  # peers keep only 8's replicas
        assert "rank(s) [1] " in passed[8] and "rank(s) [1, 2] " in passed[7], r["skipped"]


def test_two_neighbouring_nodes_lost_is_an_error_naming_the_steps_never_nothing(shm_dir):
    run_job(4, CHILDREN / "timeline_child.py", shm_dir, "-", "run")  # steps 7, 8 in RAM and on peers (ring)
    for node in (1, 2):  # replaced: rank 1's shard and its only replica (on rank 2) are gone
        shutil.rmtree(Path(shm_dir) / f"node{node}")
    out = run_job(4, CHILDREN / "timeline_child.py", shm_dir, "-", "lost")
    for r in out:
        kind, msg, steps = r["store"]
        assert kind == "CheckpointLostError" and steps == [7, 8], r
        assert "rank(s) [1]" in msg and "'ram'" in msg and "'peer'" in msg, msg
        assert r["manager"][0] == "CheckpointLostError", r  # never None: training would start from step 0


def test_after_a_restore_a_save_gathers_the_ranks_views_only_when_a_step_lies_above_it():
    """The steps between the restored step and the save go only along with a step above it, so the
    ranks' views (a gather whose bytes grow with the job) are asked for only then, not at every save
    after a restore."""
    from tierfs.core import timeline
    from tierfs.core.savevote import Vote

    def reduced(views: list[list[list[int]]], step: int) -> list[int]:
        votes = [Vote(["ram"], ["ram"], [], v, rank, 1, step) for rank, v in enumerate(views)]
        return [max(col) for col in zip(*(v.maxes for v in votes))]

    restored = 6
    after = [timeline.view({7, 8}, 9, restored), timeline.view({7}, 9, restored)]  # steps 7, 8 since the restore
    assert after[0] == [[], [7, 8]] and not Vote.supersedes(reduced(after, 9))
    assert timeline.superseded(after, 9, restored) == []  # what a gather would have found
    back = [timeline.view({7, 8}, 8, restored), timeline.view({7, 9}, 8, restored)]  # rank 1 holds step 9
    assert Vote.supersedes(reduced(back, 8)) and timeline.superseded(back, 8, restored) == [9, 7]
