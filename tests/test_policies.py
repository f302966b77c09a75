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


def test_which_keep_policies_use_the_steps_times_or_metrics():
    assert not any(p.uses_info for p in (LatestN(2), EveryNSteps(10), CustomSteps([1]), PreserveAll()))
    assert EveryNSeconds(60).uses_info and BestN(lambda m: m["loss"], 1).uses_info
    assert not AnyPreservationPolicy([LatestN(1), EveryNSteps(5)]).uses_info
    assert AnyPreservationPolicy([LatestN(1), BestN(lambda m: m["loss"], 1)]).uses_info


def test_a_restarted_job_keeps_the_best_step_of_the_run_before(tmp_path):
    """The object tier keeps the newest step and the one of least loss. A job started again (a new store:
    it did not save the earlier steps) reads their metrics from their manifests before its retention
    judges them, so the best step of the first run stays when the second saves."""
    import numpy as np

    from tierfs import TieredStore
    from tierfs.tiers import MemoryTier, ObjectTier

    def tiers():
        return [MemoryTier(str(tmp_path / "ram"), keep=LatestN(1)),
                ObjectTier(f"file://{tmp_path}/obj", keep=AnyPreservationPolicy([LatestN(1), BestN(lambda m: m["loss"], 1)]))]

    with TieredStore(tiers()) as store:
        for step, loss in ((1, 0.1), (2, 0.5), (3, 0.9)):
            store.save(step, {"w": np.full(4, step, np.float32)}, metrics={"loss": loss})
            store.wait_until_finished()
        assert {s: t for s, t in store.steps().items() if "file" in t} == {1: ["file"], 3: ["ram", "file"]}
    with TieredStore(tiers()) as store:
        assert store.restore()[1].step == 3
        store.save(4, {"w": np.full(4, 4, np.float32)}, metrics={"loss": 0.8})
        store.wait_until_finished()
        assert {s: t for s, t in store.steps().items() if "file" in t} == {1: ["file"], 4: ["ram", "file"]}
        out, info = store.restore(step=1)
        assert info.step == 1 and (out["w"] == 1).all()


def test_a_step_of_the_run_before_whose_metrics_cannot_be_read_is_kept_and_named(tmp_path, caplog):
    """The manifest of the first run's best step is damaged on the object tier: a restarted job cannot read
    its loss, so its retention keeps that step (saying why) instead of judging it as if it had none (which
    would delete it)."""
    import numpy as np

    from tierfs import TieredStore
    from tierfs.format import manifest_filename, step_dirname
    from tierfs.tiers import ObjectTier

    def tiers():
        return [ObjectTier(f"file://{tmp_path}/obj", keep=AnyPreservationPolicy([LatestN(1), BestN(lambda m: m["loss"], 1)]))]

    with TieredStore(tiers()) as store:
        for step, loss in ((1, 0.1), (2, 0.5)):
            store.save(step, {"w": np.full(4, step, np.float32)}, metrics={"loss": loss})
    damaged = next(p for p in (tmp_path / "obj").rglob(manifest_filename(0)) if step_dirname(1) in str(p))
    damaged.write_bytes(damaged.read_bytes().replace(b'"loss"', b'"lass"'))
    with TieredStore(tiers()) as store:
        store.save(3, {"w": np.full(4, 3, np.float32)}, metrics={"loss": 0.9})
        # step 1 kept, unjudged; of the steps it could judge the policy keeps the newest and the best (2)
        assert sorted(store.steps()) == [1, 2, 3]
    assert any("step 1: no readable marker or manifest" in r.getMessage() and "keeps it" in r.getMessage()
               for r in caplog.records)


@pytest.mark.parametrize("keep,held,relied,gone", [
    (LatestN(2), {1, 2, 3}, 1, [2]),  # the peers' step 1 in place of step 2, which no peer holds
    (LatestN(2), {1, 2, 3}, 2, [1]),  # the peers hold a step the policy keeps: as the policy says
    (LatestN(3), {1, 2, 3, 4}, 1, [2]),
    (LatestN(1), {1, 2}, 1, [1]),  # one step kept: the newest, never the peers' beside it
    (LatestN(2), {1, 2, 3}, None, [1]),
    (EveryNSteps(10), {10, 17, 20, 23}, 17, [17]),  # never in place of a step kept for the long run
    (AnyPreservationPolicy([LatestN(2), EveryNSteps(10)]), {9, 10, 11, 12}, 9, [11]),  # 11: kept until 13 comes
])
def test_ram_keeps_the_step_the_peers_hold_in_place_of_a_newer_one_they_lack(keep, held, relied, gone):
    """The first tier keeps the replicator's newest step (a lost node comes back to it beside every other
    rank's own copy) instead of the oldest newer step its policy keeps, never beside them, and never
    instead of its own newest step."""
    from tierfs.core.ledger import Snapshot
    from tierfs.core.retention import doomed
    from tierfs.tiers import MemoryTier

    tier = MemoryTier("/dev/shm/unused", keep=keep)
    snap = Snapshot({"ram": set(held), "peer": {relied} if relied else set()}, frozenset(), {},
                    {"ram": frozenset(), "peer": frozenset()})
    assert doomed(tier, snap, relied=relied) == gone
