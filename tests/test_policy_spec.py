"""Policies from a config file's JSON specs, and retention applied on demand (what ``tierfs gc`` runs)."""

from __future__ import annotations

import numpy as np
import pytest

from tierfs import TieredStore
from tierfs.policies import (AnyPreservationPolicy, AnySavePolicy, BestN, ContinuousCheckpointingPolicy,
                             CustomSteps, EveryNSeconds, EveryNSteps, FixedIntervalPolicy, InitialSavePolicy,
                             LatestN, PreserveAll, SaveContext, StepInfo)
from tierfs.policies.spec import keep_policy, save_policy
from tierfs.tiers import MemoryTier


def test_keep_specs():
    assert keep_policy({"latest": 3}) == LatestN(3)
    assert keep_policy({"every_n_steps": 1000}) == EveryNSteps(1000)
    assert keep_policy({"every_n_seconds": 3600}) == EveryNSeconds(3600.0)
    assert keep_policy({"steps": [1, 5]}) == CustomSteps([1, 5])
    assert keep_policy("all") == PreserveAll() == keep_policy({"all": True})
    both = keep_policy({"latest": 2, "every_n_steps": 10})
    assert both == AnyPreservationPolicy([LatestN(2), EveryNSteps(10)])
    assert both.keep([StepInfo(s) for s in (10, 11, 12, 13)]) == {10, 12, 13}
    best = keep_policy({"best": {"metric": "loss", "n": 1, "mode": "min"}})
    assert isinstance(best, BestN)
    assert best.keep([StepInfo(1, 0, {"loss": 0.5}), StepInfo(2, 0, {"loss": 0.2}), StepInfo(3, 0, {})]) == {2}


def test_save_specs():
    assert save_policy({"every_n_steps": 10}) == FixedIntervalPolicy(10)
    assert save_policy({"every_n_seconds": 60}) == ContinuousCheckpointingPolicy(60.0)
    p = save_policy({"initial": True, "every_n_steps": 5})
    assert p == AnySavePolicy([InitialSavePolicy(), FixedIntervalPolicy(5)])
    assert p.should_save(SaveContext(step=3, time=0.0)) and not p.should_save(
        SaveContext(step=3, time=0.0, previous=(StepInfo(0),)))


@pytest.mark.parametrize("spec, needle", [
    ({"latest": 0}, "positive integer"),
    ({"latest": True}, "positive integer"),
    ({"newest": 2}, "unknown keep keys"),
    ({}, "keep spec"),
    ({"best": {"n": 2}}, '"metric"'),
    ({"all": False}, "takes true"),
    ({"steps": [1, -2]}, "list of step numbers"),
])
def test_bad_keep_specs(spec, needle):
    with pytest.raises(ValueError, match=needle):
        keep_policy(spec)


def test_bad_save_spec():
    with pytest.raises(ValueError, match="unknown save keys"):
        save_policy({"every": 10})


def test_apply_retention_on_a_store_that_saved_nothing(shm_dir):
    with TieredStore([MemoryTier(shm_dir, keep=PreserveAll())]) as store:
        for s in (1, 2, 3, 4):
            store.save(s, {"w": np.full(100, float(s))}, metrics={"loss": 1.0 / s if s != 2 else 0.01})
    # a later process (as `tierfs gc`): metrics come from the manifests, the newest step always stays
    tier = MemoryTier(shm_dir, keep=keep_policy({"best": {"metric": "loss", "n": 1}}))
    with TieredStore([tier], cleanup=False) as store:
        assert store.retention_plan() == {"ram": [1, 3]}
        assert tier.committed_steps() == [1, 2, 3, 4]  # a plan deletes nothing
        assert store.apply_retention() == {"ram": [1, 3]}
        assert tier.committed_steps() == [2, 4]
        assert store.apply_retention() == {"ram": []}
