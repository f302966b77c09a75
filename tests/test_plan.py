"""The planner's formulas against hand-computed cases, and the simulator against the planner."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tierfs.planning import (FailureClass, PlanInputs, Strategy, TierModel, checkpoint_bytes, cluster_mttf,
                             expected_goodput, expected_job_time, format_plan, make_plan, optimise, ram_per_host,
                             scaled, sustained_bandwidth, young_daly)
from tierfs.planning.simulate import simulate

MIN, HOUR, DAY = 60.0, 3600.0, 86400.0


# -- seed examples ------------------------------------------------------------------------------------

def test_seed_ramdisk_70b_on_32_hosts_is_60_gb():
    # Orbax's rule: 2 x (70e9 x 12 B / 32 hosts) + 15% = 2 x 26.25 GB x 1.15 = 60.375 GB
    ckpt = checkpoint_bytes(70e9)
    assert ckpt == 840e9
    r = ram_per_host(ckpt, 32, keep=1, in_flight=1, replicas=0, headroom=0.15)
    assert r.shard == 26.25e9
    assert r.own == 26.25e9 and r.in_flight == 26.25e9 and r.replicas == 0
    assert r.total == pytest.approx(60.375e9)
    plan = make_plan(PlanInputs(checkpoint=ckpt, hosts=32, accelerators=256, keep=1, replicas=0))
    assert plan.ram.total == pytest.approx(60.375e9)
    assert "60.38 GB" in format_plan(plan)


def test_ram_per_host_with_tierfs_defaults_and_a_replica():
    # keep 2 + 1 in flight + 1 replica of one step = 4 shards of 26.25 GB, + 15% = 120.75 GB
    r = ram_per_host(840e9, 32, keep=2, in_flight=1, replicas=1)
    assert r.total == pytest.approx(4 * 26.25e9 * 1.15)
    r = ram_per_host(840e9, 32, keep=1, in_flight=1, replicas=2, replica_keep=2, headroom=0.0)
    assert r.replicas == pytest.approx(4 * 26.25e9) and r.total == pytest.approx(6 * 26.25e9)


def test_seed_5tb_twenty_saves_per_mttf_needs_13_gb_per_s():
    # 124 min / 20 = 6.2 min = 372 s between saves; 5e12 B / 372 s = 13.44 GB/s; 86400 / 372 = 232 a day
    plan = make_plan(PlanInputs(checkpoint=5e12, hosts=3000, accelerators=24000, mttf=124 * MIN,
                                saves_per_mttf=20))
    rule = plan.object_rule
    assert rule is not None
    assert rule.interval == pytest.approx(372.0)
    assert rule.bandwidth_total == pytest.approx(5e12 / 372)
    assert round(rule.bandwidth_total / 1e9) == 13
    text = format_plan(plan)
    assert "every 6.2 min" in text and "13.44 GB/s" in text and "232 checkpoints/day" in text
    assert sustained_bandwidth(5e12, 372) == pytest.approx(13.44086e9, rel=1e-6)


def test_cluster_mttf_scales_with_accelerators():
    # the seed: 124 min at 24,000 accelerators is one accelerator failing every 124 x 24,000 min;
    # at 100,000 accelerators that is 29.76 min ("under 30 minutes for the largest clusters")
    per_accel = 124 * MIN * 24000
    assert cluster_mttf(per_accel, 24000) == pytest.approx(124 * MIN)
    assert cluster_mttf(per_accel, 100000) == pytest.approx(29.76 * MIN)
    p = scaled(PlanInputs(checkpoint=1e12, hosts=1, accelerators=8), 1000, per_accel, 8)
    assert p.hosts == 125 and p.accelerators == 1000 and p.mttf == pytest.approx(per_accel / 1000)


# -- formulas -----------------------------------------------------------------------------------------

def test_young_daly():
    assert young_daly(50.0, 7440.0) == pytest.approx(math.sqrt(744000.0))  # 862.55 s
    assert young_daly(2.0, 3600.0) == pytest.approx(120.0)
    assert young_daly(0.0, 3600.0) == 0.0
    assert math.isinf(young_daly(1.0, math.inf))


def test_goodput_one_tier_is_dalys_formula():
    # tau 600 s, save 60 s, recovery 120 s, MTTF 3600 s:
    # 600 / (3600 e^(120/3600) (e^(660/3600) - 1)) = 600 / (3600 x 1.033895 x 0.201240) = 0.801147
    s = Strategy("one", 600.0, (TierModel("object", 1, 60.0),), (FailureClass("any", 1.0, "object", 120.0),))
    assert expected_goodput(s, 3600.0) == pytest.approx(0.801147462610647, rel=1e-12)
    # without failures: training / (training + saves)
    assert expected_goodput(s, math.inf) == pytest.approx(600 / 660)
    # first order (Young): 1 - C/tau - tau/2M - R/M = 1 - 0.1 - 0.0833 - 0.0333 = 0.783, close for C << M
    assert abs(expected_goodput(s, 3600.0) - (1 - 60 / 600 - 660 / 7200 - 120 / 3600)) < 0.03
    assert expected_job_time(s, 3600.0, 6000.0) == pytest.approx(10 * 600 / 0.801147462610647)


def test_goodput_two_tiers_by_hand():
    # RAM every 100 s (1 s), object every 5th RAM step (2 s blocking, 10 s until usable);
    # half the failures restart the process (RAM, 10 s), half lose the node (object, 50 s); MTTF 10,000 s
    s = Strategy("two", 100.0, (TierModel("ram", 1, 1.0), TierModel("object", 5, 2.0, lag=10.0)),
                 (FailureClass("process", 0.5, "ram", 10.0), FailureClass("node", 0.5, "object", 50.0)))
    m = 10000.0
    wall = 100 + 1 + 2 / 5  # 101.4 s per RAM interval
    e = math.exp(wall / m) - 1
    hit = 0.5 * (1 - math.exp(-10 / m)) + 0.5 * (1 - math.exp(-50 / m))
    recover = m * hit / (1 - hit)
    behind = 0.5 * 0 + 0.5 * ((5 - 1) / 2 * wall + 10)  # object copies are 2 intervals + 10 s further back
    want = 100 / (e * (m + recover) / (1 - e * behind / wall))
    assert expected_goodput(s, m) == pytest.approx(want, rel=1e-12)
    assert 0.96 < want < 0.97  # first order: 1 - 1.4/100 - 1e-4 x (60.7 + 313.5) / 2 = 0.967


def test_optimise_finds_the_maximum_near_young_daly():
    s = Strategy("one", 100.0, (TierModel("object", 1, 30.0),), (FailureClass("any", 1.0, "object", 60.0),))
    best = optimise(s, 7200.0, step_time=10.0)
    yd = young_daly(30.0, 7200.0)  # 657 s
    assert best.interval % 10 == 0
    assert abs(best.interval - yd) / yd < 0.15  # Daly's higher-order terms move it a little
    g = expected_goodput(best, 7200.0)
    for tau in (best.interval - 10, best.interval + 10, _r(yd, 10)):
        assert expected_goodput(Strategy("x", tau, s.tiers, s.classes), 7200.0) <= g + 1e-12


def _r(x: float, step: float) -> float:
    return round(x / step) * step


def _inputs(**kw) -> PlanInputs:
    """A 5 TB checkpoint on 24,000 accelerators (3,000 hosts), MTTF 124 min, measured-looking bandwidths."""
    base = dict(checkpoint=5e12, hosts=3000, accelerators=24000, mttf=124 * MIN, replicas=1, ram_save=5e9,
                ram_restore=5e9, peer=3e9, object_write=0.2e9, object_read=0.3e9, object_total=100e9, step_time=5.0)
    base.update(kw)
    return PlanInputs(**base)


def test_plan_strategies_intervals_and_bandwidths():
    p = _inputs()
    plan = make_plan(p)
    names = [sp.strategy.name for sp in plan.strategies]
    assert names == ["object alone", "RAM + object", "RAM + peers + object"]
    obj, ram_obj, peers = plan.strategies
    # object alone: a synchronous 5e12 / 100e9 = 50 s upload; Young/Daly against the full MTTF
    t = obj.tiers[0]
    assert t.blocking == pytest.approx(50.0) and t.young_daly == pytest.approx(math.sqrt(2 * 50 * 7440))
    assert t.interval % 5 == 0
    # recovery: restart 60 s + download 5e12 / min(3000 x 0.3e9, 100e9) = 50 s
    assert [c.recovery for c in obj.strategy.classes] == [pytest.approx(110.0)] * 2
    # RAM: a shard of 5e12 / 3000 = 1.667 GB copied at 5 GB/s blocks 0.333 s
    ram = ram_obj.tiers[0]
    assert ram.blocking == pytest.approx(5e12 / 3000 / 5e9)
    assert ram.young_daly == pytest.approx(math.sqrt(2 * ram.blocking * 2 * 7440))  # process failures: half
    # bandwidth a tier needs: its bytes per (every x mean wall time of an interval)
    st = ram_obj.strategy
    o = st.tier("object")
    assert ram_obj.tiers[1].bandwidth_total == pytest.approx(5e12 / (o.every * st.wall_per_interval()))
    assert o.blocking == pytest.approx(0.05 * 50.0) and o.lag == pytest.approx(50.0)
    # slower tiers are whole multiples of the RAM interval, an object step is also a peer step
    pe, ob = peers.strategy.tier("peer"), peers.strategy.tier("object")
    assert ob.every % pe.every == 0
    assert peers.tiers[1].transfer == pytest.approx(5e12 / 3000 / 3e9)
    # more tiers, more goodput
    assert obj.goodput < ram_obj.goodput < peers.goodput


def test_plan_without_bandwidths_or_mttf_says_what_is_missing():
    plan = make_plan(PlanInputs(checkpoint=840e9, hosts=32, accelerators=256))
    assert not plan.strategies and any("MTTF" in n for n in plan.notes)
    plan = make_plan(_inputs(ram_save=None))
    assert [sp.strategy.name for sp in plan.strategies] == ["object alone"]
    assert any("RAM-tier bandwidth" in n for n in plan.notes)
    plan = make_plan(_inputs(replicas=0))
    assert len(plan.strategies) == 2 and any("--replicas 0" in n for n in plan.notes)


def test_fixed_intervals_are_kept():
    plan = make_plan(_inputs(intervals={"ram": 60.0, "object": 600.0}))
    st = plan.strategies[1].strategy
    assert st.interval == 60.0 and st.tier("object").every == 10


@pytest.mark.parametrize("kw, needle", [
    (dict(node_loss=1.5), "node loss"),
    (dict(hosts=0), "hosts"),
    (dict(object_write=-1.0), "bandwidth"),
    (dict(intervals={"tape": 5.0}), "fixed interval"),
])
def test_bad_inputs(kw, needle):
    with pytest.raises(ValueError, match=needle):
        _inputs(**kw)


# -- the simulator against the analytic figures --------------------------------------------------------

def test_simulation_of_one_tier_agrees_with_daly_within_its_ci():
    s = Strategy("one", 600.0, (TierModel("object", 1, 60.0),), (FailureClass("any", 1.0, "object", 120.0),))
    work = 200 * HOUR
    r = simulate(s, 3600.0, work, runs=400, seed=3)
    assert expected_job_time(s, 3600.0, work) in r.job_time
    assert expected_goodput(s, 3600.0) in r.goodput
    assert r.failures.mean == pytest.approx(r.job_time.mean / 3600.0, rel=0.02)
    # the job's time is its training, its saves, the work failures threw away and the recovering
    assert r.job_time.mean == pytest.approx(work + r.save_time + r.work_lost.mean + r.recovering.mean, rel=1e-9)
    assert r.save_time == pytest.approx(1200 * 60.0)


def test_simulation_with_two_classes_of_recovery_agrees_within_its_ci():
    # one tier (RAM), process restarts (20 s) and slow restarts (300 s): exact in the model too
    s = Strategy("ram", 120.0, (TierModel("ram", 1, 2.0),),
                 (FailureClass("fast", 0.7, "ram", 20.0), FailureClass("slow", 0.3, "ram", 300.0)))
    r = simulate(s, 1800.0, 100 * HOUR, runs=300, seed=11)
    assert expected_goodput(s, 1800.0) in r.goodput


def test_simulation_of_planned_strategies_agrees_with_the_plan():
    p = _inputs(replica_loss=0.1)
    for sp in make_plan(p).strategies:
        r = simulate(sp.strategy, p.mttf, 30 * DAY, runs=200, seed=7)
        assert sp.goodput in r.goodput, (sp.strategy.name, sp.goodput, r.goodput)


def test_simulation_at_100k_accelerators():
    # 29.8 min MTTF, a 30-day job: about 1,600 failures per run, 200 runs at once
    p = scaled(_inputs(), 100000, 124 * MIN * 24000, 8)
    plan = make_plan(p)
    res = {sp.strategy.name: (sp, simulate(sp.strategy, p.mttf, 30 * DAY, runs=200, seed=5))
           for sp in plan.strategies}
    assert res["object alone"][1].goodput.high < res["RAM + object"][1].goodput.low
    assert res["RAM + object"][1].goodput.high < res["RAM + peers + object"][1].goodput.low
    for sp, r in res.values():
        # multi-tier goodput is a first-order model: within 0.2 percentage points here (docs/planning.md)
        assert abs(r.goodput.mean - sp.goodput) < 0.002, sp.strategy.name
        assert r.failures.mean > 1000


def test_simulation_is_reproducible_and_checks_its_inputs():
    s = Strategy("one", 600.0, (TierModel("object", 1, 60.0),), (FailureClass("any", 1.0, "object", 120.0),))
    a = simulate(s, 3600.0, 50 * HOUR, runs=50, seed=1)
    b = simulate(s, 3600.0, 50 * HOUR, runs=50, seed=1)
    c = simulate(s, 3600.0, 50 * HOUR, runs=50, seed=2)
    assert a == b and a != c
    # no failures in sight: the job takes its training plus its saves
    r = simulate(s, 1e15, 50 * HOUR, runs=10, seed=0)
    assert r.job_time.mean == pytest.approx(50 * HOUR + 300 * 60.0)
    assert r.failures.mean == 0
    # recovery longer than the time between failures: the job never finishes
    hopeless = Strategy("x", 600.0, (TierModel("object", 1, 60.0),), (FailureClass("any", 1.0, "object", 1e5),))
    with pytest.raises(ValueError, match="unfinished"):
        simulate(hopeless, 60.0, 10 * HOUR, runs=4, seed=0, max_failures=200)
    with pytest.raises(ValueError, match="runs"):
        simulate(s, 3600.0, HOUR, runs=1)


def test_estimate_ci():
    from tierfs.planning.simulate import Estimate

    e = Estimate.of(np.array([1.0, 2.0, 3.0, 4.0]))
    # mean 2.5, sd 1.2910, half width 1.96 x 1.2910 / 2 = 1.2652
    assert e.mean == 2.5 and e.half_width == pytest.approx(1.959964 * 1.290994 / 2, rel=1e-5)
    assert 2.0 in e and 4.0 not in e


def test_data_parallel_stores_each_distinct_byte_once_and_replicates_nothing():
    ckpt = checkpoint_bytes(70e9)  # 840 GB, 64 copies over 1024 hosts
    base = dict(checkpoint=ckpt, hosts=1024, accelerators=8192, mttf=3600.0 * 5, ram_save=5e9, peer=10e9,
                object_write=1e9, replicas=1)
    plan = make_plan(PlanInputs(**base, data_parallel=64))
    assert plan.inputs.shard == pytest.approx(ckpt * 64 / 1024)
    assert plan.ram.replicas == 0 and plan.ram.own == pytest.approx(2 * ckpt * 64 / 1024)
    by_name = {sp.strategy.name: sp for sp in plan.strategies}
    dp = by_name["RAM + data-parallel peers + object"]
    assert "RAM + peers + object" not in by_name
    obj = dp.strategy.tier("object")
    assert obj.nbytes_total == pytest.approx(ckpt) and obj.nbytes_per_host == pytest.approx(ckpt / 1024)
    node = next(c for c in dp.strategy.classes if c.name == "node")
    assert node.tier == "ram" and node.recovery == pytest.approx(60 + ckpt * 64 / 1024 / 10e9)
    assert "not 53.76 TB" in format_plan(plan)
    with pytest.raises(ValueError, match="data-parallel degree 2048"):
        PlanInputs(**base, data_parallel=2048)
