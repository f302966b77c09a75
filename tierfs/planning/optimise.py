"""Planning a job: RAM per host, and for each strategy the bandwidths allow, the intervals that maximise
its goodput.

:func:`make_plan` starts each strategy at Young/Daly's intervals (:mod:`tierfs.planning.formulas`) and
moves them to the maximum of :func:`~tierfs.planning.model.expected_goodput` with :func:`optimise`; the
:class:`Plan` it returns is what ``tierfs plan`` prints (:mod:`tierfs.planning.report`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Mapping, Sequence

from .formulas import RamBudget, cluster_mttf, ram_per_host, sustained_bandwidth, young_daly
from .inputs import PlanInputs
from .model import FailureClass, Strategy, TierModel, expected_goodput
from ..util.readable import duration


@dataclass(frozen=True)
class TierPlan:
    """One tier of one strategy in a plan."""

    name: str
    interval: float  # seconds of training between saves to this tier
    young_daly: float  # the unrounded Young/Daly interval (inf: no failure class needs this tier)
    mttf: float  # mean time between failures recovering from this tier
    blocking: float
    transfer: float
    bandwidth_per_host: float
    bandwidth_total: float


@dataclass(frozen=True)
class StrategyPlan:
    """A strategy with its intervals, expected goodput and what it costs per failure."""

    strategy: Strategy
    goodput: float
    tiers: tuple[TierPlan, ...]


@dataclass(frozen=True)
class Plan:
    """Everything ``tierfs plan`` prints."""

    inputs: PlanInputs
    ram: RamBudget
    strategies: tuple[StrategyPlan, ...]
    object_rule: TierPlan | None  # the object tier at --saves-per-mttf / --interval object, no bandwidths needed
    notes: tuple[str, ...]


def _round_to_steps(t: float, step_time: float | None) -> float:
    if step_time is None or math.isinf(t):
        return t
    return max(1, round(t / step_time)) * step_time


def _rate_of(mttf: float | None, fraction: float) -> float:
    """Mean time between the failures that make up ``fraction`` of all failures."""
    if mttf is None or fraction <= 0:
        return math.inf
    return mttf / fraction


def optimise(strategy: Strategy, mttf: float, *, fixed: Mapping[str, float] | None = None,
             step_time: float | None = None, min_interval: Mapping[str, float] | None = None,
             max_interval: Mapping[str, float] | None = None, rounds: int = 4) -> Strategy:
    """The strategy with the intervals that maximise :func:`expected_goodput`, starting from its own.

    Coordinate search: the base interval over a log grid (3 decades either side, steps of 6%, whole
    training steps), then each slower tier's ``every``, repeated until nothing changes.

    Parameters
    ----------
    strategy : Strategy
        The starting point (e.g. Young/Daly intervals).
    mttf : float
        The cluster's MTTF, seconds.
    fixed : mapping, optional
        Tier name -> interval in seconds that must not change (a slower tier's is rounded to a multiple
        of the base interval).
    step_time : float, optional
        Intervals are whole multiples of it.
    min_interval, max_interval : mapping, optional
        Tier name -> bounds on its interval (a background copy cannot be taken faster than it transfers;
        a durability requirement caps the object tier's).
    rounds : int
        Most rounds of the coordinate search.

    Returns
    -------
    Strategy
        A copy with the new ``interval`` and ``every`` values.
    """
    fixed, lo_b, hi_b = dict(fixed or {}), dict(min_interval or {}), dict(max_interval or {})
    base = strategy.tiers[0]

    def with_(tau: float, every: Sequence[int]) -> Strategy:
        tiers = (strategy.tiers[0],) + tuple(replace(t, every=int(k)) for t, k in zip(strategy.tiers[1:], every))
        return replace(strategy, interval=tau, tiers=tiers)

    # a slower tier takes whole multiples of the base interval: its cap bounds the base interval too
    tau_cap = min(hi_b.get(t.name, math.inf) for t in strategy.tiers)

    def ok_tau(tau: float) -> float | None:
        tau = _round_to_steps(tau, step_time)
        if tau < lo_b.get(base.name, 0.0) or tau > tau_cap:
            return None
        return tau

    # each slower tier's ``every`` is a multiple of the one before (see ``snap``): a tier's cap bounds the
    # tiers before it too, or an uncapped peer tier would push the object tier past its cap
    caps: dict[str, float] = {}
    for i, t in enumerate(strategy.tiers):
        caps[t.name] = min(hi_b.get(u.name, math.inf) for u in strategy.tiers[i:])

    def bounds(name: str, tau: float) -> tuple[int, int]:
        kmin = max(1, math.ceil(lo_b.get(name, 0.0) / tau - 1e-9))
        cap = caps.get(name, math.inf)
        return kmin, (max(kmin, int(cap / tau + 1e-9)) if not math.isinf(cap) else kmin + 100000)

    def ks(name: str, tau: float) -> list[int]:
        kmin, kmax = bounds(name, tau)
        out = set(range(kmin, min(kmax, kmin + 64) + 1))
        k = float(kmin + 64)
        while k < kmax:
            out.add(int(k))
            k *= 1.06
        out.add(kmax)
        return sorted(out)

    slow = strategy.tiers[1:]

    def snap(tau: float, every: Sequence[int]) -> list[int]:
        """Each slower tier's ``every`` a multiple of the one before (an object step is also a peer step),
        within its bounds; a fixed interval wins."""
        out: list[int] = []
        prev = 1
        for t, k in zip(slow, every):
            kmin, kmax = bounds(t.name, tau)
            k = max(1, round(fixed[t.name] / tau)) if t.name in fixed else min(max(k, kmin), kmax)
            k = max(prev, round(k / prev) * prev)
            out.append(k)
            prev = k
        return out

    tau = strategy.interval
    if base.name not in fixed:
        tau = ok_tau(min(tau, tau_cap)) or ok_tau(tau_cap - (step_time or 0.0)) or min(tau, tau_cap)
    every = snap(tau, [t.every for t in slow])
    best = expected_goodput(with_(tau, every), mttf)
    for _ in range(rounds):
        changed = False
        if base.name not in fixed:
            for j in range(-120, 121):
                cand = ok_tau(strategy.interval * 10 ** (j / 40))
                if cand is None or cand == tau:
                    continue
                ev = snap(cand, every)
                g = expected_goodput(with_(cand, ev), mttf)
                if g > best + 1e-12:
                    best, tau, every, changed = g, cand, ev, True
            # then step by step (one training step, or 0.5%) while it improves
            for sign in (1, -1):
                while True:
                    cand = ok_tau(tau + sign * (step_time or tau * 0.005))
                    if cand is None or cand == tau:
                        break
                    ev = snap(cand, every)
                    g = expected_goodput(with_(cand, ev), mttf)
                    if g <= best + 1e-12:
                        break
                    best, tau, every, changed = g, cand, ev, True
        for i, t in enumerate(slow):
            if t.name in fixed:
                continue
            for k in ks(t.name, tau):
                ev = list(every)
                ev[i] = k
                ev = snap(tau, ev)
                g = expected_goodput(with_(tau, ev), mttf)
                if g > best + 1e-12:
                    best, every, changed = g, ev, True
        if not changed:
            break
    return with_(tau, every)


def _finish(p: PlanInputs, name: str, base_name: str, base_yd: float, base_mttf: float, base_blocking: float,
            others: list[tuple[str, float, float, float, float]], classes: list[FailureClass],
            notes: list[str]) -> StrategyPlan:
    """Young/Daly intervals as the starting point, then the goodput maximum of the model.

    ``others``: (tier, Young/Daly interval, MTTF for it, blocking, transfer) of each slower tier, copied in
    the background (its lag is its transfer).
    """
    mttf = p.mttf if p.mttf is not None else math.inf
    fixed = dict(p.intervals)
    if p.saves_per_mttf and p.mttf and "object" not in fixed:
        fixed["object"] = p.mttf / p.saves_per_mttf
    start = min([base_yd] + [max(yd, tr) for _, yd, _, _, tr in others])  # slower tiers copy base steps
    if math.isinf(start):
        start = p.max_object_interval
    start = fixed.get(base_name, start)
    tiers = [TierModel(base_name, 1, base_blocking, 0.0, base_blocking, p.shard, p.shard * p.hosts)]
    lo: dict[str, float] = {}
    hi: dict[str, float] = {"object": p.max_object_interval} if others else {}
    for tname, yd, _m, blocking, transfer in others:
        # the object store takes each distinct byte once, spread over every host
        per_host = p.shard * p.peer_replicas if tname == "peer" else p.checkpoint / p.hosts
        want = fixed.get(tname, max(yd, transfer) if not math.isinf(yd) else p.max_object_interval)
        tiers.append(TierModel(tname, max(1, round(want / start)), blocking, transfer, transfer, per_host,
                               per_host * p.hosts))
        lo[tname] = transfer
    strat = optimise(Strategy(name, start, tuple(tiers), tuple(classes)), mttf, fixed=fixed,
                     step_time=p.step_time, min_interval=lo, max_interval=hi)
    yds = {base_name: (base_yd, base_mttf)} | {n: (yd, m) for n, yd, m, _, _ in others}
    for t in strat.tiers:
        iv = t.every * strat.interval
        if t.name in lo and iv < lo[t.name] - 1e-9:
            notes.append(f"{name}: a {t.name} copy takes {duration(t.transfer)}, longer than its interval "
                         f"{duration(iv)}; copies will queue")
        capped = (t.name == "object" and t.name not in fixed and bool(others)
                  and iv >= p.max_object_interval - strat.interval)
        if math.isinf(yds[t.name][1]):  # no failure class restores from this tier
            why = ("it is saved as the source of the slower tiers' copies" if t.name == base_name and others else
                   "it is saved for durability only" if t.name == "object" else "it is saved all the same, as "
                   "the strategy has it")
            how = " (--max-object-interval)" if capped else " (as given)" if t.name in fixed else ""
            notes.append(f"{name}: no failure reads the {t.name} tier (--node-loss {p.node_loss:g}, "
                         f"--replica-loss {p.replica_loss:g}); {why}, every {duration(iv)}{how}")
        elif capped:
            notes.append(f"{name}: object interval held near the {duration(p.max_object_interval)} cap "
                         "(--max-object-interval)")
    strat = replace(strat, notes=tuple(notes))
    wall = strat.wall_per_interval()
    plans = []
    for t in strat.tiers:
        iv = strat.interval * t.every
        period = wall * t.every
        plans.append(TierPlan(t.name, iv, yds[t.name][0], yds[t.name][1], t.blocking, t.transfer,
                              t.nbytes_per_host / period, t.nbytes_total / period))
    return StrategyPlan(strat, expected_goodput(strat, mttf), tuple(plans))


def _background(p: PlanInputs, tname: str, transfer: float, mttf: float) -> tuple[str, float, float, float, float]:
    """A tier copied in the background: Young/Daly on the slowdown its copies cause."""
    blocking = p.background_slowdown * transfer
    return tname, young_daly(blocking, mttf), mttf, blocking, transfer


def make_plan(p: PlanInputs) -> Plan:
    """RAM per host, and for each strategy the bandwidths supplied allow: intervals and goodput.

    Parameters
    ----------
    p : PlanInputs
        The job, its failures and the tiers' bandwidths.

    Returns
    -------
    Plan
        Strategies that lack a bandwidth or the MTTF are left out, with a note saying what to give.
    """
    ram = ram_per_host(p.shard * p.hosts, p.hosts, keep=p.keep, in_flight=p.in_flight, replicas=p.peer_replicas,
                       replica_keep=p.replica_keep, headroom=p.headroom)
    notes: list[str] = []
    strategies: list[StrategyPlan] = []
    obj_w, obj_r = p.object_rate(p.object_write), p.object_rate(p.object_read or p.object_write)
    f, q = p.node_loss, p.replica_loss

    rule = None
    rule_iv = p.intervals.get("object")
    if rule_iv is None and p.saves_per_mttf and p.mttf:
        rule_iv = p.mttf / p.saves_per_mttf
    if rule_iv is not None:
        rule = TierPlan("object", rule_iv, math.nan, p.mttf or math.inf, 0.0, 0.0,
                        sustained_bandwidth(p.checkpoint / p.hosts, rule_iv), sustained_bandwidth(p.checkpoint, rule_iv))

    if p.mttf is None:
        notes.append("no MTTF given (--mttf or --accelerator-mttf): intervals and goodput need one")
        return Plan(p, ram, (), rule, tuple(notes))
    if obj_w is None:
        notes.append("no object-store bandwidth (--object-bw or --bench): strategies need it")
        return Plan(p, ram, (), rule, tuple(notes))
    if p.object_read is None:
        notes.append("object download bandwidth not given: taken equal to upload")
    t_obj_w, t_obj_r = p.checkpoint / obj_w, p.checkpoint / obj_r  # type: ignore[operator]
    node_recover_obj = p.restart + p.replace + t_obj_r

    # 1. object storage alone: every save is a synchronous upload; every failure reads it back
    sn: list[str] = []
    cls = [FailureClass("process", 1 - f, "object", p.restart + t_obj_r),
           FailureClass("node", f, "object", node_recover_obj)]
    cls = [c for c in cls if c.probability > 0]
    strategies.append(_finish(p, "object alone", "object", young_daly(t_obj_w, p.mttf), p.mttf, t_obj_w, [],
                              cls, sn))

    if p.ram_save is None:
        notes.append("no RAM-tier bandwidth (--ram-bw or --bench): RAM strategies left out")
        return Plan(p, ram, tuple(strategies), rule, tuple(notes))
    c_ram = p.shard / p.ram_save
    t_ram_r = p.shard / (p.ram_restore or p.ram_save)
    proc = FailureClass("process", 1 - f, "ram", p.restart + t_ram_r)

    # 2. RAM + object: process restarts read RAM, node losses roll back to the object tier
    sn = []
    m_ram = _rate_of(p.mttf, 1 - f)
    others = [_background(p, "object", t_obj_w, _rate_of(p.mttf, f))]
    cls = [c for c in (proc, FailureClass("node", f, "object", node_recover_obj)) if c.probability > 0]
    strategies.append(_finish(p, "RAM + object", "ram", young_daly(c_ram, m_ram), m_ram, c_ram, others, cls,
                              sn))

    # 3. RAM + peers + object: node losses read the lost shard from a peer
    if p.data_parallel > 1 and p.peer is not None:  # the hosts holding the same part have it in RAM
        sn = []
        others = [_background(p, "object", t_obj_w, _rate_of(p.mttf, f * q))]
        cls = [proc, FailureClass("node", f * (1 - q), "ram", p.restart + p.replace + p.shard / p.peer),
               FailureClass("node+replicas", f * q, "object", node_recover_obj)]
        cls = [c for c in cls if c.probability > 0]
        m_dp = _rate_of(p.mttf, 1 - f * q)  # every failure but the loss of a part's every copy reads RAM
        strategies.append(_finish(p, "RAM + data-parallel peers + object", "ram", young_daly(c_ram, m_dp), m_dp,
                                  c_ram, others, cls, sn))
    elif p.data_parallel > 1:
        notes.append("no peer bandwidth (--peer-bw or --bench under torchrun): RAM + data-parallel peers + object "
                     "left out")
    elif p.replicas < 1:
        notes.append("--replicas 0: the RAM + peers + object strategy is left out")
    elif p.peer is None:
        notes.append("no peer bandwidth (--peer-bw or --bench under torchrun): RAM + peers + object left out")
    else:
        sn = []
        t_peer = p.replicas * p.shard / p.peer
        others = [_background(p, "peer", t_peer, _rate_of(p.mttf, f * (1 - q))),
                  _background(p, "object", t_obj_w, _rate_of(p.mttf, f * q))]
        cls = [proc, FailureClass("node", f * (1 - q), "peer", p.restart + p.replace + p.shard / p.peer),
               FailureClass("node+replicas", f * q, "object", node_recover_obj)]
        cls = [c for c in cls if c.probability > 0]
        strategies.append(_finish(p, "RAM + peers + object", "ram", young_daly(c_ram, m_ram), m_ram, c_ram,
                                  others, cls, sn))
    return Plan(p, ram, tuple(strategies), rule, tuple(notes))


def scaled(p: PlanInputs, accelerators: int, accelerator_mttf: float, accelerators_per_host: int) -> PlanInputs:
    """The same job on a cluster of ``accelerators`` (hosts and cluster MTTF scaled to it).

    Parameters
    ----------
    p : PlanInputs
        The job.
    accelerators : int
        Accelerators in the scaled cluster.
    accelerator_mttf : float
        One accelerator's MTTF, seconds; the cluster's is this / ``accelerators``.
    accelerators_per_host : int
        Accelerators per host; hosts are rounded up.

    Returns
    -------
    PlanInputs
        A copy with ``hosts``, ``accelerators`` and ``mttf`` replaced.
    """
    hosts = max(1, math.ceil(accelerators / accelerators_per_host))
    return replace(p, hosts=hosts, accelerators=max(accelerators, hosts),
                   mttf=cluster_mttf(accelerator_mttf, accelerators))

