"""The planner's goodput model: failures, strategies and their expected goodput (no I/O, no clock).

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
from dataclasses import dataclass


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
