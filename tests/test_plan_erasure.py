"""The planner's erasure-coded peer tier (``plan --parity``, ``simulate --parity``): the group rule, RAM per
host, the probability of losing a step against enumeration and against the Monte-Carlo, and the CLI."""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tierfs.cli import main
from tierfs.planning import (Erasure, PlanInputs, erasure_loss_probability, erasure_ram, group_sizes, make_plan,
                             node_loss_probability, node_mtbf, parse_erasure, ram_per_host, replica_loss_probability)
from tierfs.planning.erasure import group_of, held_fraction, ring_sizes, run_loss_probability
from tierfs.planning.layouts import compare
from tierfs.planning.losses import binomial_ci95, count_losses
from tierfs.tiers.placement import replica_targets

REPO = Path(__file__).resolve().parents[1]


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


# -- groups ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n, code, groups", [
    (4, "4+1", {4: 1}), (5, "4+1", {5: 1}), (6, "4+1", {6: 1}), (9, "4+1", {9: 1}), (10, "4+1", {5: 2}),
    (1000, "4+1", {5: 200}), (1003, "4+1", {5: 197, 6: 3}), (100000, "4+1", {5: 20000}),
    (4, "4+2", {4: 1}), (5, "4+2", {5: 1}), (6, "4+2", {6: 1}), (9, "4+2", {9: 1}), (10, "4+2", {10: 1}),
    (1000, "4+2", {6: 162, 7: 4}), (1003, "4+2", {6: 166, 7: 1}), (100000, "4+2", {6: 16662, 7: 4}),
])
def test_group_rule(n, code, groups):
    e = parse_erasure(code)
    sizes = group_sizes(n, e.data, e.parity)
    assert {s: sizes.count(s) for s in set(sizes)} == groups
    assert sum(sizes) == n and list(sizes) == sorted(sizes)  # the larger groups are the last ones
    # every node in one group: k consecutive nodes each, the remainder one each to the last groups
    of = group_of(n, e.data, e.parity)
    assert of.shape == (n,) and list(np.bincount(of)) == list(sizes)
    if len(sizes) > 1:
        k = e.width
        assert list(of[:k * len(sizes)]) == list(np.repeat(np.arange(len(sizes)), k))
        assert list(of[k * len(sizes):]) == [len(sizes) - 1 - x for x in range(n % k)]
    # data pieces per group: size - parity
    assert all(s - e.parity >= 1 for s in sizes)


def test_too_few_hosts_and_bad_codes():
    assert group_sizes(2, 4, 1) == (2,)  # parity + 1 nodes suffice
    assert group_sizes(3, 4, 2) == (3,)
    with pytest.raises(ValueError, match="at least 2 hosts"):
        group_sizes(1, 4, 1)
    with pytest.raises(ValueError, match="at least 3 hosts"):
        group_sizes(2, 4, 2)
    with pytest.raises(ValueError, match="at least 3 hosts"):
        PlanInputs(checkpoint=1e12, hosts=2, accelerators=16, erasure=(Erasure(4, 2),))
    for bad in ("4-1", "4+", "+1", "x", "4+1+1", ""):
        with pytest.raises(ValueError, match="DATA\\+PARITY"):
            parse_erasure(bad)
    for bad in ("0+1", "4+0"):
        with pytest.raises(ValueError, match="data >= 1 and parity >= 1"):
            parse_erasure(bad)
    assert parse_erasure(" 8 + 2 ") == Erasure(8, 2) and str(Erasure(8, 2)) == "8+2"


# -- RAM ------------------------------------------------------------------------------------------------

def test_ram_per_host():
    shard = 840e9 / 1000
    # per kept step: own shard + parity/d of a shard; 4+1 is 1.25 x against 2.0 x (replicas=1), 3.0 x (=2)
    one = dict(keep=1, in_flight=0, replica_keep=1, headroom=0.0)
    assert erasure_ram(840e9, 1000, 4, 1, **one).total == pytest.approx(1.25 * shard)
    assert erasure_ram(840e9, 1000, 4, 2, **one).total == pytest.approx(1.5 * shard)
    assert ram_per_host(840e9, 1000, replicas=1, **one).total == pytest.approx(2.0 * shard)
    assert ram_per_host(840e9, 1000, replicas=2, **one).total == pytest.approx(3.0 * shard)
    # a group of k + 1 keeps the same parity over one more data node: less per host
    assert held_fraction(5, 1) == 0.25 and held_fraction(6, 1) == 0.2
    assert held_fraction(6, 2) == 0.5 and held_fraction(7, 2) == 0.4
    # small jobs: one group of all the nodes
    assert erasure_ram(1e9, 4, 4, 1, **one).replicas == pytest.approx(1e9 / 4 / 3)
    assert erasure_ram(1e9, 9, 4, 1, **one).replicas == pytest.approx(1e9 / 9 / 8)
    # the most a host needs is the smallest group's: 1003 hosts with 4+1 are 197 groups of 5 and 3 of 6
    r = erasure_ram(840e9, 1003, 4, 1)  # keep 2, 1 in flight, 1 kept step of parity, 15% headroom
    s = 840e9 / 1003
    assert r.replicas == pytest.approx(0.25 * s) and r.total == pytest.approx((2 + 1 + 0.25) * s * 1.15)
    assert erasure_ram(840e9, 1003, 4, 1, replica_keep=2).replicas == pytest.approx(0.5 * s)


# -- the probability of losing a step -------------------------------------------------------------------

def _enumerate(n: int, lost, p: float) -> float:
    """P(lost(pattern)) over every pattern of lost nodes."""
    return sum(math.prod(p if b else 1 - p for b in bits)
               for bits in itertools.product((0, 1), repeat=n) if lost(bits))


@pytest.mark.parametrize("n", [2, 3, 4, 5, 6, 7, 9, 11])
def test_loss_formulas_against_enumeration(n):
    p = 0.3
    for r in (1, 2, 3):
        for placement in ("ring", "pairwise"):
            if n < r + 1:
                continue
            holders = replica_targets(list(range(n)), r, placement)  # where PeerTier puts the replicas
            want = _enumerate(n, lambda b: any(b[i] and all(b[j] for j in holders[i]) for i in range(n)), p)
            assert replica_loss_probability(n, r, p, placement) == pytest.approx(want, rel=1e-12, abs=1e-15)
    for e in (Erasure(4, 1), Erasure(4, 2), Erasure(2, 1)):
        if n < e.parity + 1:
            continue
        of = group_of(n, e.data, e.parity)
        want = _enumerate(n, lambda b: max(np.bincount(of, weights=b)) > e.parity, p)
        assert erasure_loss_probability(n, e.data, e.parity, p) == pytest.approx(want, rel=1e-12, abs=1e-15)


def test_loss_formulas_keep_small_probabilities():
    # no 1 - (1 - x): at 100,000 nodes and p = 1e-9 the first-order terms hold to a part in a million
    n, p = 100000, 1e-9
    assert replica_loss_probability(n, 1, p) == pytest.approx(n * p ** 2, rel=1e-6)
    assert replica_loss_probability(n, 2, p) == pytest.approx(n * p ** 3, rel=1e-6)
    assert replica_loss_probability(n, 1, p, "pairwise") == pytest.approx(n / 2 * p ** 2, rel=1e-6)
    assert erasure_loss_probability(n, 4, 1, p) == pytest.approx(20000 * 10 * p ** 2, rel=1e-6)  # 2 n p^2
    assert erasure_loss_probability(n, 4, 2, p) == pytest.approx(16662 * 20 * p ** 3 + 4 * 35 * p ** 3, rel=1e-6)
    assert run_loss_probability(5, 5, 0.5) == pytest.approx(0.5 ** 5)
    assert ring_sizes(7, 2, "pairwise") == (3, 4)
    assert node_loss_probability(3600.0, node_mtbf(1800.0, 1000, 0.5)) == pytest.approx(-math.expm1(-3600 / 3.6e6))
    assert math.isinf(node_mtbf(1800.0, 1000, 0.0)) and node_loss_probability(60.0, math.inf) == 0.0


def test_loss_formulas_against_the_monte_carlo():
    # 1003 nodes (4+1: 197 groups of 5 and 3 of 6), each lost within an interval with p = 1%: every
    # layout loses enough steps in 20,000 intervals to test the formula (seeded)
    n, p = 1003, 0.01
    interval, mtbf = -math.log1p(-p), 1.0  # p = 1 - exp(-interval / mtbf)
    specs = [1, 2, Erasure(4, 1), Erasure(4, 2)]
    counts = count_losses(n, specs, mtbf, interval, 20000, seed=1)
    assert [c.layout for c in counts] == ["replicas=1", "replicas=2", "erasure 4+1", "erasure 4+2"]
    want = [replica_loss_probability(n, 1, p), replica_loss_probability(n, 2, p),
            erasure_loss_probability(n, 4, 1, p), erasure_loss_probability(n, 4, 2, p)]
    for c, w in zip(counts, want):
        assert c.intervals == 20000 and c.lost > 15
        assert w in c, (c, w)
    assert 0.17 < want[2] < 0.19 and 0.09 < want[0] < 0.1  # 4+1 loses about twice what replicas=1 does
    pairwise = count_losses(n, [1, 2], mtbf, interval, 20000, seed=2, placement="pairwise")
    assert replica_loss_probability(n, 1, p, "pairwise") in pairwise[0]
    assert replica_loss_probability(n, 2, p, "pairwise") in pairwise[1]
    assert count_losses(n, specs, mtbf, interval, 50, seed=3) == count_losses(n, specs, mtbf, interval, 50, seed=3)


def test_binomial_interval():
    assert binomial_ci95(0, 100) == (0.0, pytest.approx(1 - 0.025 ** (1 / 100)))
    lo, hi = binomial_ci95(5, 100)  # Clopper-Pearson: 0.0164, 0.1128
    assert lo == pytest.approx(0.016432, rel=1e-4) and hi == pytest.approx(0.112835, rel=1e-4)
    lo, hi = binomial_ci95(95, 100)
    assert lo == pytest.approx(1 - 0.112835, rel=1e-4) and hi == pytest.approx(1 - 0.016432, rel=1e-4)
    lo, hi = binomial_ci95(3596, 20000)
    assert lo < 3596 / 20000 < hi and hi - lo == pytest.approx(2 * 1.96 * math.sqrt(0.18 * 0.82 / 20000), rel=0.01)


# -- plan and simulate ----------------------------------------------------------------------------------

PLAN = ["--checkpoint-size", "840GB", "--hosts", "1003", "--accelerator-mttf", "5.66y", "--ram-bw", "5GB/s",
        "--peer-bw", "3GB/s", "--object-bw", "200MB/s", "--step-time", "10s"]


def _layout_rows(out: str) -> dict[str, list[str]]:
    table = out.split("peer tier: ")[1].split("\n  save interval")[0].splitlines()[3:]
    cells = [re.split(r"\s{2,}", ln.strip()) for ln in table]
    return {c[0]: c[1:] for c in cells}


def test_plan_prints_the_erasure_coded_rows_beside_replicas(capsys):
    code, out, err = run(capsys, "plan", *PLAN, "--parity", "4+1", "--parity", "4+2,4+1")
    assert code == 0, err
    rows = _layout_rows(out)
    assert list(rows) == ["replicas=1", "replicas=2", "erasure 4+1", "erasure 4+2"]
    assert rows["replicas=1"][:2] == ["ring of 1003", "1.00"]
    assert rows["erasure 4+1"][:2] == ["197 of 5, 3 of 6", "0.25, 0.20"]
    assert rows["erasure 4+2"][:2] == ["166 of 6, 1 of 7", "0.50, 0.40"]
    shard = 840e9 / 1003
    assert rows["erasure 4+1"][2] == f"{3.25 * shard * 1.15 / 1e9:.2f} GB"  # (2 kept + 1 in flight + 0.25) + 15%
    assert rows["replicas=1"][2] == f"{4 * shard * 1.15 / 1e9:.2f} GB"
    assert rows["erasure 4+2"][3] == rows["replicas=2"][3] == f"{2 * shard / 1e9:.2f} GB"  # sent per save
    assert "note: erasure 4+1 on 1003 hosts: 1003 is not a multiple of 5" in out
    assert "save interval " in out and "the peer tier's in RAM + peers + object" in out
    # the JSON gives the same figures, and the probabilities are the formulas' at the plan's interval
    code, text, err = run(capsys, "plan", *PLAN, "--parity", "4+1,4+2", "--json")
    assert code == 0, err
    lay = json.loads(text)["peer_layouts"]
    plan = make_plan(PlanInputs(checkpoint=840e9, hosts=1003, accelerators=8024, mttf=5.66 * 365 * 86400 / 8024,
                                ram_save=5e9, peer=3e9, object_write=0.2e9, step_time=10.0, replicas=1))
    peers = plan.strategies[2].strategy
    assert lay["interval_s"] == pytest.approx(peers.wall_per_interval() * peers.tier("peer").every, rel=1e-3)
    p = node_loss_probability(lay["interval_s"], lay["node_mtbf_s"])
    assert lay["p_node"] == pytest.approx(p)
    assert lay["node_mtbf_s"] == pytest.approx(5.66 * 365 * 86400 / 8024 * 1003 / 0.5, rel=1e-3)
    by = {x["name"]: x for x in lay["layouts"]}
    assert by["erasure 4+1"]["loss_probability"] == pytest.approx(erasure_loss_probability(1003, 4, 1, p))
    assert by["replicas=2"]["loss_probability"] == pytest.approx(replica_loss_probability(1003, 2, p))
    assert by["erasure 4+1"]["groups"] == [{"nodes": 5, "count": 197, "held": 0.25}, {"nodes": 6, "count": 3, "held": 0.2}]
    assert by["erasure 4+1"]["mean_time_to_loss_s"] == pytest.approx(lay["interval_s"] / by["erasure 4+1"]["loss_probability"])
    # without --parity the plan prints no layouts
    code, out, err = run(capsys, "plan", *PLAN)
    assert code == 0 and "peer tier:" not in out


def test_plan_layouts_without_a_failure_rate_show_ram_only(capsys):
    code, out, err = run(capsys, "plan", "--params", "70B", "--hosts", "32", "--parity", "4+1")
    assert code == 0, err
    rows = _layout_rows(out)
    assert rows["erasure 4+1"][:2] == ["4 of 5, 2 of 6", "0.25, 0.20"] and rows["erasure 4+1"][-2:] == ["-", "-"]
    assert "P(step lost) needs a failure rate and a save interval" in out
    code, out, err = run(capsys, "plan", "--params", "7B", "--hosts", "4", "--parity", "4+1")
    assert code == 0, err
    assert _layout_rows(out)["erasure 4+1"][:2] == ["1 of 4", "0.33"]
    assert "note: erasure 4+1 on 4 hosts: fewer than 5, so one group of all of them (3 data + 1 parity)" in out
    c = compare(make_plan(PlanInputs(checkpoint=840e9, hosts=32, accelerators=256, erasure=(Erasure(4, 1),))))
    assert c.interval is None and c.p is None and all(lay.loss is None for lay in c.layouts)


@pytest.mark.parametrize("value, needle", [
    ("4-1", "argument --parity: '4-1' is not DATA+PARITY, e.g. 4+1"),
    ("4+0", "data >= 1 and parity >= 1"),
    ("4+1,x", "'x' is not DATA+PARITY"),
])
def test_bad_parity_is_one_line(capsys, value, needle):
    for cmd in ("plan", "simulate"):
        code, out, err = run(capsys, cmd, *PLAN, "--parity", value)
        assert code == 2 and out == ""
        assert err.startswith("tierfs: error: ") and err.count("\n") == 1 and needle in err, err
    code, _, err = run(capsys, "plan", "--params", "7B", "--hosts", "2", "--parity", "4+2")
    assert code == 2 and err.count("\n") == 1 and "needs at least 3 hosts, got 2" in err


def test_simulate_counts_each_layouts_lost_steps(capsys):
    # a failure-prone cluster (an accelerator fails every 4 days): node losses come often enough within the
    # peer tier's interval for replicas=1 and 4+1 to lose steps now and then
    args = ["--checkpoint-size", "840GB", "--accelerator-mttf", "4d", "--ram-bw", "5GB/s", "--peer-bw", "3GB/s",
            "--object-bw", "200MB/s", "--step-time", "10s", "--sizes", "1k,2k", "--runs", "20", "--work", "2d",
            "--parity", "4+1,4+2"]
    code, out, err = run(capsys, "simulate", *args)
    assert code == 0, err
    section = out.split("peer tier: steps lost within a save interval")[1].split("\n\n")[0]
    assert re.findall(r"  (replicas=\d|erasure 4\+\d)  ", section) == ["replicas=1", "replicas=2", "erasure 4+1",
                                                                      "erasure 4+2"] * 2
    assert re.search(r"^  1000 +125 +31\.5 s +replicas=1 +1\.66e-05 +0 in 109,820 \[0, 3\.36e-05\]", section, re.M)
    code, text, err = run(capsys, "simulate", *args, "--json")
    assert code == 0, err
    rows = json.loads(text)
    assert [r["accelerators"] for r in rows] == [1000] * 3 + [2000] * 3
    for r in rows[::3]:
        lay = r["peer_layouts"]
        per_run = lay["intervals_per_run"]
        assert per_run == math.ceil(2 * 86400 / lay["interval_s"])
        for formula, sim in zip(lay["layouts"], lay["simulated"]):
            assert sim["layout"] == formula["name"] and sim["intervals"] == 20 * per_run
            lo, hi = sim["ci95"]
            assert lo <= formula["loss_probability"] <= hi, (r["accelerators"], sim, formula)
        assert lay["simulated"][2]["lost"] > 0  # erasure 4+1
    # without --parity: no layouts
    code, text, err = run(capsys, "simulate", *args[:-2], "--sizes", "1k", "--runs", "2", "--json")
    assert code == 0 and "peer_layouts" not in json.loads(text)[0]


def test_plan_parity_as_a_program():
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-m", "tierfs.cli", "plan", *PLAN, "--parity", "4+1"], capture_output=True,
                       text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "erasure 4+1  197 of 5, 3 of 6" in r.stdout
