"""Monte-Carlo of node losses, counting the steps each peer-tier layout loses (``tierfs simulate --parity``);
it checks the formulas of :mod:`tierfs.planning.erasure`.

Each node loses its RAM at the times of a Poisson process of rate ``1 / node_mtbf`` (all nodes together: a
Poisson number of losses over the simulated time, each at a uniform node and time). Time is cut into save
intervals of ``interval`` seconds; an interval loses its step in a layout when the nodes lost within it
(each counted once, however often it was lost) include:

- ``r`` replicas (``PeerTier``, ``"ring"`` or ``"pairwise"`` placement): a node and the ``r`` nodes after
  it on its ring, the ring of :func:`~tierfs.planning.erasure.ring_sizes`;
- an erasure code: more than ``parity`` nodes of one group of :func:`~tierfs.planning.erasure.group_of`.

The work is proportional to the node losses drawn (a batch of intervals at a time), not to the intervals.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from .erasure import Erasure, group_of, ring_sizes
from .simulate import Z95

#: node losses drawn per batch of intervals (memory: a few arrays of this many int64)
BATCH = 1 << 20


@dataclass(frozen=True)
class LossCount:
    """How many of ``intervals`` save intervals lost their step in one layout."""

    layout: str
    intervals: int
    lost: int

    @property
    def rate(self) -> float:
        """Lost steps per interval."""
        return self.lost / self.intervals

    @property
    def ci95(self) -> tuple[float, float]:
        """A 95% interval of the probability of losing a step within one interval: Clopper and Pearson's
        (exact) while either count is at most :data:`EXACT`, Wilson's beyond (where they agree)."""
        return binomial_ci95(self.lost, self.intervals)

    def __contains__(self, probability: float) -> bool:
        lo, hi = self.ci95
        return lo <= probability <= hi


#: up to this many successes (or failures) the 95% interval is Clopper and Pearson's, summed term by term
EXACT = 200


def _cdf(k: int, n: int, p: float) -> float:
    """P(X <= k) for X ~ Binomial(n, p), summed over the k + 1 terms."""
    if p <= 0.0:
        return 1.0
    if p >= 1.0:
        return 1.0 if k >= n else 0.0
    lp, lq, ln = math.log(p), math.log1p(-p), math.lgamma(n + 1)
    return min(1.0, sum(math.exp(ln - math.lgamma(j + 1) - math.lgamma(n - j + 1) + j * lp + (n - j) * lq)
                        for j in range(k + 1)))


def _solve(f: Callable[[float], float], target: float) -> float:
    """The p in [0, 1] where the decreasing ``f(p)`` crosses ``target`` (bisection)."""
    lo, hi = 0.0, 1.0
    for _ in range(200):
        mid = (lo + hi) / 2
        if f(mid) > target:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-12 * hi:
            break
    return (lo + hi) / 2


def binomial_ci95(k: int, n: int) -> tuple[float, float]:
    """A 95% interval of a probability seen ``k`` times in ``n`` trials (see :attr:`LossCount.ci95`)."""
    if not 0 <= k <= n or n < 1:
        raise ValueError(f"need 0 <= k <= n and n >= 1, got k={k}, n={n}")
    if n - k < k:
        lo, hi = binomial_ci95(n - k, n)
        return 1.0 - hi, 1.0 - lo
    if k <= EXACT:
        lo = 0.0 if k == 0 else _solve(lambda p: _cdf(k - 1, n, p), 1 - 0.025)  # P(X >= k) = 2.5%
        hi = _solve(lambda p: _cdf(k, n, p), 0.025)  # P(X <= k) = 2.5%
        return lo, hi
    z2 = Z95 * Z95
    centre = (k + z2 / 2) / (n + z2)
    half = Z95 / (n + z2) * math.sqrt(k * (n - k) / n + z2 / 4)
    return max(0.0, centre - half), min(1.0, centre + half)


def _successors(nodes: int, replicas: int, placement: str) -> np.ndarray:
    """``succ[k - 1, i]``: the node ``k`` places after node ``i`` on its ring (the ``k``-th holder of its replicas)."""
    sizes = np.array(ring_sizes(nodes, replicas, placement), dtype=np.int64)
    start = np.repeat(np.cumsum(sizes) - sizes, sizes)
    size = np.repeat(sizes, sizes)
    pos = np.arange(nodes, dtype=np.int64) - start
    return np.stack([start + (pos + k) % size for k in range(1, replicas + 1)])


def _lost_intervals(cells: np.ndarray, nodes: int, spec: int | Erasure, table: np.ndarray) -> int:
    """Intervals among the sorted, distinct ``cells`` (``interval * nodes + node``: a node lost in an interval)
    that lose their step; ``table``: the groups (erasure) or the ring successors (replicas)."""
    if cells.size == 0:
        return 0
    win, node = np.divmod(cells, nodes)
    if isinstance(spec, Erasure):
        ngroups = int(table.max()) + 1
        key, count = np.unique(win * ngroups + table[node], return_counts=True)
        return int(np.unique(key[count > spec.parity] // ngroups).size)
    run = np.ones(cells.size, bool)
    for succ in table:
        want = win * nodes + succ[node]
        at = np.minimum(np.searchsorted(cells, want), cells.size - 1)
        run &= cells[at] == want
    return int(np.unique(win[run]).size)


def count_losses(nodes: int, layouts: Sequence[int | Erasure], node_mtbf: float, interval: float, intervals: int,
                 *, seed: int = 0, placement: str = "ring") -> list[LossCount]:
    """Simulate ``intervals`` save intervals of node losses on ``nodes`` nodes; count each layout's lost steps.

    Parameters
    ----------
    nodes : int
        Nodes (hosts) in the job.
    layouts : sequence of int or Erasure
        Replicas ``r`` (placed by ``placement``) or erasure codes; all see the same node losses.
    node_mtbf : float
        Mean seconds between losses of one node's RAM (``inf``: none).
    interval : float
        Seconds between two saves of the tier.
    intervals : int
        Save intervals to simulate (e.g. runs x the intervals in one run).
    seed : int
        Seed of numpy's ``default_rng``.
    placement : str
        ``"ring"`` (PeerTier's default) or ``"pairwise"``.

    Returns
    -------
    list of LossCount
        One per layout, in order.
    """
    if nodes < 1 or intervals < 1 or not interval > 0 or not node_mtbf > 0:
        raise ValueError("need nodes >= 1, intervals >= 1, interval > 0 and node MTBF > 0")
    tables = [group_of(nodes, s.data, s.parity) if isinstance(s, Erasure) else _successors(nodes, s, placement)
              for s in layouts]
    names = [f"erasure {s}" if isinstance(s, Erasure) else f"replicas={s}" for s in layouts]
    lost = [0] * len(layouts)
    rate = nodes * interval / node_mtbf  # node losses per interval, all nodes
    per_batch = intervals if rate == 0 else max(1, min(intervals, int(BATCH / rate), (1 << 62) // nodes))
    rng = np.random.default_rng(seed)
    done = 0
    while done < intervals:
        w = min(per_batch, intervals - done)
        drawn = rng.poisson(rate * w)
        cells = np.unique(rng.integers(0, w * nodes, size=drawn, dtype=np.int64))
        for i, (spec, table) in enumerate(zip(layouts, tables)):
            lost[i] += _lost_intervals(cells, nodes, spec, table)
        done += w
    return [LossCount(n, intervals, k) for n, k in zip(names, lost)]
