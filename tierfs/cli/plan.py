"""``tierfs plan``, and the description of a job that ``plan`` and ``simulate`` share.

``plan`` and ``simulate`` (:mod:`tierfs.cli.simulate`) describe a job with the same arguments
(:func:`add_model_args`) and turn them into :class:`tierfs.planning.PlanInputs` (:func:`inputs_from_args`);
sizes, rates and durations take units (:mod:`tierfs.cli.numbers`). ``bench`` (:mod:`tierfs.cli.bench`)
measures the bandwidths they read.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
from typing import Any, Callable

from .. import planning as pl
from . import UsageError
from .numbers import (nonneg_int, parse_bytes, parse_count, parse_count_int, parse_duration, parse_duration_or_zero,
                    parse_fraction, parse_rate, positive_int)

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


def _parities(text: str) -> list[pl.Erasure]:
    """``--parity 4+1,4+2``: erasure codes, DATA+PARITY each."""
    out: list[pl.Erasure] = []
    for item in text.split(","):
        try:
            out.append(pl.parse_erasure(item))
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return out


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
                   help="steps of each replica (or of parity) a host keeps (default 1)")
    r.add_argument("--parity", type=_parities, action="extend", metavar="D+P[,D+P...]",
                   help="compare an erasure-coded peer tier, ErasureCodedTier(data=D, parity=P), e.g. 4+1, with "
                        "replicas=1 and 2: RAM per host, bytes sent per save, probability of losing a step")
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
    from . import measure

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
    bw: dict[str, float] = measure.bandwidths(measure.load(args.bench)) if args.bench else {}
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
        data_parallel=args.data_parallel, erasure=tuple(dict.fromkeys(args.parity or ())), **bw)


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
        if spec.kind not in ("memory", "object"):  # the planner models a RAM tier and an object tier
            continue
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

def usage_errors(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """``fn`` with a ValueError (inconsistent arguments) turned into a UsageError (exit status 2)."""

    @functools.wraps(fn)
    def run(args: argparse.Namespace) -> int:
        try:
            return fn(args)
        except ValueError as e:
            raise UsageError(str(e)) from None

    return run


@usage_errors
def cmd_plan(args: argparse.Namespace) -> int:
    """``tierfs plan``: the plan as tables, or JSON with ``--json``."""
    plan = pl.make_plan(inputs_from_args(args))
    if args.json:
        print(json.dumps(pl.plan_to_dict(plan), indent=2))
    else:
        print(pl.format_plan(plan))
    return 0


def add_commands(sub: Any) -> None:
    """Register ``plan`` with the ``tierfs`` parser's subparsers."""
    p = sub.add_parser("plan", help="RAM per host, save intervals, goodput and bandwidth for a job",
                       description=(
        "Plan a job's checkpointing from its model, cluster, failure rate and the tiers' bandwidths "
        "(measured with 'tierfs bench' or given): RAM per host for the RAM tier (own steps, steps in flight, "
        "replicas held for others), each tier's save interval (Young/Daly, then the goodput maximum), the "
        "expected goodput of object storage alone, RAM + object and RAM + peers + object, and the write "
        "bandwidth each tier needs; with --parity, the peer tier as replicas against erasure coding (RAM, "
        "network, probability of losing a step). Sizes take units: 70B params, 5TB, 5GB/s, 124min."))
    add_model_args(p)
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.set_defaults(func=cmd_plan)
