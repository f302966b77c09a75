"""``tierfs simulate``: Monte-Carlo runs of a job under failures (:mod:`tierfs.planning.simulate`) with the
intervals ``plan`` chooses, for one cluster or several sizes; it takes ``plan``'s arguments
(:func:`tierfs.cli.plan.add_model_args`) and its own.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from typing import Any

from .. import planning as pl
from ..planning import coordination, layouts, store_requests as requests
from ..planning.losses import LossCount, count_losses
from ..util.readable import duration, rate, size
from .plan import add_model_args, inputs_from_args, usage_errors
from .numbers import int_at_least, parse_count, parse_duration


def _sizes(text: str) -> list[int]:
    """``--sizes 1k,10k``: cluster sizes in accelerators."""
    try:
        out = [int(round(parse_count(x))) for x in text.split(",") if x.strip()]
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"--sizes: {e}") from None
    if not out:
        raise argparse.ArgumentTypeError("--sizes needs at least one cluster size, e.g. 1k,10k,100k")
    return out


@usage_errors
def cmd_simulate(args: argparse.Namespace) -> int:
    """``tierfs simulate``: goodput, job time, work lost per strategy and cluster size, with 95% intervals."""
    from ..planning import simulate as sim

    if args.sizes and args.accelerator_mttf is None:
        raise ValueError("--sizes needs --accelerator-mttf (the cluster's MTTF falls with its size)")
    if args.sizes:
        # the sizes are the clusters: hosts = size / --accelerators-per-host; a --hosts/--accelerators is not used
        given = [f"{o} {v}" for o, v in (("--hosts", args.hosts), ("--accelerators", args.accelerators))
                 if v is not None]
        if given:
            print(f"tierfs: note: --sizes gives the cluster sizes; {' and '.join(given)} not used", file=sys.stderr)
        args = argparse.Namespace(**{**vars(args), "hosts": None, "accelerators": args.sizes[0]})
    base = inputs_from_args(args)
    sizes = args.sizes or [base.accelerators]
    rows: list[tuple[int, sim.SimResult, float]] = []
    stores: list[tuple[int, int, float, float, float]] = []  # the object store at each size
    losses: list[tuple[int, layouts.Comparison, int, list[LossCount]]] = []  # the peer tier's layouts at each size
    for i, n in enumerate(sizes):
        p = pl.scaled(base, n, args.accelerator_mttf, args.accelerators_per_host) if args.sizes else base
        if p.mttf is None:
            raise ValueError("simulate needs a failure rate: --mttf or --accelerator-mttf")
        plan = pl.make_plan(p)
        if not plan.strategies:
            raise ValueError("nothing to simulate: " + "; ".join(plan.notes))
        for sp in plan.strategies:
            r = sim.simulate(sp.strategy, p.mttf, args.work, runs=args.runs, seed=args.seed + i)
            rows.append((n, r, sp.goodput))
        best = max(plan.strategies, key=lambda sp: sp.goodput)
        write = max((t.bandwidth_total for t in best.tiers if t.name == "object"), default=0.0)
        stores.append((n, p.hosts, p.checkpoint, p.checkpoint * p.data_parallel, write))
        if p.erasure:
            losses.append(_losses(n, plan, args, args.seed + i))
    if args.json:
        store_of = {n: {"object_bytes_per_save": once, "object_write_per_s": write,
                        "coordination_per_save": dataclasses.asdict(coordination.per_save(n)),
                        "object_requests_per_save": _requests_dict(requests.object_save(once / n, n))}
                    for n, _, once, _, write in stores}
        for n, c, per_run, counts in losses:
            store_of[n]["peer_layouts"] = {**layouts.layouts_to_dict(c), "intervals_per_run": per_run, "simulated": [
                {"layout": k.layout, "intervals": k.intervals, "lost": k.lost, "ci95": list(k.ci95)} for k in counts]}
        print(json.dumps([{"accelerators": n, "plan_goodput": g, **store_of[n], **r.as_dict()} for n, r, g in rows],
                         indent=2))
    else:
        work = f"{args.work / 86400:g} days" if args.work >= 86400 else duration(args.work)
        print(f"{args.runs} runs of {work} of training per strategy and size, seed {args.seed}; "
              "95% confidence intervals")
        print(sim.format_results(rows))
        print()
        dp = base.data_parallel
        print("object store (the best strategy's writes" + (f"; data-parallel degree {dp}: each distinct byte once "
                                                            "per save)" if dp > 1 else ")"))
        print("\n".join(f"  {n} accelerators, {hosts} hosts: {size(once)} per save"
                        + (f" ({size(whole)} if every copy were stored)" if dp > 1 else "")
                        + f", {rate(write)} for the job" for n, hosts, once, whole, write in stores))
        print()
        print(_coordination([n for n, *_ in stores]))
        print()
        print(_object_requests([(n, once) for n, _, once, _, _ in stores]))
        print()
        if losses:
            print(_format_losses(losses, args.runs))
            print()
        print(sim.LEGEND)
    if args.plot:
        try:
            sim.plot_goodput(rows, args.plot)
        except ImportError:
            print("tierfs: note: matplotlib is not installed, no plot written (pip install 'tierfs[plot]')",
                  file=sys.stderr)
        else:
            print(f"plot written to {args.plot}", file=sys.stderr)
    return 0


def _losses(n: int, plan: pl.Plan, args: argparse.Namespace,
            seed: int) -> tuple[int, layouts.Comparison, int, list[LossCount]]:
    """The peer tier's layouts at one size: the formula's probability of losing a step, and a Monte-Carlo of
    node losses over ``--runs`` x ``--work`` in save intervals counting the steps each layout loses."""
    c = layouts.compare(plan)
    if c.interval is None or c.node_mtbf is None:
        return n, c, 0, []
    per_run = max(1, math.ceil(args.work / c.interval))
    counts = count_losses(c.hosts, [lay.spec for lay in c.layouts], c.node_mtbf, c.interval, args.runs * per_run,
                          seed=seed)
    return n, c, per_run, counts


def _format_losses(losses: list[tuple[int, layouts.Comparison, int, list[LossCount]]], runs: int) -> str:
    """The layouts' lost steps at each size: the formula next to the Monte-Carlo."""
    table = [("accelerators", "hosts", "interval", "layout", "P(step lost)", "simulated [95% CI]", "lost/run",
              "simulated")]
    for n, c, per_run, counts in losses:
        if not counts:
            table.append((str(n), str(c.hosts), "-", "-", "-", f"needs a save interval: {c.interval_from}", "-", "-"))
            continue
        for i, (lay, k) in enumerate(zip(c.layouts, counts)):
            lo, hi = k.ci95
            loss = lay.loss or 0.0
            table.append((str(n) if i == 0 else "", str(c.hosts) if i == 0 else "",
                          duration(c.interval or 0.0) if i == 0 else "", lay.name, layouts.probability(lay.loss),
                          f"{k.lost:,} in {k.intervals:,} [{layouts.probability(lo)}, {layouts.probability(hi)}]",
                          f"{loss * per_run:.2g}", f"{k.lost / runs:.2g}"))
    widths = [max(len(r[col]) for r in table) for col in range(len(table[0]))]
    lines = ["  " + "  ".join(x.ljust(w) for x, w in zip(r, widths)).rstrip() for r in table]
    return "\n".join(
        ["peer tier: steps lost within a save interval (a node and all its replica holders, or more than parity "
         "nodes of one group,", "lose their RAM in it), the formula and a Monte-Carlo of independent node losses "
         "over --runs x --work in save intervals"] + lines
        + ["  P(step lost): the formula, as 'tierfs plan --parity' prints it; simulated: intervals that lost their "
           "step, of those simulated,", "  with a 95% interval (Clopper-Pearson); lost/run: steps lost per run of "
           "--work, P(step lost) x intervals per run, then simulated"])


def _coordination(sizes: list[int]) -> str:
    """What coordinating one save costs at each size, one rank per accelerator
    (:mod:`tierfs.planning.coordination`)."""
    m = coordination.MEASURED
    lines = [f"coordination per save (one rank per accelerator; per rank, the same at any size: {m.collectives} "
             f"all-reduces of a few integers, at most {m.sockets} sockets, {m.object_requests} object-store requests, "
             f"{m.store_requests} TCPStore requests; measured by benchmarks/bench_scale.py)"]
    for n in sizes:
        c = coordination.per_save(n)
        lines.append(f"  {n} accelerators: {c.object_requests:,} object-store requests, at most {c.sockets:,} sockets "
                     "held in the job; no rank lists or deletes another rank's objects")
    return "\n".join(lines)


def _requests_dict(o: requests.ObjectSave) -> dict[str, Any]:
    return {"by_type": o.by_type, "files_per_rank": o.files, "prefixes": o.prefixes, "busiest_prefix": o.busiest,
            "s3_seconds": o.seconds(requests.S3_WRITES), "gcs_seconds": o.seconds(requests.GCS_WRITES)}


def _object_requests(saves: list[tuple[int, float]]) -> str:
    """Each size's object-tier save as the store sees it: requests by type, the key prefixes they go under,
    and how long the busiest takes to accept them at S3's and GCS's documented rates
    (:mod:`tierfs.planning.store_requests`)."""
    lines = ["object store requests per save (one rank per accelerator, shard files of 16 MiB; each rank's keys "
             "under its bucket of prefixes, 256 in all, the markers under the step's; measured by "
             "benchmarks/bench_requests.py)"]
    for n, once in saves:
        o = requests.object_save(once / n, n)
        kinds = ", ".join(f"{k} {v:,.0f}" for k, v in o.by_type.items() if v)
        lines.append(f"  {n} accelerators, {size(o.shard)} per rank in {o.files:,} files: {o.requests:,.0f} requests "
                     f"({kinds}) under {o.prefixes:,} prefixes; the busiest ({o.busiest:,.0f}) takes "
                     f"{duration(o.seconds(requests.S3_WRITES))} at S3's {requests.S3_WRITES:,.0f} writes/s, "
                     f"{duration(o.seconds(requests.GCS_WRITES))} at GCS's {requests.GCS_WRITES:,.0f}")
    return "\n".join(lines)


def add_simulate_args(p: argparse.ArgumentParser) -> None:
    """``simulate``'s own arguments (it takes :func:`add_model_args`'s too)."""
    g = p.add_argument_group("simulation")
    g.add_argument("--sizes", type=_sizes, metavar="N,N,...",
                   help="cluster sizes in accelerators, e.g. 1k,3k,10k,30k,100k, instead of --hosts/--accelerators "
                        "(hosts = size / --accelerators-per-host); needs --accelerator-mttf. Default: the one "
                        "cluster given")
    g.add_argument("--work", type=parse_duration, default=30 * 86400.0, metavar="DUR",
                   help="training time the job needs (default 30d)")
    g.add_argument("--runs", type=int_at_least(2), default=200, metavar="N",
                   help="runs per strategy, at least 2 (default 200)")
    g.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    g.add_argument("--plot", metavar="FILE.png", help="write goodput vs cluster size (needs matplotlib)")
    g.add_argument("--json", action="store_true", help="print JSON instead of a table")


def add_commands(sub: Any) -> None:
    """Register ``simulate`` with the ``tierfs`` parser's subparsers."""
    p = sub.add_parser("simulate", help="Monte-Carlo of a training run under failures", description=(
        "Simulate many runs of a job under exponential failures (node losses and process restarts, "
        "recovery from RAM, peer or object tier) with the intervals 'tierfs plan' chooses, for one cluster "
        "(--hosts/--accelerators) or several sizes (--sizes with --accelerator-mttf). Needs a failure rate "
        "(--mttf or --accelerator-mttf) and at least the object store's bandwidth. Prints goodput, job time, "
        "work lost and time recovering with 95% confidence intervals, next to the plan's goodput; with --parity, "
        "the steps each peer-tier layout loses to node losses, formula and simulated."))
    add_model_args(p)
    add_simulate_args(p)
    p.set_defaults(func=cmd_simulate)
