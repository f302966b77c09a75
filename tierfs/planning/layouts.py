"""The peer tier's layouts side by side for a plan (``tierfs plan --parity 4+1``): ``PeerTier(replicas=1)``
and ``replicas=2`` (and ``--replicas`` when more) against each erasure code given, with the RAM a host needs,
what it sends per save, and the probability that the tier loses a step within one save interval
(formulas: :mod:`tierfs.planning.erasure`).

Every layout is taken at the same save interval: the peer tier's in the plan's RAM + peers + object
strategy, else ``--peer-interval``, else the RAM tier's in RAM + object (:func:`save_interval`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence, Union

from .erasure import (Erasure, erasure_loss_probability, erasure_ram, group_sizes, held_fraction,
                      node_loss_probability, node_mtbf, replica_loss_probability)
from .formulas import RamBudget, ram_per_host
from .inputs import PlanInputs
from .optimise import Plan
from ..util.readable import duration, size

#: a layout: ``r`` replicas (``PeerTier(replicas=r)``, ring placement) or an erasure code
Spec = Union[int, Erasure]

YEAR = 365.25 * 86400


def spec_name(spec: Spec) -> str:
    """``replicas=1`` or ``erasure 4+1``."""
    return f"erasure {spec}" if isinstance(spec, Erasure) else f"replicas={spec}"


@dataclass(frozen=True)
class Layout:
    """One layout of the peer tier on a plan's hosts.

    Attributes
    ----------
    spec : int or Erasure
        Replicas, or the erasure code.
    groups : tuple of (nodes, count)
        Erasure coding: the groups' sizes and how many of each; replicas: one ring of every host.
    held : tuple of float
        What a host keeps for others per kept step, as a fraction of its shard, for each group size.
    ram : RamBudget
        RAM per host (the most any host needs: the smallest group's).
    sent : float
        Bytes each host sends per save.
    loss : float or None
        Probability that the tier loses a step within one save interval (None: no interval or MTTF).
    """

    spec: Spec
    groups: tuple[tuple[int, int], ...]
    held: tuple[float, ...]
    ram: RamBudget
    sent: float
    loss: float | None

    @property
    def name(self) -> str:
        return spec_name(self.spec)


@dataclass(frozen=True)
class Comparison:
    """The layouts of one plan, at one save interval."""

    hosts: int
    shard: float
    node_loss: float
    interval: float | None  # seconds of wall time a step is exposed to node losses
    interval_from: str  # where the interval comes from
    node_mtbf: float | None  # mean time between losses of one node's RAM
    p: float | None  # probability that a node is lost within the interval
    layouts: tuple[Layout, ...]
    notes: tuple[str, ...]


def specs(p: PlanInputs) -> list[Spec]:
    """The layouts to compare: replicas 1 and 2, ``p.replicas`` when more, then ``p.erasure``."""
    reps = [1, 2] + ([p.replicas] if p.replicas > 2 else [])
    out: list[Spec] = [r for r in reps if r + 1 <= p.hosts]
    return out + list(p.erasure)


def save_interval(plan: Plan) -> tuple[float | None, str]:
    """The wall time between two saves of the peer tier, and where it comes from (None: none planned)."""
    by_name = {sp.strategy.name: sp for sp in plan.strategies}
    peers = by_name.get("RAM + peers + object")
    if peers is not None:
        s = peers.strategy
        return s.wall_per_interval() * s.tier("peer").every, "the peer tier's in RAM + peers + object"
    if "peer" in plan.inputs.intervals:
        return plan.inputs.intervals["peer"], "--peer-interval"
    ram = by_name.get("RAM + object")
    if ram is not None:
        return ram.strategy.wall_per_interval(), "the RAM tier's in RAM + object: no peer strategy planned"
    return None, "none planned (needs --mttf or --accelerator-mttf and the RAM and object bandwidths)"


def layout(p: PlanInputs, spec: Spec, lose: float | None) -> Layout:
    """``spec`` on ``p``'s hosts; ``lose``: each node's probability of being lost within the interval."""
    ckpt = p.shard * p.hosts
    if isinstance(spec, Erasure):
        sizes = group_sizes(p.hosts, spec.data, spec.parity)
        groups = tuple((s, sizes.count(s)) for s in sorted(set(sizes)))
        held = tuple(held_fraction(s, spec.parity) for s, _ in groups)
        ram = erasure_ram(ckpt, p.hosts, spec.data, spec.parity, keep=p.keep, in_flight=p.in_flight,
                          replica_keep=p.replica_keep, headroom=p.headroom)
        loss = None if lose is None else erasure_loss_probability(p.hosts, spec.data, spec.parity, lose)
        return Layout(spec, groups, held, ram, spec.parity * p.shard, loss)
    ram = ram_per_host(ckpt, p.hosts, keep=p.keep, in_flight=p.in_flight, replicas=spec, replica_keep=p.replica_keep,
                       headroom=p.headroom)
    loss = None if lose is None else replica_loss_probability(p.hosts, spec, lose)
    return Layout(spec, ((p.hosts, 1),), (float(spec),), ram, spec * p.shard, loss)


def compare(plan: Plan, interval: float | None = None) -> Comparison:
    """The layouts of :func:`specs` on the plan's hosts, at ``interval`` (default :func:`save_interval`)."""
    p = plan.inputs
    how = "given"
    if interval is None:
        interval, how = save_interval(plan)
    mtbf = lose = None
    if p.mttf is not None and interval is not None:
        mtbf = node_mtbf(p.mttf, p.hosts, p.node_loss)
        lose = node_loss_probability(interval, mtbf)
    notes = []
    for r in (1, 2):
        if r + 1 > p.hosts:
            notes.append(f"replicas={r} needs {r + 1} hosts: left out")
    if p.data_parallel > 1:
        notes.append(f"--data-parallel {p.data_parallel}: the hosts holding the same part have it in RAM "
                     "already; these layouts would add copies beyond those")
    for code in p.erasure:
        k = code.width
        if p.hosts < k:
            notes.append(f"erasure {code} on {p.hosts} hosts: fewer than {k}, so one group of all of them "
                         f"({p.hosts - code.parity} data + {code.parity} parity)")
        elif p.hosts % k:
            notes.append(f"erasure {code} on {p.hosts} hosts: {p.hosts} is not a multiple of {k}, so the "
                         f"{p.hosts % k} hosts left over join the last groups, one each (less parity per host "
                         "there); RAM per host is the smallest group's")
    return Comparison(p.hosts, p.shard, p.node_loss, interval, how, mtbf, lose,
                      tuple(layout(p, s, lose) for s in specs(p)), tuple(notes))


def years(seconds: float) -> str:
    """A long duration: ``duration`` below a year, else years (``1.4 y``, ``2,310 y``, ``2.5e+06 y``)."""
    if math.isinf(seconds):
        return "none"
    if seconds < YEAR:
        return duration(seconds)
    y = seconds / YEAR
    return f"{y:.1f} y" if y < 10 else f"{y:,.0f} y" if y < 1e5 else f"{y:.1e} y"


def probability(x: float | None) -> str:
    """``3.61e-08``; ``-`` for None."""
    return "-" if x is None else "0" if x == 0 else f"{x:.2e}"


#: what the columns of the layouts table mean, printed under it
LEGEND = (
    ("held/step", "what a host keeps for others per step the tier keeps, x its shard: r replicas, or parity / "
                  "(group - parity);"),
    ("", "with several group sizes, one figure per size, in the order of the groups column"),
    ("RAM per host", "the RAM budget above with held/step x --replica-keep for the replicas held; the most a host "
                     "needs"),
    ("sent/save", "what each host sends to others per save: r, or parity, x its shard"),
    ("P(step lost)", "probability that the node losses within one save interval lose the tier's step: a node and "
                     "the r"),
    ("", "after it around the ring (PeerTier's ring placement), or more than parity nodes of one group"),
    ("lost step every", "interval / P(step lost): mean time between steps the tier loses (a node loss then reads "
                        "the object tier)"),
)


def format_layouts(c: Comparison) -> list[str]:
    """The comparison as the lines ``tierfs plan --parity`` prints."""
    out = ["peer tier: replicas or erasure coding (--parity), per host; a step is lost when a node and all its "
           "replica holders,", "or more than parity nodes of one group, lose their RAM within one save interval"]
    rows = [("layout", "groups", "held/step", "RAM per host", "sent/save", "P(step lost)", "lost step every")]
    for lay in c.layouts:
        if isinstance(lay.spec, Erasure):
            groups = ", ".join(f"{n} of {s}" for s, n in lay.groups)
        else:
            groups = f"ring of {c.hosts}"
        every = "-" if lay.loss is None or c.interval is None else (
            "none" if lay.loss == 0 else years(c.interval / lay.loss))
        rows.append((lay.name, groups, ", ".join(f"{h:.2f}" for h in lay.held), size(lay.ram.total, si=True),
                     size(lay.sent, si=True), probability(lay.loss), every))
    out += _table(rows)
    if c.interval is not None and c.p is not None and c.node_mtbf is not None:
        out += [f"  save interval {duration(c.interval)} ({c.interval_from});",
                f"  a host loses its RAM every {years(c.node_mtbf)} (cluster MTTF x {c.hosts} hosts / --node-loss "
                f"{c.node_loss:g}), so within an interval with p = {probability(c.p)} (independent losses; "
                "correlated ones: --replica-loss)"]
    else:
        out.append(f"  P(step lost) needs a failure rate and a save interval: interval {c.interval_from}")
    out += [""] + _table(LEGEND)
    out += [f"  note: {n}" for n in c.notes]
    return out


def layouts_to_dict(c: Comparison) -> dict[str, Any]:
    """The comparison as JSON-able data (``tierfs plan --parity ... --json``)."""
    def one(lay: Layout) -> dict[str, Any]:
        kind = {"data": lay.spec.data, "parity": lay.spec.parity} if isinstance(lay.spec, Erasure) else {
            "replicas": lay.spec}
        return {"name": lay.name, **kind,
                "groups": [{"nodes": s, "count": n, "held": h} for (s, n), h in zip(lay.groups, lay.held)],
                "ram_per_host": lay.ram.total, "sent_per_save": lay.sent, "loss_probability": lay.loss,
                "mean_time_to_loss_s": (None if lay.loss is None or c.interval is None or lay.loss == 0
                                        else c.interval / lay.loss)}

    return {"interval_s": c.interval, "interval_from": c.interval_from, "node_mtbf_s": (
        None if c.node_mtbf is None or math.isinf(c.node_mtbf) else c.node_mtbf), "p_node": c.p,
            "layouts": [one(lay) for lay in c.layouts], "notes": list(c.notes)}


def _table(rows: Sequence[Sequence[str]], indent: str = "  ") -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [indent + "  ".join(x.ljust(w) for x, w in zip(r, widths)).rstrip() for r in rows]
