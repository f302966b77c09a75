"""Capacity planning: RAM per host, save interval per tier, expected goodput, bandwidth needed.

Pure functions of the numbers they are given (no I/O, no clock). ``tierfs plan`` prints what
:func:`make_plan` returns; ``tierfs simulate`` (:mod:`tierfs.simulate`) checks the goodput figures with a
Monte-Carlo run of the same model.

Units: bytes, seconds, bytes per second; printed as GB = 1e9 bytes and GB/s = 1e9 bytes/s.

The model
---------
A job runs on ``hosts`` hosts with ``accelerators`` accelerators in all. Failures arrive as a Poisson
process with mean time between them ``mttf`` (the cluster's MTTF; a per-accelerator MTTF scales as
``mttf / accelerators``). A fraction ``node_loss`` of failures loses a node (its RAM is gone); the rest
only kill the process (RAM survives). A fraction ``replica_loss`` of node losses also loses every peer
holding that node's replicas (a rack, a switch).

A *strategy* is a base tier saved every ``interval`` seconds of training, and slower tiers that take
every ``every``-th base save. A save to a tier blocks training for ``blocking`` seconds (the RAM copy; a
synchronous upload; for copies in the background only the slowdown they cause, ``background_slowdown``
times their transfer time) and is usable ``lag`` seconds after it was taken (a background copy is usable
once it is uploaded). A failure rolls the job back to the newest usable step on the tier that its class
recovers from, and recovery then costs ``recovery`` seconds (restart, plus reading the step).

Each tier's interval is Young/Daly's ``tau = sqrt(2 * C * M)`` with ``C`` its blocking cost and ``M`` the
mean time between the failures that recover from it; a background copy cannot be taken more often than it
takes to transfer, and a slower tier takes whole multiples of the base interval.

Goodput (useful training time / wall time) generalises Daly's exact expression for one tier,
``tau / (M * exp(R/M) * (exp((tau + C)/M) - 1))``, to several tiers and failure classes: with
``S = tau + sum(C_i / every_i)`` the mean wall time of a base interval, ``e = exp(S/M) - 1`` the expected
failures before a base interval completes, ``E = M * A / (1 - A)`` with ``A = sum_c p_c (1 - exp(-R_c/M))``
the expected recovery time per failure (a failure during recovery starts a recovery of its own class) and
``D_c = (every - 1) / 2 * S + lag`` the work class ``c`` loses beyond the current interval (the tier it
recovers from is on average half its interval behind, plus the time its copy takes to become usable)::

    T_interval = e * (M + E) / (1 - e * sum_c p_c D_c / S)
    goodput    = tau / T_interval

A failure costs the work since the newest usable copy plus the recovery, and the redone work is itself
hit by failures: hence the division.

For one tier and one failure class this is Daly's formula exactly (and the simulation agrees within its
confidence interval); with several tiers it is a first-order approximation of the simulated model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Sequence

#: bytes per parameter of a training checkpoint: fp32 weights + Adam's two fp32 moments
BYTES_PER_PARAM = 12

#: the slowdown of training while a background copy runs, as a fraction of the copy's duration: tierfs's
#: default throttle measured +4.6% / -0.4% on a training loop, and +2.5% / +0.8% since it paces in bursts
#: (docs/benchmarks.md); 5% is the bound it is held to
DEFAULT_BACKGROUND_SLOWDOWN = 0.05


# -- sizes and rates --------------------------------------------------------------------------------

def checkpoint_bytes(params: float, bytes_per_param: float = BYTES_PER_PARAM) -> float:
    """Bytes of a training checkpoint of ``params`` parameters.

    Parameters
    ----------
    params : float
        Number of model parameters.
    bytes_per_param : float
        Bytes each parameter costs in the checkpoint; 12 for fp32 weights plus Adam's two moments.

    Returns
    -------
    float
        ``params * bytes_per_param``; 70e9 parameters give 840e9 bytes.
    """
    if params <= 0 or bytes_per_param <= 0:
        raise ValueError("parameters and bytes per parameter must be positive")
    return float(params) * float(bytes_per_param)


def cluster_mttf(accelerator_mttf: float, accelerators: int) -> float:
    """The cluster's mean time to failure when any one of ``accelerators`` failing stops the job.

    Parameters
    ----------
    accelerator_mttf : float
        Mean time to failure of one accelerator (with its share of host, network, software), seconds.
    accelerators : int
        Accelerators in the job.

    Returns
    -------
    float
        ``accelerator_mttf / accelerators`` (independent exponential failures).
    """
    if accelerator_mttf <= 0 or accelerators < 1:
        raise ValueError("accelerator MTTF must be positive and accelerators >= 1")
    return float(accelerator_mttf) / int(accelerators)


def young_daly(cost: float, mttf: float) -> float:
    """Young/Daly's checkpoint interval ``sqrt(2 * cost * mttf)`` (seconds of work between saves).

    Parameters
    ----------
    cost : float
        Seconds a save blocks training.
    mttf : float
        Mean time between the failures the saves protect against (``inf``: none).

    Returns
    -------
    float
        The interval; ``inf`` when ``mttf`` is infinite, 0 when the save costs nothing.
    """
    if cost < 0 or mttf <= 0:
        raise ValueError("cost must be >= 0 and mttf > 0")
    if math.isinf(mttf):
        return math.inf
    return math.sqrt(2.0 * cost * mttf)


def sustained_bandwidth(nbytes: float, interval: float) -> float:
    """Bytes per second a tier must absorb to take ``nbytes`` every ``interval`` seconds."""
    if interval <= 0:
        raise ValueError("interval must be positive")
    return 0.0 if math.isinf(interval) else float(nbytes) / float(interval)


@dataclass(frozen=True)
class RamBudget:
    """RAM a host needs for the RAM tier, in bytes (see :func:`ram_per_host`)."""

    shard: float  # this host's part of one checkpoint
    own: float  # own steps kept
    in_flight: float  # steps being written while the kept ones stay
    replicas: float  # copies of other hosts' shards held for them
    headroom: float  # safety margin

    @property
    def total(self) -> float:
        return self.own + self.in_flight + self.replicas + self.headroom


def ram_per_host(checkpoint: float, hosts: int, *, keep: int = 2, in_flight: int = 1, replicas: int = 0,
                 replica_keep: int = 1, headroom: float = 0.15) -> RamBudget:
    """RAM per host for the RAM tier: own steps kept + steps in flight + replicas held, plus headroom.

    Parameters
    ----------
    checkpoint : float
        Bytes of one whole checkpoint (all hosts).
    hosts : int
        Hosts the checkpoint is sharded over; each holds ``checkpoint / hosts``.
    keep : int
        Own steps the RAM tier keeps (its ``LatestN``; tierfs's default is 2).
    in_flight : int
        Steps being written while the kept ones stay (tierfs stages a new step before retention frees
        an old one: 1).
    replicas : int
        Peer copies of each shard; each host holds ``replicas`` other hosts' shards.
    replica_keep : int
        Steps of each replica a host keeps.
    headroom : float
        Fraction added for the pool, metadata and fragmentation (Orbax's docs suggest 10-15%).

    Returns
    -------
    RamBudget
        The parts and their ``total``. Orbax's rule ``2 * checkpoint / hosts + 15%`` is ``keep=1,
        in_flight=1, replicas=0, headroom=0.15``: 70e9 * 12 B on 32 hosts gives 60.4e9 bytes.
    """
    if checkpoint <= 0 or hosts < 1:
        raise ValueError("checkpoint bytes must be positive and hosts >= 1")
    if keep < 1 or in_flight < 0 or replicas < 0 or replica_keep < 1 or headroom < 0:
        raise ValueError("need keep >= 1, in_flight >= 0, replicas >= 0, replica_keep >= 1, headroom >= 0")
    shard = float(checkpoint) / int(hosts)
    own, flight, held = keep * shard, in_flight * shard, replicas * replica_keep * shard
    return RamBudget(shard, own, flight, held, headroom * (own + flight + held))


# -- strategies and their goodput -------------------------------------------------------------------

@dataclass(frozen=True)
class TierModel:
    """One tier of a strategy, as the goodput model sees it.

    Attributes
    ----------
    name : str
        ``"ram"``, ``"peer"`` or ``"object"``.
    every : int
        It takes every ``every``-th save of the base tier (1 for the base tier itself).
    blocking : float
        Seconds each of its saves stops training.
    lag : float
        Seconds after a save until the copy on this tier is usable (its transfer, when in background).
    transfer : float
        Seconds one save takes to reach the tier (for the bandwidth figures).
    nbytes_per_host : float
        Bytes each host writes to the tier per save.
    nbytes_total : float
        Bytes the whole job writes to the tier per save.
    """

    name: str
    every: int
    blocking: float
    lag: float = 0.0
    transfer: float = 0.0
    nbytes_per_host: float = 0.0
    nbytes_total: float = 0.0


@dataclass(frozen=True)
class FailureClass:
    """A kind of failure: its share of all failures, the tier it recovers from and what recovery costs."""

    name: str
    probability: float
    tier: str
    recovery: float


@dataclass(frozen=True)
class Strategy:
    """A base interval, the tiers (base first) and the failure classes (probabilities sum to 1)."""

    name: str
    interval: float  # seconds of training between base-tier saves
    tiers: tuple[TierModel, ...]
    classes: tuple[FailureClass, ...]
    notes: tuple[str, ...] = ()

    def tier(self, name: str) -> TierModel:
        for t in self.tiers:
            if t.name == name:
                return t
        raise KeyError(f"strategy {self.name!r} has no tier {name!r}")

    def wall_per_interval(self) -> float:
        """Mean wall seconds of one base interval without failures: training plus blocking saves."""
        return self.interval + sum(t.blocking / t.every for t in self.tiers)

    def validate(self) -> None:
        if not self.tiers or self.tiers[0].every != 1:
            raise ValueError(f"strategy {self.name!r}: the first tier is the base tier (every=1)")
        if not self.interval > 0 or math.isinf(self.interval):
            raise ValueError(f"strategy {self.name!r}: the base interval must be positive and finite")
        names = {t.name for t in self.tiers}
        for c in self.classes:
            if c.tier not in names:
                raise ValueError(f"strategy {self.name!r}: class {c.name!r} recovers from unknown tier {c.tier!r}")
        if self.classes and abs(sum(c.probability for c in self.classes) - 1.0) > 1e-9:
            raise ValueError(f"strategy {self.name!r}: failure class probabilities must sum to 1")


def expected_goodput(strategy: Strategy, mttf: float) -> float:
    """Expected fraction of wall time spent on training that is kept (see the module docstring).

    Parameters
    ----------
    strategy : Strategy
        Intervals, tiers and failure classes.
    mttf : float
        The cluster's mean time between failures, seconds (``inf``: no failures).

    Returns
    -------
    float
        Goodput in [0, 1]; 0 when failures come faster than the job can recover and progress.
    """
    strategy.validate()
    tau, s = strategy.interval, strategy.wall_per_interval()
    if math.isinf(mttf):
        return tau / s
    lam = 1.0 / mttf
    e = math.expm1(lam * s)
    by_name = {t.name: t for t in strategy.tiers}
    # a failure during recovery starts the recovery of its own class again: A = P(a recovery is hit)
    hit = sum(c.probability * -math.expm1(-lam * c.recovery) for c in strategy.classes)
    if hit >= 1.0:
        return 0.0
    recover = hit / (lam * (1.0 - hit))
    extra = sum(c.probability * ((by_name[c.tier].every - 1) / 2.0 * s + by_name[c.tier].lag)
                for c in strategy.classes)
    denom = 1.0 - e * extra / s
    if denom <= 0:
        return 0.0
    t_interval = e * (mttf + recover) / denom
    return max(0.0, min(1.0, tau / t_interval))


def expected_job_time(strategy: Strategy, mttf: float, work: float) -> float:
    """Expected wall seconds to do ``work`` seconds of training (whole base intervals, last save included)."""
    n = math.ceil(work / strategy.interval)
    g = expected_goodput(strategy, mttf)
    return math.inf if g <= 0 else n * strategy.interval / g


# -- the plan ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class PlanInputs:
    """What the planner needs; bandwidths are per host, bytes/s, None when unknown.

    Attributes
    ----------
    checkpoint : float
        Bytes of one whole checkpoint.
    hosts, accelerators : int
        Hosts and accelerators in the job.
    mttf : float or None
        The cluster's MTTF in seconds (see :func:`cluster_mttf` to scale a per-accelerator one).
    node_loss : float
        Fraction of failures that lose a node's RAM (the rest only restart the process).
    replica_loss : float
        Fraction of node losses that also lose every peer holding the node's replicas.
    step_time : float or None
        Seconds per training step; intervals are rounded to whole steps when given.
    restart : float
        Seconds to restart the job after any failure, before reading a checkpoint.
    replace : float
        Extra seconds to bring in a replacement node after a node loss.
    ram_save, ram_restore, peer, object_write, object_read : float or None
        Per-host bandwidths: RAM-tier save (what training waits for) and restore, peer transfer, object
        store upload and download.
    object_total : float or None
        The object store's aggregate limit for the whole job (None: hosts x per-host bandwidth).
    keep, in_flight, replicas, replica_keep, headroom
        RAM-tier sizing, see :func:`ram_per_host`. ``replicas`` >= 1 enables the peer strategy.
    background_slowdown : float
        Fraction of a background copy's duration that training loses to it.
    intervals : mapping
        Fixed intervals in seconds by tier name (``ram``, ``peer``, ``object``) instead of Young/Daly.
    saves_per_mttf : float or None
        Save the object tier this many times per MTTF (``interval = mttf / n``), the seed's rule.
    max_object_interval : float
        With peers, node losses rarely need the object tier; its interval is capped at this.
    """

    checkpoint: float
    hosts: int
    accelerators: int
    mttf: float | None = None
    node_loss: float = 0.5
    replica_loss: float = 0.0
    step_time: float | None = None
    restart: float = 60.0
    replace: float = 0.0
    ram_save: float | None = None
    ram_restore: float | None = None
    peer: float | None = None
    object_write: float | None = None
    object_read: float | None = None
    object_total: float | None = None
    keep: int = 2
    in_flight: int = 1
    replicas: int = 0
    replica_keep: int = 1
    headroom: float = 0.15
    background_slowdown: float = DEFAULT_BACKGROUND_SLOWDOWN
    intervals: Mapping[str, float] = field(default_factory=dict)
    saves_per_mttf: float | None = None
    max_object_interval: float = 3600.0

    def __post_init__(self) -> None:
        if not self.checkpoint > 0:
            raise ValueError("checkpoint size must be positive")
        if self.hosts < 1 or self.accelerators < self.hosts:
            raise ValueError("need hosts >= 1 and accelerators >= hosts")
        if self.mttf is not None and not self.mttf > 0:
            raise ValueError("MTTF must be positive")
        for name in ("node_loss", "replica_loss", "background_slowdown"):
            v = getattr(self, name)
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"{name.replace('_', ' ')} must be a fraction in [0, 1], got {v}")
        if self.step_time is not None and not self.step_time > 0:
            raise ValueError("step time must be positive")
        if self.restart < 0 or self.replace < 0:
            raise ValueError("restart and replace times must be >= 0")
        for name in ("ram_save", "ram_restore", "peer", "object_write", "object_read", "object_total"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise ValueError(f"bandwidth {name.replace('_', ' ')} must be positive")
        for k, v in self.intervals.items():
            if k not in ("ram", "peer", "object") or not v > 0:
                raise ValueError(f"fixed interval for {k!r} must be a positive number of seconds for ram, "
                                 "peer or object")
        if self.saves_per_mttf is not None and not self.saves_per_mttf > 0:
            raise ValueError("saves per MTTF must be positive")

    @property
    def shard(self) -> float:
        """Bytes each host holds of one checkpoint."""
        return self.checkpoint / self.hosts

    def object_rate(self, per_host: float | None) -> float | None:
        """The job's aggregate object-store bandwidth for a per-host one."""
        if per_host is None:
            return None
        agg = per_host * self.hosts
        return agg if self.object_total is None else min(agg, self.object_total)


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

    def bounds(name: str, tau: float) -> tuple[int, int]:
        kmin = max(1, math.ceil(lo_b.get(name, 0.0) / tau - 1e-9))
        cap = hi_b.get(name, math.inf)
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
    tiers = [TierModel(base_name, 1, base_blocking, 0.0, base_blocking, p.shard, p.checkpoint)]
    lo: dict[str, float] = {}
    hi: dict[str, float] = {"object": p.max_object_interval} if others else {}
    for tname, yd, _m, blocking, transfer in others:
        per_host = p.shard * (p.replicas if tname == "peer" else 1)
        want = fixed.get(tname, max(yd, transfer) if not math.isinf(yd) else p.max_object_interval)
        tiers.append(TierModel(tname, max(1, round(want / start)), blocking, transfer, transfer, per_host,
                               per_host * p.hosts))
        lo[tname] = transfer
    strat = optimise(Strategy(name, start, tuple(tiers), tuple(classes)), mttf, fixed=fixed,
                     step_time=p.step_time, min_interval=lo, max_interval=hi)
    for t in strat.tiers[1:]:
        iv = t.every * strat.interval
        if t.name in lo and iv < lo[t.name] - 1e-9:
            notes.append(f"{name}: a {t.name} copy takes {_dur(t.transfer)}, longer than its interval "
                         f"{_dur(iv)}; copies will queue")
        if t.name == "object" and t.name not in fixed and iv >= p.max_object_interval - strat.interval:
            notes.append(f"{name}: object interval held near the {_dur(p.max_object_interval)} cap "
                         "(--max-object-interval)")
    strat = replace(strat, notes=tuple(notes))
    wall = strat.wall_per_interval()
    yds = {base_name: (base_yd, base_mttf)} | {n: (yd, m) for n, yd, m, _, _ in others}
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
    ram = ram_per_host(p.checkpoint, p.hosts, keep=p.keep, in_flight=p.in_flight, replicas=p.replicas,
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
                        sustained_bandwidth(p.shard, rule_iv), sustained_bandwidth(p.checkpoint, rule_iv))

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
    if p.replicas < 1:
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
    """The same job on a cluster of ``accelerators`` (hosts and cluster MTTF scaled to it)."""
    hosts = max(1, math.ceil(accelerators / accelerators_per_host))
    return replace(p, hosts=hosts, accelerators=max(accelerators, hosts),
                   mttf=cluster_mttf(accelerator_mttf, accelerators))


# -- printing ---------------------------------------------------------------------------------------

def _dur(s: float) -> str:
    if math.isinf(s):
        return "never"
    if math.isnan(s):
        return "-"
    if s < 1:
        return f"{s:.2f} s"
    if s < 120:
        return f"{s:.1f} s"
    if s < 7200:
        return f"{s / 60:.1f} min"
    if s < 172800:
        return f"{s / 3600:.1f} h"
    return f"{s / 86400:.1f} d"


def _gb(n: float) -> str:
    if n >= 1e12:
        return f"{n / 1e9:.0f} GB"
    return f"{n / 1e9:.2f} GB" if n >= 1e8 or n == 0 else f"{n / 1e6:.1f} MB"


def _gbps(n: float) -> str:
    return f"{n / 1e9:.2f} GB/s" if n >= 1e9 or n == 0 else f"{n / 1e6:.1f} MB/s"


def _table(rows: Sequence[Sequence[str]], indent: str = "  ") -> list[str]:
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    return [indent + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def format_plan(plan: Plan) -> str:
    """The plan as the readable text ``tierfs plan`` prints."""
    p, r = plan.inputs, plan.ram
    out = [f"checkpoint {_gb(p.checkpoint)}, {p.hosts} hosts, {p.accelerators} accelerators, "
           f"shard per host {_gb(p.shard)}"]
    if p.mttf is not None:
        out.append(f"cluster MTTF {_dur(p.mttf)}; failures losing the node {p.node_loss:.0%}"
                   + (f", of those losing every replica too {p.replica_loss:.0%}" if p.replicas else ""))
    out += ["", "RAM per host for the RAM tier"]
    rows = [("own steps kept", f"{p.keep} x {_gb(r.shard)}", _gb(r.own)),
            ("steps in flight", f"{p.in_flight} x {_gb(r.shard)}", _gb(r.in_flight)),
            ("replicas held for others", f"{p.replicas} x {p.replica_keep} x {_gb(r.shard)}", _gb(r.replicas)),
            ("headroom", f"{p.headroom:.0%}", _gb(r.headroom)),
            ("total", "", _gb(r.total))]
    out += _table(rows)
    if plan.object_rule is not None:
        t = plan.object_rule
        per_day = 86400 / t.interval
        how = (f"{p.saves_per_mttf:g} saves per MTTF" if "object" not in p.intervals and p.saves_per_mttf
               else "fixed interval")
        out += ["", f"object tier at {how}: every {_dur(t.interval)}, {per_day:.0f} checkpoints/day, "
                    f"{per_day * p.checkpoint / 1e15:.2f} PB/day",
                f"  sustained write {_gbps(t.bandwidth_total)} for the job ({_gbps(t.bandwidth_per_host)} per host)"]
    if plan.strategies:
        out += ["", "strategies (intervals in training time; goodput = useful training / wall time)"]
        rows = [("strategy", "tier", "interval", "Young/Daly", "MTTF for it", "blocks", "transfer",
                 "write/host", "write/job", "goodput")]
        for sp in plan.strategies:
            for i, t in enumerate(sp.tiers):
                rows.append((sp.strategy.name if i == 0 else "", t.name, _dur(t.interval), _dur(t.young_daly),
                             _dur(t.mttf), _dur(t.blocking), _dur(t.transfer), _gbps(t.bandwidth_per_host),
                             _gbps(t.bandwidth_total), f"{sp.goodput:.2%}" if i == 0 else ""))
        out += _table(rows)
        out += ["", "recovery per failure class"]
        rows = [("strategy", "class", "share", "reads from", "recovery")]
        for sp in plan.strategies:
            for i, c in enumerate(sp.strategy.classes):
                rows.append((sp.strategy.name if i == 0 else "", c.name, f"{c.probability:.0%}", c.tier,
                             _dur(c.recovery)))
        out += _table(rows)
    notes = list(plan.notes) + [n for sp in plan.strategies for n in sp.strategy.notes]
    if notes:
        out += [""] + [f"note: {n}" for n in notes]
    return "\n".join(out)


def plan_to_dict(plan: Plan) -> dict[str, Any]:
    """The plan as plain JSON-able data (``tierfs plan --json``)."""
    p, r = plan.inputs, plan.ram

    def num(x: float) -> float | None:
        return None if math.isinf(x) or math.isnan(x) else x

    out: dict[str, Any] = {
        "checkpoint_bytes": p.checkpoint, "hosts": p.hosts, "accelerators": p.accelerators, "mttf_s": p.mttf,
        "ram_per_host": {"shard": r.shard, "own": r.own, "in_flight": r.in_flight, "replicas": r.replicas,
                         "headroom": r.headroom, "total": r.total},
        "strategies": [], "notes": list(plan.notes)}
    if plan.object_rule is not None:
        t = plan.object_rule
        out["object_rule"] = {"interval_s": t.interval, "bandwidth_total": t.bandwidth_total,
                              "bandwidth_per_host": t.bandwidth_per_host}
    for sp in plan.strategies:
        out["strategies"].append({
            "name": sp.strategy.name, "goodput": sp.goodput,
            "tiers": [{"name": t.name, "interval_s": t.interval, "young_daly_s": num(t.young_daly),
                       "mttf_s": num(t.mttf), "blocking_s": t.blocking, "transfer_s": t.transfer,
                       "bandwidth_per_host": t.bandwidth_per_host, "bandwidth_total": t.bandwidth_total}
                      for t in sp.tiers],
            "classes": [{"name": c.name, "probability": c.probability, "tier": c.tier, "recovery_s": c.recovery}
                        for c in sp.strategy.classes],
            "notes": list(sp.strategy.notes)})
    return out
