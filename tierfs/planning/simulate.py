"""Monte-Carlo simulation of a whole training run under failures, many runs at once (numpy).

The model is the planner's (:mod:`tierfs.planning.model`), played out instead of averaged:

- Training moves in base intervals of ``strategy.interval`` seconds; after each one the base tier saves
  (blocking its ``blocking`` seconds) and every slower tier whose ``every`` divides the interval's number
  saves too (blocking its own ``blocking``). The job is done when the last interval's saves are done.
- Failures arrive at exponential times (mean ``mttf``) of wall time, in training, in saves and in
  recovery alike. Each has a class, drawn with the classes' probabilities.
- A failure rolls the job back to the newest step on the tier its class recovers from that was usable at
  that moment (a save completes when its blocking part ends; a slower tier's copy is usable ``lag``
  seconds after that), and never behind the step the job last restarted from (after a restore every
  tier is taken to hold that step). Then recovery takes the class's ``recovery`` seconds; a failure
  during recovery starts a new one (of the new failure's class) from the same step.

Runs are independent and vectorised: one loop iteration handles the next failure of every unfinished
run, so the loop runs about as many times as one run has failures (a 30-day job on 100k accelerators
with a 30-minute MTTF: about 1,500 iterations).

Each run reports its job time, goodput (training time / job time), work lost (wall time of training and
saves that failures threw away), time recovering and failures; :class:`SimResult` gives means with 95%
confidence intervals over the runs. For one tier and one failure class the expected job time is Daly's
exact value, ``ceil(work / interval) * T_interval`` (see :func:`tierfs.planning.expected_goodput`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from .model import Strategy

#: normal quantile of a two-sided 95% interval
Z95 = 1.959963984540054


@dataclass(frozen=True)
class Estimate:
    """A mean over runs with its 95% confidence interval (normal approximation)."""

    mean: float
    low: float
    high: float

    @classmethod
    def of(cls, x: np.ndarray) -> "Estimate":
        x = np.asarray(x, dtype=float)
        m = float(x.mean())
        half = Z95 * float(x.std(ddof=1)) / math.sqrt(x.size) if x.size > 1 else math.inf
        return cls(m, m - half, m + half)

    def __contains__(self, value: float) -> bool:
        return self.low <= value <= self.high

    @property
    def half_width(self) -> float:
        return (self.high - self.low) / 2


@dataclass(frozen=True)
class SimResult:
    """What the runs of one strategy did (times in seconds)."""

    strategy: str
    runs: int
    work: float  # training seconds the job needs (whole base intervals)
    job_time: Estimate
    goodput: Estimate
    work_lost: Estimate
    recovering: Estimate
    failures: Estimate
    save_time: float  # blocking saves of a run without failures

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"strategy": self.strategy, "runs": self.runs, "work_s": self.work,
                               "save_time_s": self.save_time}
        for k in ("job_time", "goodput", "work_lost", "recovering", "failures"):
            e = getattr(self, k)
            out[k] = {"mean": e.mean, "ci95": [e.low, e.high]}
        return out


class _Schedule:
    """Wall time of the failure-free schedule: ``wall(g)`` is when the saves after interval ``g`` end."""

    def __init__(self, s: Strategy) -> None:
        self.tau = float(s.interval)
        self.unit = self.tau + s.tiers[0].blocking
        self.slow = [(int(t.every), float(t.blocking)) for t in s.tiers[1:]]
        self.mean = self.unit + sum(c / k for k, c in self.slow)
        self.spread = sum(c for _, c in self.slow)

    def wall(self, g: np.ndarray) -> np.ndarray:
        w = g * self.unit
        for k, c in self.slow:
            if c:
                w = w + (g // k) * c
        return w

    def done_by(self, w: np.ndarray) -> np.ndarray:
        """The most intervals whose saves have ended by wall time ``w`` (-1 where ``w`` < 0)."""
        # wall(g) lies in [g * mean - spread, g * mean]: bisect between the bounds it gives
        lo = np.floor(w / self.mean).astype(np.int64)
        hi = np.floor((w + self.spread) / self.mean).astype(np.int64) + 1
        lo = np.minimum(lo, hi - 1)
        while True:
            open_ = hi - lo > 1
            if not open_.any():
                break
            mid = (lo + hi) // 2
            fits = self.wall(mid) <= w
            lo = np.where(open_ & fits, mid, lo)
            hi = np.where(open_ & ~fits, mid, hi)
        return np.where(w < 0, -1, lo)


def simulate(strategy: Strategy, mttf: float, work: float, *, runs: int = 200, seed: int = 0,
             max_failures: int | None = None) -> SimResult:
    """Simulate ``runs`` independent runs of a job needing ``work`` seconds of training.

    Parameters
    ----------
    strategy : Strategy
        Intervals, tiers and failure classes (e.g. from :func:`tierfs.planning.make_plan`).
    mttf : float
        The cluster's mean time between failures, seconds.
    work : float
        Training seconds the job needs; rounded up to whole base intervals.
    runs : int
        Independent runs (at least 2, for the confidence intervals).
    seed : int
        Seed of numpy's ``default_rng``: the same seed gives the same result.
    max_failures : int, optional
        Stop with ValueError when a run has had this many failures (default: 1000 + 50 x the failures
        a run would have without any slowdown), which happens when failures come faster than the job
        can recover.

    Returns
    -------
    SimResult
        Means and 95% confidence intervals over the runs.
    """
    strategy.validate()
    if runs < 2:
        raise ValueError("runs must be at least 2")
    if not mttf > 0 or not work > 0:
        raise ValueError("mttf and work must be positive")
    sched = _Schedule(strategy)
    n_int = int(math.ceil(work / strategy.interval - 1e-9))
    finish = float(sched.wall(np.array([n_int]))[0])
    names = [t.name for t in strategy.tiers]
    every = np.array([t.every for t in strategy.tiers], dtype=np.int64)
    lag = np.array([t.lag for t in strategy.tiers])
    probs = np.array([c.probability for c in strategy.classes])
    cls_tier = np.array([names.index(c.tier) for c in strategy.classes], dtype=np.int64)
    cls_rec = np.array([c.recovery for c in strategy.classes])
    if max_failures is None:
        max_failures = 1000 + 50 * int(math.ceil(finish / mttf))

    rng = np.random.default_rng(seed)
    g = np.zeros(runs, np.int64)  # the step (in base intervals) each run restarts from
    clock = np.zeros(runs)
    pending = np.zeros(runs)  # recovery to do before training goes on
    lost = np.zeros(runs)
    recovering = np.zeros(runs)
    failures = np.zeros(runs, np.int64)
    active = np.arange(runs)
    for _ in range(max_failures + 1):
        if active.size == 0:
            break
        n = active.size
        delta = rng.exponential(mttf, n)
        cls = rng.choice(len(probs), size=n, p=probs) if len(probs) > 1 else np.zeros(n, np.int64)
        rec = pending[active]
        ga = g[active]
        in_rec = delta < rec
        recovering[active] += np.minimum(delta, rec)
        avail = delta - rec  # wall time of training and saves before the failure
        start = sched.wall(ga)
        ends = ~in_rec & (avail >= finish - start)
        # runs that finish before their next failure
        fin = active[ends]
        clock[fin] += rec[ends] + (finish - start[ends])
        # runs hit by a failure while training or saving: roll back to the newest usable step
        hit = ~in_rec & ~ends
        if hit.any():
            t = cls_tier[cls[hit]]
            now = start[hit] + avail[hit]
            done = sched.done_by(now - lag[t])
            newest = (done // every[t]) * every[t]
            target = np.maximum(newest, (ga[hit] // every[t]) * every[t])
            idx = active[hit]
            lost[idx] += avail[hit] - (sched.wall(target) - start[hit])
            g[idx] = target
        failed = active[~ends]
        clock[failed] += delta[~ends]
        pending[failed] = cls_rec[cls[~ends]]
        failures[failed] += 1
        active = failed
    else:
        raise ValueError(f"strategy {strategy.name!r}: runs still unfinished after {max_failures} failures "
                         "(failures come faster than the job recovers); check the MTTF and recovery times")
    done_work = n_int * strategy.interval
    return SimResult(strategy.name, runs, done_work, Estimate.of(clock), Estimate.of(done_work / clock),
                     Estimate.of(lost), Estimate.of(recovering), Estimate.of(failures), finish - done_work)


#: what the columns of :func:`format_results` mean, printed under the table
LEGEND = """columns (means over the runs; times in hours of wall time)
  goodput         useful training time / job time, with its 95% confidence interval; plan: the planner's figure
  job h           wall time to finish the training work, failures, saves and recoveries included
  lost h          training and saves that failures threw away (redone after a rollback)
  recovering h    restarts and reading the step back after each failure
  failures        failures during one run"""


def format_results(rows: Sequence[tuple[int, SimResult, float]]) -> str:
    """``(accelerators, result, planned goodput)`` rows as the table ``tierfs simulate`` prints."""
    def h(s: float) -> str:
        return f"{s / 3600:.1f}"

    table = [("accelerators", "strategy", "goodput [95% CI]", "plan", "job h [95% CI]", "lost h", "recovering h",
              "failures")]
    for acc, r, planned in rows:
        g, j = r.goodput, r.job_time
        table.append((str(acc), r.strategy, f"{g.mean:.2%} [{g.low:.2%}, {g.high:.2%}]", f"{planned:.2%}",
                      f"{h(j.mean)} [{h(j.low)}, {h(j.high)}]", h(r.work_lost.mean), h(r.recovering.mean),
                      f"{r.failures.mean:.0f}"))
    widths = [max(len(row[c]) for row in table) for c in range(len(table[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in table)


def plot_goodput(rows: Sequence[tuple[int, SimResult, float]], path: str) -> None:
    """Write a PNG of goodput vs cluster size, one line per strategy with its 95% CI (needs matplotlib).

    Raises
    ------
    ImportError
        When matplotlib is not installed (``pip install tierfs[plot]``).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in dict.fromkeys(r.strategy for _, r, _ in rows):
        pts = sorted((a, r) for a, r, _ in rows if r.strategy == name)
        xs = [a for a, _ in pts]
        ys = [r.goodput.mean for _, r in pts]
        err = [[r.goodput.mean - r.goodput.low for _, r in pts], [r.goodput.high - r.goodput.mean for _, r in pts]]
        ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=name)
    ax.set_xscale("log")
    ax.set_xlabel("accelerators")
    ax.set_ylabel("goodput (useful training / wall time)")
    ax.set_title("tierfs simulate: goodput vs cluster size")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
