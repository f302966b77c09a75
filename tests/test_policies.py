"""Every policy, alone and combined, on scripted steps and times (the clock is injected; no sleeps)."""

from __future__ import annotations

import pytest

from tierfs.policies import (AnyPreservationPolicy, AnySavePolicy, BestN, ContinuousCheckpointingPolicy,
                             CustomSteps, EveryNSeconds, EveryNSteps, FixedIntervalPolicy, InitialSavePolicy,
                             LatestN, PreemptionCheckpointingPolicy, PreserveAll, RestorePolicy, SaveContext,
                             SpecificStepsPolicy, StepInfo)


def run(policy, steps, times=None, preempted_at=()):
    """Drive a save policy like the store does: history grows by what it saves."""
    saved: list[StepInfo] = []
    for i, s in enumerate(steps):
        t = times[i] if times else float(s)
        if policy.should_save(SaveContext(s, t, tuple(saved), preempted=s in preempted_at)):
            saved.append(StepInfo(s, t))
    return [i.step for i in saved]


def test_fixed_interval():
    assert run(FixedIntervalPolicy(5), range(23)) == [0, 5, 10, 15, 20]
    with pytest.raises(ValueError, match="positive"):
        FixedIntervalPolicy(0)


def test_specific_steps():
    assert run(SpecificStepsPolicy([3, 7, 100]), range(10)) == [3, 7]


def test_continuous_by_time():
    times = [0, 10, 25, 29, 31, 59, 61, 62, 95]
    assert run(ContinuousCheckpointingPolicy(minimum_interval_secs=30), range(9), times) == [0, 4, 6, 8]
    assert run(ContinuousCheckpointingPolicy(minimum_interval_secs=0), range(4), [0, 0, 0, 0]) == [0, 1, 2, 3]


def test_preemption_and_initial():
    assert run(PreemptionCheckpointingPolicy(), range(10), preempted_at={6}) == [6]
    assert run(InitialSavePolicy(), range(5, 10)) == [5]


def test_any_save_policy_combines():
    p = AnySavePolicy([FixedIntervalPolicy(10), InitialSavePolicy(), PreemptionCheckpointingPolicy()])
    assert run(p, range(3, 25), preempted_at={17}) == [3, 10, 17, 20]
    with pytest.raises(ValueError):
        AnySavePolicy([])


def infos(steps, times=None, metrics=None):
    return [StepInfo(s, times[i] if times else float(s), (metrics or {}).get(s, {})) for i, s in enumerate(steps)]


def test_latest_n_and_every_n_steps():
    assert LatestN(3).keep(infos(range(10))) == {7, 8, 9}
    assert EveryNSteps(4).keep(infos(range(10))) == {0, 4, 8}
    both = AnyPreservationPolicy([LatestN(3), EveryNSteps(1000)])
    assert both.keep(infos([0, 500, 1000, 1500, 1900, 2000, 2100])) == {0, 1000, 2000, 1900, 2100}


def test_every_n_seconds_keeps_one_per_interval():
    times = [0, 100, 3500, 3700, 7300, 7400, 9000]
    assert EveryNSeconds(3600).keep(infos(range(7), times)) == {0, 3, 4}


def test_best_n_min_and_max_and_missing_metrics():
    metrics = {1: {"loss": 0.9}, 2: {"loss": 0.5}, 3: {}, 4: {"loss": 0.7}, 5: {"loss": 0.5}}
    assert BestN(lambda m: m["loss"], 2, "min").keep(infos(range(1, 6), metrics=metrics)) == {2, 5}
    assert BestN(lambda m: m["loss"], 1, "max").keep(infos(range(1, 6), metrics=metrics)) == {1}
    with pytest.raises(ValueError, match="mode"):
        BestN(lambda m: m["loss"], 1, "best")


def test_custom_steps_and_preserve_all():
    assert CustomSteps([2, 4, 99]).keep(infos(range(6))) == {2, 4}
    assert PreserveAll().keep(infos(range(6))) == set(range(6))


def test_retention_over_a_scripted_run():
    """LatestN(2) or every 5th, applied after each save as the store does."""
    keep = AnyPreservationPolicy([LatestN(2), EveryNSteps(5)])
    held: list[StepInfo] = []
    for s in range(13):
        held.append(StepInfo(s, float(s)))
        kept = keep.keep(held)
        held = [i for i in held if i.step in kept]
    assert [i.step for i in held] == [0, 5, 10, 11, 12]


def test_restore_policy_orders_and_forbids():
    tiers = ["ram", "peer", "s3"]
    assert RestorePolicy().order(tiers) == tiers
    assert RestorePolicy(prefer=["s3"]).order(tiers) == ["s3", "ram", "peer"]
    assert RestorePolicy(forbid=["s3"]).order(tiers) == ["ram", "peer"]
    with pytest.raises(ValueError, match="unknown tiers"):
        RestorePolicy(prefer=["gcs"]).order(tiers)


def test_time_policies_through_the_store_with_an_injected_clock(tmp_path):
    """The store hands its clock to the policies: a scripted clock drives time-based saving and keeping."""
    import numpy as np

    from tierfs import TieredStore
    from tierfs.tiers import MemoryTier

    now = [0.0]
    tier = MemoryTier(str(tmp_path / "ram"), save=ContinuousCheckpointingPolicy(minimum_interval_secs=60),
                      keep=AnyPreservationPolicy([LatestN(1), EveryNSeconds(300)]))
    times = [0, 30, 59, 60, 100, 200, 299, 301, 400, 650, 700, 900]
    with TieredStore([tier], clock=lambda: now[0]) as store:
        saved = []
        for step, t in enumerate(times):
            now[0] = float(t)
            if store.save(step, {"x": np.full(3, step)}):
                saved.append(step)
        assert saved == [0, 3, 5, 6, 8, 9, 11]  # t = 0, 60, 200, 299, 400, 650, 900: 60 s apart at least
        # kept after each save: the newest, plus one per 300 s greedily from the oldest (t = 0, 400, 900)
        assert sorted(store.steps()) == [0, 8, 11]
