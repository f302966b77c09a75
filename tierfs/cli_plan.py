"""``tierfs plan``, ``tierfs simulate`` and ``tierfs bench``: the arguments and what they print.

Sizes, rates and durations take units: ``70B`` parameters (K, M, B or G, T), ``840GB`` or ``5TB`` (SI;
KiB, MiB, GiB, TiB too), ``5GB/s`` or ``500MB/s`` (a bare number is GB/s), ``124min``, ``90s``, ``2h``,
``5.7y`` (a bare number is seconds).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from typing import Any

from . import plan as pl

_SI = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "p": 1e15}
_BIN = {"ki": 2.0**10, "mi": 2.0**20, "gi": 2.0**30, "ti": 2.0**40, "pi": 2.0**50}
_COUNT = {"": 1.0, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}
_TIME = {"": 1.0, "s": 1.0, "sec": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "hr": 3600.0, "d": 86400.0,
         "day": 86400.0, "days": 86400.0, "w": 604800.0, "y": 365 * 86400.0, "yr": 365 * 86400.0}
_NUM = r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*"


def _parse(text: str, units: dict[str, float], what: str, example: str, suffix: str = "") -> float:
    m = re.fullmatch(_NUM + r"([A-Za-z]*)" + suffix + r"\s*", str(text))
    unit = m.group(2).lower() if m else None
    if m is None or unit not in units:
        raise argparse.ArgumentTypeError(f"{what} {text!r}: expected e.g. {example}")
    v = float(m.group(1)) * units[unit]
    if not v > 0:
        raise argparse.ArgumentTypeError(f"{what} {text!r} must be positive")
    return v


def parse_count(text: str) -> float:
    """``70B`` -> 7e10 (K, M, B/G, T); a bare number as is."""
    return _parse(text, _COUNT, "count", "70B or 7e10")


def parse_bytes(text: str) -> float:
    """``5TB`` -> 5e12, ``2GiB`` -> 2147483648; a bare number is bytes."""
    m = re.fullmatch(_NUM + r"([A-Za-z]*)\s*", str(text))
    if m:
        unit = m.group(2).lower()
        unit = unit[:-1] if unit.endswith("b") else unit
        mult = _BIN.get(unit) if unit.endswith("i") else _SI.get(unit)
        if mult is not None and float(m.group(1)) > 0:
            return float(m.group(1)) * mult
    raise argparse.ArgumentTypeError(f"size {text!r}: expected a positive size, e.g. 840GB, 5TB or 2GiB")


def parse_rate(text: str) -> float:
    """``5GB/s`` -> 5e9 bytes/s; a bare number is GB/s."""
    m = re.fullmatch(_NUM + r"([A-Za-z]*)(/s)?\s*", str(text))
    if m and not m.group(2):
        return _parse(m.group(1), {"": 1e9}, "rate", "5GB/s")
    if m:
        return parse_bytes(m.group(1) + m.group(2))
    raise argparse.ArgumentTypeError(f"rate {text!r}: expected e.g. 5GB/s or 500MB/s")


def parse_duration(text: str) -> float:
    """``124min`` -> 7440 s (s, min, h, d, w, y); a bare number is seconds."""
    return _parse(text, _TIME, "duration", "124min, 90s, 2h or 5.7y")


def parse_fraction(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.0 <= v <= 1.0:
        raise argparse.ArgumentTypeError(f"{text!r} must be a fraction between 0 and 1")
    return v


def _int_at_least(low: int):
    """An argparse type: a whole number no smaller than ``low``."""

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if v < low:
            raise argparse.ArgumentTypeError(f"{text!r} must be at least {low}")
        return v

    return parse


_positive_int, _nonneg_int = _int_at_least(1), _int_at_least(0)


def _count_int(text: str) -> int:
    return int(round(parse_count(text)))


# -- shared arguments -------------------------------------------------------------------------------

def add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model and cluster")
    size = g.add_mutually_exclusive_group(required=True)
    size.add_argument("--params", type=parse_count, metavar="N", help="model parameters, e.g. 70B")
    size.add_argument("--checkpoint-size", type=parse_bytes, metavar="BYTES",
                      help="bytes of one whole checkpoint, e.g. 5TB (instead of --params)")
    g.add_argument("--bytes-per-param", type=float, default=pl.BYTES_PER_PARAM, metavar="B",
                   help="checkpoint bytes per parameter (default 12: fp32 weights + Adam's two moments)")
    g.add_argument("--hosts", type=_positive_int, metavar="N", help="hosts (nodes) in the job")
    g.add_argument("--accelerators", type=_count_int, metavar="N",
                   help="accelerators in the job (default: hosts x --accelerators-per-host)")
    g.add_argument("--accelerators-per-host", type=_positive_int, default=8, metavar="N",
                   help="accelerators per host (default 8); with only --accelerators, hosts = N / this")
    f = g.add_mutually_exclusive_group()
    f.add_argument("--mttf", type=parse_duration, metavar="DUR", help="the cluster's MTTF, e.g. 124min")
    f.add_argument("--accelerator-mttf", type=parse_duration, metavar="DUR",
                   help="one accelerator's MTTF, e.g. 5.66y; the cluster's is this / accelerators")
    g.add_argument("--node-loss", type=parse_fraction, default=0.5, metavar="F",
                   help="fraction of failures that lose the node's RAM; the rest restart the process "
                        "(default 0.5, an assumption: take it from your cluster's logs)")
    g.add_argument("--replica-loss", type=parse_fraction, default=0.0, metavar="F",
                   help="fraction of node losses that also lose every peer holding the replicas (default 0)")
    g.add_argument("--step-time", type=parse_duration, metavar="DUR",
                   help="seconds per training step; intervals are rounded to whole steps")
    g.add_argument("--restart", type=parse_duration, default=60.0, metavar="DUR",
                   help="time to restart the job after a failure, before reading a checkpoint (default 60s)")
    g.add_argument("--replace", type=parse_duration, default=0.0, metavar="DUR",
                   help="extra time to bring in a replacement node after a node loss (default 0)")

    b = p.add_argument_group("bandwidths (per host; from --bench, or given)")
    b.add_argument("--bench", metavar="FILE", help="a JSON file written by 'tierfs bench'")
    b.add_argument("--ram-bw", type=parse_rate, metavar="RATE", help="RAM-tier save, e.g. 5GB/s")
    b.add_argument("--ram-restore-bw", type=parse_rate, metavar="RATE", help="RAM-tier restore")
    b.add_argument("--peer-bw", type=parse_rate, metavar="RATE", help="transfer to or from a peer host")
    b.add_argument("--object-bw", type=parse_rate, metavar="RATE", help="object-store upload per host")
    b.add_argument("--object-read-bw", type=parse_rate, metavar="RATE",
                   help="object-store download per host (default: as upload)")
    b.add_argument("--object-total-bw", type=parse_rate, metavar="RATE",
                   help="the object store's limit for the whole job (default: hosts x per host)")

    r = p.add_argument_group("RAM tier and intervals")
    r.add_argument("--keep", type=_positive_int, default=2, metavar="N",
                   help="own steps the RAM tier keeps (default 2, tierfs's LatestN(2))")
    r.add_argument("--in-flight", type=_nonneg_int, default=1, metavar="N",
                   help="steps being written while the kept ones stay (default 1)")
    r.add_argument("--replicas", type=_nonneg_int, default=1, metavar="N",
                   help="peer copies of each host's shard (default 1; 0: no peer tier)")
    r.add_argument("--replica-keep", type=_positive_int, default=1, metavar="N",
                   help="steps of each replica a host keeps (default 1)")
    r.add_argument("--headroom", type=float, default=0.15, metavar="F",
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
    """:class:`tierfs.plan.PlanInputs` from parsed arguments (ValueError with one line when inconsistent)."""
    from . import bench

    ckpt = args.checkpoint_size if args.checkpoint_size else pl.checkpoint_bytes(args.params, args.bytes_per_param)
    per_host = args.accelerators_per_host
    if args.hosts is None and args.accelerators is None:
        raise ValueError("give --hosts or --accelerators (or both)")
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
        **bw)


def intervals_from_config(path: str, step_time: float | None) -> dict[str, float]:
    """``{"ram"|"object": seconds}`` from the ``save`` specs of a tiers config's memory and object tiers.

    ``{"every_n_steps": N}`` is N x ``step_time``; ``{"every_n_seconds": S}`` is S. A tier without a
    ``save`` spec is left to the planner; any other spec is an error (the planner models fixed intervals).
    """
    from .errors import FormatError
    from .format import read_json
    from .policies import ContinuousCheckpointingPolicy, FixedIntervalPolicy
    from .policies.spec import save_policy

    cfg = read_json(path, f"config {path}", missing=f"config file {path} does not exist")
    out: dict[str, float] = {}
    for i, spec in enumerate(cfg.get("tiers", []) if isinstance(cfg, dict) else []):
        if not isinstance(spec, dict) or spec.get("save") is None:
            continue
        name = {"memory": "ram", "object": "object"}.get(spec.get("kind"))  # type: ignore[arg-type]
        if name is None:
            continue
        try:
            policy = save_policy(spec["save"])
        except ValueError as e:
            raise FormatError(f"config {path}: tiers[{i}]: {e}") from None
        if isinstance(policy, FixedIntervalPolicy):
            if step_time is None:
                raise ValueError(f"config {path}: tiers[{i}] saves every {policy.interval} steps; give --step-time")
            seconds = policy.interval * step_time
        elif isinstance(policy, ContinuousCheckpointingPolicy) and policy.minimum_interval_secs > 0:
            seconds = policy.minimum_interval_secs
        else:
            raise ValueError(f"config {path}: tiers[{i}]: the planner models every_n_steps or every_n_seconds, "
                             f"not {spec['save']}")
        if name in out:
            raise ValueError(f"config {path}: more than one {spec.get('kind')} tier; the planner models one of each")
        out[name] = seconds
    return out


# -- plan -------------------------------------------------------------------------------------------

def cmd_plan(args: argparse.Namespace) -> int:
    plan = pl.make_plan(inputs_from_args(args))
    if args.json:
        print(json.dumps(pl.plan_to_dict(plan), indent=2))
    else:
        print(pl.format_plan(plan))
    return 0


# -- simulate ---------------------------------------------------------------------------------------

def _sizes(text: str) -> list[int]:
    try:
        out = [int(round(parse_count(x))) for x in text.split(",") if x.strip()]
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"--sizes: {e}") from None
    if not out:
        raise argparse.ArgumentTypeError("--sizes needs at least one cluster size, e.g. 1k,10k,100k")
    return out


def cmd_simulate(args: argparse.Namespace) -> int:
    from . import simulate as sim

    base = inputs_from_args(args)
    if args.sizes and args.accelerator_mttf is None:
        raise ValueError("--sizes needs --accelerator-mttf (the cluster's MTTF falls with its size)")
    sizes = args.sizes or [base.accelerators]
    rows: list[tuple[int, sim.SimResult, float]] = []
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
    if args.json:
        print(json.dumps([{"accelerators": n, "plan_goodput": g, **r.as_dict()} for n, r, g in rows], indent=2))
    else:
        print(f"{args.runs} runs of {args.work / 86400:g} days of training per strategy and size, seed {args.seed}; "
              "95% confidence intervals")
        print(sim.format_results(rows))
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

def cmd_bench(args: argparse.Namespace, storage_options: dict[str, Any]) -> int:
    import os

    from . import bench

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
    lines = [f"RAM tier: save {r['save_gbps']:.2f} GB/s (training waits), commit {r['commit_gbps']:.2f} GB/s, "
             f"restore {r['restore_gbps']:.2f} GB/s"]
    if data["object"]:
        o = data["object"]
        lines.append(f"object tier {o['url']}: upload {o['write_gbps']:.3f} GB/s, download {o['read_gbps']:.3f} GB/s")
    if data["peer"]:
        lines.append(f"peers ({data['peer']['world_size']} processes, gloo): {data['peer']['gbps']:.2f} GB/s")
    lines += [f"note: {n}" for n in data["notes"]]
    if args.out:
        lines.append(f"written to {args.out} (use it with: tierfs plan --bench {args.out} ...)")
    else:
        lines.append(text)
    print("\n".join(lines))
    return 0


def add_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size", type=parse_bytes, default=256 * 2**20, metavar="BYTES",
                   help="state size per measurement (default 256MiB; use a few GiB for steadier figures)")
    p.add_argument("--repeats", type=_positive_int, default=3, metavar="N", help="timed repeats (default 3)")
    p.add_argument("--ram-dir", metavar="DIR", help="RAM tier directory (default: a fresh one in /dev/shm, "
                                                    "removed afterwards)")
    p.add_argument("--object", metavar="URL", help="object tier URL to measure, e.g. s3://bucket/run (writes "
                                                   "and removes URL/tierfs-bench-<random>)")
    p.add_argument("--storage-options", metavar="JSON", help="fsspec storage options for --object, as JSON")
    p.add_argument("-o", dest="option", action="append", metavar="KEY=VALUE",
                   help="one storage option for --object (repeatable)")
    p.add_argument("--out", metavar="FILE", help="write the JSON here (default: print it)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (default: shown on a terminal)")


def add_simulate_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("simulation")
    g.add_argument("--sizes", type=_sizes, metavar="N,N,...",
                   help="cluster sizes in accelerators, e.g. 1k,3k,10k,30k,100k (needs --accelerator-mttf); "
                        "default: the one cluster given")
    g.add_argument("--work", type=parse_duration, default=30 * 86400.0, metavar="DUR",
                   help="training time the job needs (default 30d)")
    g.add_argument("--runs", type=_positive_int, default=200, metavar="N", help="runs per strategy (default 200)")
    g.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    g.add_argument("--plot", metavar="FILE.png", help="write goodput vs cluster size (needs matplotlib)")
    g.add_argument("--json", action="store_true", help="print JSON instead of a table")
