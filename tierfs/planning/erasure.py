"""The peer tier's two layouts as the planner sees them: replicas (``PeerTier(replicas=r)``) and erasure
coding (``ErasureCodedTier(data=d, parity=m)``): groups, RAM per host, bytes sent per save, and the
probability that a step is lost within one save interval (no I/O, no clock).

**Groups** (erasure coding). Nodes in order form groups of ``k = data + parity`` nodes; when the node
count ``n`` is not a multiple of ``k``, the last ``n mod k`` groups take one node more each (a group of
``s`` nodes keeps ``parity`` parity, so its data count is ``s - parity``); a remainder larger than the
number of groups (possible only below ``k (k - 1)`` nodes) goes round again, from the last group back. Fewer than ``k`` nodes
are one group of all of them, which needs ``parity + 1`` nodes. :func:`group_sizes`, :func:`group_of`.

**RAM.** A node of a group of ``s`` keeps its own shard and ``parity / (s - parity)`` of a shard of
parity for each step the tier keeps (4+1: 1.25 x the shard, against ``1 + r`` x with ``r`` replicas);
:func:`erasure_ram` is :func:`~tierfs.planning.formulas.ram_per_host` with that in place of the replicas.
Each node sends ``parity`` x its shard per save, as ``PeerTier(replicas=parity)`` does.

**Loss.** Node losses are independent, each node losing its RAM at rate ``1 / node_mtbf``
(:func:`node_mtbf`: the cluster's MTTF x hosts / the fraction of failures that lose a node), so a node is
lost within a save interval ``T`` with probability ``p = 1 - exp(-T / node_mtbf)``
(:func:`node_loss_probability`). A step is lost when, within one interval:

- erasure coding: more than ``parity`` nodes of one group are lost. A group of ``s`` loses it with
  ``P_s = sum_{j > parity} C(s, j) p^j (1 - p)^(s - j)`` (:func:`group_loss_probability`);
- replicas: a node and all ``r`` nodes holding its replicas are lost. With ``PeerTier``'s ``"ring"``
  placement a node's replicas are on the next ``r`` nodes of one ring of all ``n``, so that is a run of
  ``r + 1`` consecutive lost nodes around the ring; ``"pairwise"`` runs the ring inside groups of
  ``r + 1`` (the last takes the remainder). :func:`run_loss_probability` is exact for a ring of any size.

Groups (rings) share no node, so the step is lost with ``1 - prod_g (1 - P_g)`` (:func:`erasure_loss_probability`,
:func:`replica_loss_probability`). Every figure is a sum of non-negative terms, so it keeps its precision
down to the smallest probabilities (no ``1 - (1 - x)``). For small ``p``: 4+1 on ``n`` nodes loses a step
with about ``2 n p^2``, ring replicas=1 with ``n p^2``; 4+2 with about ``3.3 n p^3``, replicas=2 with ``n p^3``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .formulas import RamBudget, ram_per_host

#: how :class:`~tierfs.tiers.PeerTier` places replicas
PLACEMENTS = ("ring", "pairwise")


@dataclass(frozen=True)
class Erasure:
    """An erasure code of ``data`` data and ``parity`` parity pieces per group (``4+1``)."""

    data: int
    parity: int

    def __post_init__(self) -> None:
        if self.data < 1 or self.parity < 1:
            raise ValueError(f"an erasure code needs data >= 1 and parity >= 1, got {self.data}+{self.parity}")

    @property
    def width(self) -> int:
        """Nodes in a full group: ``data + parity``."""
        return self.data + self.parity

    def __str__(self) -> str:
        return f"{self.data}+{self.parity}"


def parse_erasure(text: str) -> Erasure:
    """``"4+1"`` -> ``Erasure(4, 1)`` (ValueError with one line otherwise)."""
    m = re.fullmatch(r"\s*(\d+)\s*\+\s*(\d+)\s*", text)
    if not m:
        raise ValueError(f"{text!r} is not DATA+PARITY, e.g. 4+1")
    return Erasure(int(m.group(1)), int(m.group(2)))


def group_sizes(nodes: int, data: int, parity: int) -> tuple[int, ...]:
    """Sizes of the erasure-coded groups of ``nodes`` nodes, in node order (see the module docstring).

    ``group_sizes(1003, 4, 1)`` is 197 groups of 5 then 3 of 6; ``group_sizes(9, 4, 1)`` is ``(9,)``.
    """
    k = Erasure(data, parity).width
    if nodes < parity + 1:
        raise ValueError(f"an erasure-coded tier with parity {parity} needs at least {parity + 1} hosts, "
                         f"got {nodes}")
    if nodes < k:
        return (nodes,)
    full, rem = divmod(nodes, k)
    base, more = divmod(rem, full)
    return (k + base,) * (full - more) + (k + base + 1,) * more


def group_of(nodes: int, data: int, parity: int) -> np.ndarray:
    """The group of each node (in node order): consecutive chunks of ``data + parity``, the remainder
    appended one node each to the last groups, from the last back (as the tier places them)."""
    k = data + parity
    sizes = group_sizes(nodes, data, parity)
    if len(sizes) == 1:
        return np.zeros(nodes, np.int64)
    full = len(sizes)
    out = np.repeat(np.arange(full, dtype=np.int64), k)
    extra = (full - 1 - np.arange(nodes - full * k)) % full
    return np.concatenate([out, extra])


def held_fraction(size: int, parity: int) -> float:
    """Parity a node of a group of ``size`` keeps per step, as a fraction of its shard: ``parity / (size - parity)``."""
    if size < parity + 1:
        raise ValueError(f"a group of {size} nodes cannot keep parity {parity}")
    return parity / (size - parity)


def erasure_ram(checkpoint: float, hosts: int, data: int, parity: int, *, keep: int = 2, in_flight: int = 1,
                replica_keep: int = 1, headroom: float = 0.15) -> RamBudget:
    """RAM per host with an erasure-coded peer tier: :func:`~tierfs.planning.formulas.ram_per_host` with
    ``parity / (s - parity)`` of a shard held per kept step in place of replicas, ``s`` the smallest group
    (the most a host needs: hosts in larger groups need less)."""
    frac = held_fraction(min(group_sizes(hosts, data, parity)), parity)
    r = ram_per_host(checkpoint, hosts, keep=keep, in_flight=in_flight, replicas=0, replica_keep=replica_keep,
                     headroom=headroom)
    held = frac * replica_keep * r.shard
    return RamBudget(r.shard, r.own, r.in_flight, held, headroom * (r.own + r.in_flight + held))


def node_mtbf(cluster_mttf: float, hosts: int, node_loss: float) -> float:
    """Mean time between losses of one node's RAM: ``cluster_mttf * hosts / node_loss`` (inf: none)."""
    if not cluster_mttf > 0 or hosts < 1 or not 0 <= node_loss <= 1:
        raise ValueError("need a positive MTTF, hosts >= 1 and a node-loss fraction in [0, 1]")
    return math.inf if node_loss == 0 else cluster_mttf * hosts / node_loss


def node_loss_probability(interval: float, mtbf: float) -> float:
    """Probability that a node is lost within ``interval`` seconds: ``1 - exp(-interval / mtbf)``."""
    if interval < 0 or not mtbf > 0:
        raise ValueError("need interval >= 0 and mtbf > 0")
    return -math.expm1(-interval / mtbf)


def _union(probabilities: dict[int, float], counts: dict[int, int]) -> float:
    """``1 - prod (1 - P)^count`` over disjoint groups, kept precise for small ``P``."""
    s = 0.0
    for size, n in counts.items():
        pr = probabilities[size]
        if pr >= 1.0:
            return 1.0
        s += n * math.log1p(-pr)
    return -math.expm1(s)


def _counts(sizes: Sequence[int]) -> dict[int, int]:
    out: dict[int, int] = {}
    for s in sizes:
        out[s] = out.get(s, 0) + 1
    return out


def group_loss_probability(size: int, parity: int, p: float) -> float:
    """Probability that more than ``parity`` of ``size`` nodes are lost, each with probability ``p``."""
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"p must be a probability, got {p}")
    q = 1.0 - p
    return min(1.0, sum(math.comb(size, j) * p ** j * q ** (size - j) for j in range(parity + 1, size + 1)))


def erasure_loss_probability(nodes: int, data: int, parity: int, p: float) -> float:
    """Probability that an erasure-coded tier on ``nodes`` nodes loses a step within one save interval,
    each node lost in it with probability ``p``: some group loses more than ``parity`` nodes."""
    counts = _counts(group_sizes(nodes, data, parity))
    return _union({s: group_loss_probability(s, parity, p) for s in counts}, counts)


def run_loss_probability(size: int, run: int, p: float) -> float:
    """Probability of ``run`` or more consecutive lost nodes around a ring of ``size`` nodes (``size >= run``),
    each lost with probability ``p``.

    Condition on the ``a`` lost nodes the ring starts with (``a >= run`` is a run already, probability
    ``p^run``): for ``a < run`` the next node is kept (``p^a (1 - p)``) and the remaining ``size - a - 1``
    nodes are a line whose run lengths a transfer matrix with an absorbing "run reached" state tracks; a
    run left open at the end joins the ``a`` at the start. Products of non-negative matrices: no
    cancellation, exact to rounding.
    """
    if run < 1 or size < run:
        raise ValueError(f"need 1 <= run <= size, got run {run} on a ring of {size}")
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"p must be a probability, got {p}")
    q = 1.0 - p
    step = np.zeros((run + 1, run + 1))
    step[:run, 0] = q  # a kept node ends the run
    for c in range(run - 1):
        step[c, c + 1] = p
    step[run - 1, run] = p
    step[run, run] = 1.0  # absorbing: a run was reached
    power = np.linalg.matrix_power(step, size - run)  # for a = run - 1; one more step per smaller a
    total = p ** run
    for a in range(run - 1, -1, -1):
        v = power[0]  # from "just kept a node", size - a - 1 nodes on
        total += p ** a * q * (v[run] + v[run - a:run].sum())
        power = power @ step
    return min(1.0, float(total))


def ring_sizes(nodes: int, replicas: int, placement: str = "ring") -> tuple[int, ...]:
    """The rings replicas go around: one of all nodes (``"ring"``), or groups of ``replicas + 1``, the
    last taking the remainder (``"pairwise"``)."""
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be 'ring' or 'pairwise', got {placement!r}")
    if replicas < 1 or nodes < replicas + 1:
        raise ValueError(f"replicas={replicas} needs at least {replicas + 1} hosts, got {nodes}")
    if placement == "ring":
        return (nodes,)
    g = replicas + 1
    full = nodes // g
    return (g,) * (full - 1) + (g + nodes % g,)


def replica_loss_probability(nodes: int, replicas: int, p: float, placement: str = "ring") -> float:
    """Probability that a peer tier of ``replicas`` replicas on ``nodes`` nodes loses a step within one save
    interval, each node lost in it with probability ``p``: a node and the ``replicas`` nodes after it on
    its ring are all lost."""
    counts = _counts(ring_sizes(nodes, replicas, placement))
    return _union({s: run_loss_probability(s, replicas + 1, p) for s in counts}, counts)
