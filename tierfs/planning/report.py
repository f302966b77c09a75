"""A plan as people read it (``tierfs plan``) and as JSON (``tierfs plan --json``)."""

from __future__ import annotations

import math
from typing import Any, Sequence

from .layouts import compare, format_layouts, layouts_to_dict
from .optimise import Plan
from ..util.readable import duration, rate, size


def _table(rows: Sequence[Sequence[str]], indent: str = "  ") -> list[str]:
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    return [indent + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


#: what each column of the strategy and recovery tables means, printed under them
_LEGEND = (
    ("interval", "training time between saves to the tier: the model's goodput maximum, in whole --step-time "
                 "steps"),
    ("", "(a slower tier takes every n-th save of the first tier: its interval is a multiple of that one)"),
    ("Young/Daly", "sqrt(2 x stall x MTTF for it), where the search for the interval starts"),
    ("MTTF for it", "mean time between the failures that restore from the tier; none: no failure does, so "
                    "Young/Daly"),
    ("", "is -, and the tier is saved for another reason (see the notes)"),
    ("stall", "training time lost per save: the RAM copy, a synchronous upload, or for a copy in the "
              "background"),
    ("", "--background-slowdown x its transfer"),
    ("transfer", "time a save takes to reach the tier; a copy in the background is usable only after it"),
    ("write/host", "each host's average write rate into the tier: its shard per save (--replicas x its shard "
                   "to peers)"),
    ("", "over the wall time between saves, so tiers saved equally often show the same rate"),
    ("write/job", "write/host x hosts: the whole job's (what an object store must absorb)"),
    ("goodput", "expected useful training time / wall time, failures, saves and recoveries counted"),
    ("share", "fraction of all failures in this class (from --node-loss and --replica-loss)"),
    ("reads from", "the tier the class restores from; recovery: --restart, + --replace after a node loss, + "
                   "reading"),
    ("", "the step back from that tier"),
)


def format_plan(plan: Plan) -> str:
    """The plan as the readable text ``tierfs plan`` prints."""
    p, r = plan.inputs, plan.ram
    out = [f"checkpoint {_gb(p.checkpoint)}, {p.hosts} hosts, {p.accelerators} accelerators, "
           f"shard per host {_gb(p.shard)}"]
    if p.data_parallel > 1:
        out.append(f"data-parallel degree {p.data_parallel}: the object store takes {_gb(p.checkpoint)} per "
                   f"save ({_gb(p.checkpoint / p.hosts)} per host), not {_gb(p.checkpoint * p.data_parallel)}; "
                   "peers replicate nothing (the hosts holding the same part have it in RAM)")
    if p.mttf is not None:
        out.append(f"cluster MTTF {duration(p.mttf)}; failures losing the node {p.node_loss:.0%}"
                   + (f", of those losing every replica too {p.replica_loss:.0%}" if p.replicas else ""))
    out += ["", "RAM per host for the RAM tier"]
    rows: list[tuple[str, ...]] = [("own steps kept", f"{p.keep} x {_gb(r.shard)}", _gb(r.own)),
            ("steps in flight", f"{p.in_flight} x {_gb(r.shard)}", _gb(r.in_flight)),
            ("replicas held for others", f"{p.peer_replicas} x {p.replica_keep} x {_gb(r.shard)}",
             _gb(r.replicas)),
            ("headroom", f"{p.headroom:.0%}", _gb(r.headroom)),
            ("total", "", _gb(r.total))]
    out += _table(rows)
    if plan.object_rule is not None:
        t = plan.object_rule
        per_day = 86400 / t.interval
        how = (f"{p.saves_per_mttf:g} saves per MTTF" if "object" not in p.intervals and p.saves_per_mttf
               else "fixed interval")
        out += ["", f"object tier at {how}: every {duration(t.interval)}, {per_day:.0f} checkpoints/day, "
                    f"{per_day * p.checkpoint / 1e15:.2f} PB/day",
                f"  sustained write {rate(t.bandwidth_total)} for the job ({rate(t.bandwidth_per_host)} per host)"]
    if plan.strategies:
        out += ["", "strategies (intervals in training time; goodput = useful training / wall time)"]
        rows = [("strategy", "tier", "interval", "Young/Daly", "MTTF for it", "stall", "transfer",
                 "write/host", "write/job", "goodput")]
        for sp in plan.strategies:
            for i, t in enumerate(sp.tiers):
                unneeded = math.isinf(t.mttf)  # no failure class restores from this tier
                rows.append((sp.strategy.name if i == 0 else "", t.name, duration(t.interval),
                             "-" if unneeded or math.isinf(t.young_daly) else duration(t.young_daly),
                             "none" if unneeded else duration(t.mttf), duration(t.blocking), duration(t.transfer),
                             rate(t.bandwidth_per_host), rate(t.bandwidth_total),
                             f"{sp.goodput:.2%}" if i == 0 else ""))
        out += _table(rows)
        out += ["", "recovery per failure class"]
        rows = [("strategy", "class", "share", "reads from", "recovery")]
        for sp in plan.strategies:
            for i, c in enumerate(sp.strategy.classes):
                rows.append((sp.strategy.name if i == 0 else "", c.name, f"{c.probability:.0%}", c.tier,
                             duration(c.recovery)))
        out += _table(rows)
        out += ["", "columns"] + _table([(name, text) for name, text in _LEGEND])
    if p.erasure:
        out += [""] + format_layouts(compare(plan))
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
    if p.erasure:
        out["peer_layouts"] = layouts_to_dict(compare(plan))
    return out


def _gb(n: float) -> str:
    """Bytes in decimal units (``840.00 GB``, ``5.00 TB``), as the planner's inputs are."""
    return size(n, si=True)
