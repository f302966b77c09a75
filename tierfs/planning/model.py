"""The planner's model: sizes, failures, strategies and their expected goodput (no I/O, no clock).

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
from dataclasses import dataclass, field
from typing import Mapping

#: bytes per parameter of a training checkpoint: fp32 weights + Adam's two fp32 moments
BYTES_PER_PARAM = 12

#: the slowdown of training while a background copy runs, as a fraction of the copy's duration: tierfs's
#: default throttle measured +3.5% (-0.8% to +5.7%) on a training loop (docs/performance.md); 5% is the
#: bound it is held to
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


# -- the job ----------------------------------------------------------------------------------------

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
    data_parallel : int
        Copies of the model across hosts (DDP's replicas, HSDP's replica groups): each host holds
        ``checkpoint * data_parallel / hosts``, the object store takes each distinct byte once (the upload
        spread over every host), and a lost node's state is in the RAM of the hosts holding the same
        part, so peers replicate nothing.
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
    data_parallel: int = 1

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
        if not 1 <= self.data_parallel <= self.hosts:
            raise ValueError(f"data-parallel degree {self.data_parallel} must be from 1 to the hosts ({self.hosts})")

    @property
    def shard(self) -> float:
        """Bytes each host holds of one checkpoint (its part of one data-parallel copy)."""
        return self.checkpoint * self.data_parallel / self.hosts

    @property
    def peer_replicas(self) -> int:
        """Replicas the peer tier keeps of each host's shard: none when other hosts hold it (data parallel)."""
        return self.replicas if self.data_parallel == 1 else 0

    def object_rate(self, per_host: float | None) -> float | None:
        """The job's aggregate object-store bandwidth for a per-host one."""
        if per_host is None:
            return None
        agg = per_host * self.hosts
        return agg if self.object_total is None else min(agg, self.object_total)
