"""``tierfs plan``, ``tierfs simulate`` and ``tierfs bench``: their arguments and what they print.

``plan`` and ``simulate`` describe a job with the same arguments (:func:`add_model_args`) and turn them
into :class:`tierfs.planning.PlanInputs` (:func:`inputs_from_args`); sizes, rates and durations take
units (:mod:`tierfs.cli.units`). ``bench`` measures the bandwidths they read (:mod:`tierfs.bench`).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
from typing import Any, Callable

from .. import planning as pl
from .._units import duration, rate, size
from . import UsageError
from .display import add_no_progress
from .targets import storage_options_from_args
from .units import (int_at_least, nonneg_int, parse_bytes, parse_count, parse_count_int, parse_duration,
                    parse_duration_or_zero, parse_fraction, parse_rate, positive_int)

# -- shared arguments -------------------------------------------------------------------------------

def _positive_float(text: str) -> float:
    """An argparse type: a number > 0."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not v > 0 or math.isinf(v):
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive number")
    return v


def _nonneg_float(text: str) -> float:
    """An argparse type: a number >= 0."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not v >= 0 or math.isinf(v):
        raise argparse.ArgumentTypeError(f"{text!r} must be a number >= 0")
    return v


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The job, its failures, the tiers' bandwidths and the RAM tier: ``plan``'s and ``simulate``'s arguments."""
    g = p.add_argument_group("model and cluster")
    size = g.add_mutually_exclusive_group(required=True)
    size.add_argument("--params", type=parse_count, metavar="N", help="model parameters, e.g. 70B")
    size.add_argument("--checkpoint-size", type=parse_bytes, metavar="BYTES",
                      help="bytes of one whole checkpoint, e.g. 5TB (instead of --params)")
    g.add_argument("--bytes-per-param", type=_positive_float, metavar="B",
                   help="checkpoint bytes per parameter, with --params (default 12: fp32 weights + Adam's two "
                        "moments)")
    g.add_argument("--hosts", type=positive_int, metavar="N",
                   help="hosts (nodes) in the job; give --hosts, --accelerators or both")
    g.add_argument("--accelerators", type=parse_count_int, metavar="N",
                   help="accelerators in the job (default: hosts x --accelerators-per-host)")
    g.add_argument("--accelerators-per-host", type=positive_int, default=8, metavar="N",
                   help="accelerators per host (default 8); with only --accelerators, hosts = N / this, "
                        "rounded up")
    f = g.add_mutually_exclusive_group()
    f.add_argument("--mttf", type=parse_duration, metavar="DUR", help="the cluster's MTTF, e.g. 124min")
    f.add_argument("--accelerator-mttf", type=parse_duration, metavar="DUR",
                   help="one accelerator's MTTF, e.g. 5.66y; the cluster's is this / accelerators")
    g.add_argument("--data-parallel", type=positive_int, default=1, metavar="N",
                   help="copies of the model across hosts (DDP replicas, HSDP replica groups; default 1)")
    g.add_argument("--node-loss", type=parse_fraction, default=0.5, metavar="F",
                   help="fraction of failures that lose the node's RAM; the rest restart the process "
                        "(default 0.5, an assumption: take it from your cluster's logs)")
    g.add_argument("--replica-loss", type=parse_fraction, default=0.0, metavar="F",
                   help="fraction of node losses that also lose every peer holding the replicas (default 0)")
    g.add_argument("--step-time", type=parse_duration, metavar="DUR",
                   help="seconds per training step; intervals are rounded to whole steps")
    g.add_argument("--restart", type=parse_duration_or_zero, default=60.0, metavar="DUR",
                   help="time to restart the job after a failure, before reading a checkpoint (default 60s)")
    g.add_argument("--replace", type=parse_duration_or_zero, default=0.0, metavar="DUR",
                   help="extra time to bring in a replacement node after a node loss (default 0)")

    b = p.add_argument_group("bandwidths (per host; from --bench, or given)")
    b.add_argument("--bench", metavar="FILE", help="a JSON file written by 'tierfs bench'")
    b.add_argument("--ram-bw", type=parse_rate, metavar="RATE", help="RAM-tier save, e.g. 5GB/s")
    b.add_argument("--ram-restore-bw", type=parse_rate, metavar="RATE",
                   help="RAM-tier restore (default: as save)")
    b.add_argument("--peer-bw", type=parse_rate, metavar="RATE", help="transfer to or from a peer host")
    b.add_argument("--object-bw", type=parse_rate, metavar="RATE", help="object-store upload per host")
    b.add_argument("--object-read-bw", type=parse_rate, metavar="RATE",
                   help="object-store download per host (default: as upload)")
    b.add_argument("--object-total-bw", type=parse_rate, metavar="RATE",
                   help="the object store's limit for the whole job (default: hosts x per host)")

    r = p.add_argument_group("RAM tier and intervals")
    r.add_argument("--keep", type=positive_int, default=2, metavar="N",
                   help="own steps the RAM tier keeps (default 2, tierfs's LatestN(2))")
    r.add_argument("--in-flight", type=nonneg_int, default=1, metavar="N",
                   help="steps being written while the kept ones stay (default 1)")
    r.add_argument("--replicas", type=nonneg_int, default=1, metavar="N",
                   help="peer copies of each host's shard (default 1; 0: no peer tier)")
    r.add_argument("--replica-keep", type=positive_int, default=1, metavar="N",
                   help="steps of each replica a host keeps (default 1)")
    r.add_argument("--headroom", type=_nonneg_float, default=0.15, metavar="F",
                   help="RAM headroom fraction (default 0.15)")
    r.add_argument("--background-slowdown", type=parse_fraction, default=pl.DEFAULT_BACKGROUND_SLOWDOWN,
                   metavar="F", help="training time lost per second of background copy (default 0.05, "
                                     "measured at tierfs's default throttle)")
    r.add_argument("--ram-interval", type=parse_duration, metavar="DUR", help="fix the RAM tier's interval")
    r.add_argument("--peer-interval", type=parse_duration, metavar="DUR", help="fix the peer tier's interval")
    r.add_argument("--object-interval", type=parse_duration, metavar="DUR",
                   help="fix the object tier's interval")
    r.add_argument("--config", metavar="FILE",
                   help="take the RAM and object tiers' intervals from a tiers config's \"save\" specs "
                        "(every_n_steps needs --step-time); --*-interval options win")
    r.add_argument("--saves-per-mttf", type=float, metavar="N",
                   help="save to the object tier N times per MTTF (interval = MTTF / N)")
    r.add_argument("--max-object-interval", type=parse_duration, default=3600.0, metavar="DUR",
                   help="longest interval between object-tier copies in the RAM strategies (default 1h)")


def inputs_from_args(args: argparse.Namespace) -> pl.PlanInputs:
    """:class:`tierfs.planning.PlanInputs` from parsed arguments (ValueError with one line when inconsistent)."""
    from .. import bench

    if args.checkpoint_size and args.bytes_per_param is not None:
        raise ValueError("--bytes-per-param goes with --params; --checkpoint-size is the whole checkpoint already")
    bpp = pl.BYTES_PER_PARAM if args.bytes_per_param is None else args.bytes_per_param
    ckpt = args.checkpoint_size if args.checkpoint_size else pl.checkpoint_bytes(args.params, bpp)
    per_host = args.accelerators_per_host
    if args.hosts is None and args.accelerators is None:
        raise ValueError("give --hosts or --accelerators (or both)"
                         + (", or --sizes" if getattr(args, "sizes", None) is not None else ""))
    hosts = args.hosts if args.hosts is not None else max(1, math.ceil(args.accelerators / per_host))
    accelerators = args.accelerators if args.accelerators is not None else hosts * per_host
    if accelerators < hosts:
        raise ValueError(f"--accelerators {accelerators} is fewer than --hosts {hosts}")
    mttf = args.mttf
    if args.accelerator_mttf is not None:
        mttf = pl.cluster_mttf(args.accelerator_mttf, accelerators)
    bw: dict[str, float] = bench.bandwidths(bench.load(args.bench)) if args.bench else {}
    given = {"ram_save": args.ram_bw, "ram_restore": args.ram_restore_bw, "peer": args.peer_bw,
             "object_write": args.object_bw, "object_read": args.object_read_bw}
    bw.update({k: v for k, v in given.items() if v is not None})  # the command line wins over the file
    intervals = intervals_from_config(args.config, args.step_time) if args.config else {}
    intervals.update({k: v for k, v in (("ram", args.ram_interval), ("peer", args.peer_interval),
                                        ("object", args.object_interval)) if v is not None})
    return pl.PlanInputs(
        checkpoint=ckpt, hosts=hosts, accelerators=accelerators, mttf=mttf, node_loss=args.node_loss,
        replica_loss=args.replica_loss, step_time=args.step_time, restart=args.restart, replace=args.replace,
        object_total=args.object_total_bw, keep=args.keep, in_flight=args.in_flight, replicas=args.replicas,
        replica_keep=args.replica_keep, headroom=args.headroom, background_slowdown=args.background_slowdown,
        intervals=intervals, saves_per_mttf=args.saves_per_mttf, max_object_interval=args.max_object_interval,
        data_parallel=args.data_parallel, **bw)


def intervals_from_config(path: str, step_time: float | None) -> dict[str, float]:
    """``{"ram"|"object": seconds}`` from the ``save`` specs of a tiers config's memory and object tiers.

    Parameters
    ----------
    path : str
        The tiers config (:mod:`tierfs.config`), checked as every command checks it.
    step_time : float or None
        Seconds per training step, for ``every_n_steps`` specs.

    Returns
    -------
    dict
        ``{"every_n_steps": N}`` is N x ``step_time``; ``{"every_n_seconds": S}`` is S. A tier without a
        ``save`` spec is left to the planner.

    Raises
    ------
    FormatError
        The config is malformed.
    ValueError
        A spec the planner cannot model (it models fixed intervals), ``every_n_steps`` without
        ``step_time``, or two tiers of one kind.
    """
    from ..config import read_config
    from ..policies import ContinuousCheckpointingPolicy, FixedIntervalPolicy

    out: dict[str, float] = {}
    for spec in read_config(path):
        if spec.save is None:
            continue
        name = "ram" if spec.kind == "memory" else "object"
        policy = spec.save
        if isinstance(policy, FixedIntervalPolicy):
            if step_time is None:
                raise ValueError(f"{spec.where} saves every {policy.interval} steps; give --step-time")
            seconds = policy.interval * step_time
        elif isinstance(policy, ContinuousCheckpointingPolicy) and policy.minimum_interval_secs > 0:
            seconds = policy.minimum_interval_secs
        else:
            raise ValueError(f"{spec.where}: the planner models every_n_steps or every_n_seconds, "
                             f"not {spec.save_spec}")
        if name in out:
            raise ValueError(f"config {path}: more than one {spec.kind} tier; the planner models one of each")
        out[name] = seconds
    return out


# -- plan -------------------------------------------------------------------------------------------

def _usage_errors(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """``fn`` with a ValueError (inconsistent arguments) turned into a UsageError (exit status 2)."""

    @functools.wraps(fn)
    def run(args: argparse.Namespace) -> int:
        try:
            return fn(args)
        except ValueError as e:
            raise UsageError(str(e)) from None

    return run


@_usage_errors
def cmd_plan(args: argparse.Namespace) -> int:
    """``tierfs plan``: the plan as tables, or JSON with ``--json``."""
    plan = pl.make_plan(inputs_from_args(args))
    if args.json:
        print(json.dumps(pl.plan_to_dict(plan), indent=2))
    else:
        print(pl.format_plan(plan))
    return 0


# -- simulate ---------------------------------------------------------------------------------------

def _sizes(text: str) -> list[int]:
    """``--sizes 1k,10k``: cluster sizes in accelerators."""
    try:
        out = [int(round(parse_count(x))) for x in text.split(",") if x.strip()]
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"--sizes: {e}") from None
    if not out:
        raise argparse.ArgumentTypeError("--sizes needs at least one cluster size, e.g. 1k,10k,100k")
    return out


@_usage_errors
def cmd_simulate(args: argparse.Namespace) -> int:
    """``tierfs simulate``: goodput, job time, work lost per strategy and cluster size, with 95% intervals."""
    from .. import simulate as sim

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
    if args.json:
        store_of = {n: {"object_bytes_per_save": once, "object_write_per_s": write}
                    for n, _, once, _, write in stores}
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


# -- bench ------------------------------------------------------------------------------------------

def cmd_bench(args: argparse.Namespace) -> int:
    """``tierfs bench``: measure the tiers here; print the figures and write the JSON plan/simulate read."""
    from .. import _args, bench

    storage_options = storage_options_from_args(args)
    if args.object is not None:
        _args.object_url(args.object, "--object")  # a typo is an error, not a benchmark of a local directory

    bar = None
    if not args.no_progress and sys.stderr.isatty():
        try:
            from tqdm import tqdm

            bar = tqdm(total=bench.steps_for(args.repeats, args.object), desc="bench", unit="op", leave=False,
                       file=sys.stderr)
        except ImportError:
            bar = None

    def tick(label: str) -> None:
        if bar is not None:
            bar.set_description(label)
            bar.update(1)

    try:
        data = bench.run(size=int(args.size), repeats=args.repeats, ram_dir=args.ram_dir, object_url=args.object,
                         storage_options=storage_options, tick=tick)
    finally:
        if bar is not None:
            bar.close()
    if int(os.environ.get("RANK", "0")) != 0:
        return 0  # under torchrun, rank 0 reports
    text = json.dumps(data, indent=2)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    r = data["ram"]

    def gbps(x: float) -> str:
        return rate(x * 1e9)

    lines = [f"measured with {size(data['size_bytes'])} per process, median of {data['repeats']} repeats",
             f"RAM tier: save {gbps(r['save_gbps'])} (training waits), commit {gbps(r['commit_gbps'])}, "
             f"restore {gbps(r['restore_gbps'])}"]
    if data["object"]:
        o = data["object"]
        lines.append(f"object tier {o['url']}: upload {gbps(o['write_gbps'])}, download {gbps(o['read_gbps'])}")
    if data["peer"]:
        lines.append(f"peers ({data['peer']['world_size']} processes, {data['peer']['method']}): "
                     f"{gbps(data['peer']['gbps'])}")
    lines += [f"note: {n}" for n in data["notes"]]
    if args.out:
        lines.append(f"written to {args.out} (use it with: tierfs plan --bench {args.out} ...)")
    else:
        lines.append(text)
    print("\n".join(lines))
    return 0


def add_bench_args(p: argparse.ArgumentParser) -> None:
    """``bench``'s arguments."""
    p.add_argument("--size", type=parse_bytes, default=256 * 2**20, metavar="BYTES",
                   help="state size per measurement (default 256MiB; use a few GiB for steadier figures)")
    p.add_argument("--repeats", type=positive_int, default=3, metavar="N", help="timed repeats (default 3)")
    p.add_argument("--ram-dir", metavar="DIR", help="RAM tier directory (default: a fresh one in /dev/shm, "
                                                    "removed afterwards)")
    p.add_argument("--object", metavar="URL", help="object tier URL to measure, e.g. s3://bucket/run (writes "
                                                   "and removes URL/tierfs-bench-<random>)")
    p.add_argument("--storage-options", metavar="JSON", help="fsspec storage options for --object, as JSON")
    p.add_argument("-o", dest="option", action="append", metavar="KEY=VALUE",
                   help="one storage option for --object (repeatable)")
    p.add_argument("--out", metavar="FILE", help="write the JSON here (default: print it)")
    add_no_progress(p)


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


# -- the subcommands --------------------------------------------------------------------------------

def add_commands(sub: Any) -> None:
    """Register ``plan``, ``simulate`` and ``bench`` with the ``tierfs`` parser's subparsers."""
    p = sub.add_parser("plan", help="RAM per host, save intervals, goodput and bandwidth for a job",
                       description=(
        "Plan a job's checkpointing from its model, cluster, failure rate and the tiers' bandwidths "
        "(measured with 'tierfs bench' or given): RAM per host for the RAM tier (own steps, steps in flight, "
        "replicas held for others), each tier's save interval (Young/Daly, then the goodput maximum), the "
        "expected goodput of object storage alone, RAM + object and RAM + peers + object, and the write "
        "bandwidth each tier needs. Sizes take units: 70B params, 5TB, 5GB/s, 124min."))
    add_model_args(p)
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("simulate", help="Monte-Carlo of a training run under failures", description=(
        "Simulate many runs of a job under exponential failures (node losses and process restarts, "
        "recovery from RAM, peer or object tier) with the intervals 'tierfs plan' chooses, for one cluster "
        "(--hosts/--accelerators) or several sizes (--sizes with --accelerator-mttf). Needs a failure rate "
        "(--mttf or --accelerator-mttf) and at least the object store's bandwidth. Prints goodput, job time, "
        "work lost and time recovering with 95% confidence intervals, next to the plan's goodput."))
    add_model_args(p)
    add_simulate_args(p)
    p.set_defaults(func=cmd_simulate)

    p = sub.add_parser("bench", help="measure the tiers on this machine for plan/simulate", description=(
        "Measure RAM-tier save and restore through a TieredStore, object-tier upload and download for "
        "--object URL, and (under torchrun) peer transfer over gloo send/recv. Writes a JSON file that "
        "'tierfs plan --bench FILE' and 'tierfs simulate --bench FILE' read."))
    add_bench_args(p)
    p.set_defaults(func=cmd_bench)
