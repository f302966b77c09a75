"""``tierfs bench``: measure the tiers on this machine (:mod:`tierfs.cli.measure`), print the figures and
write the JSON file ``plan`` and ``simulate`` read (``--bench FILE``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from ..util.readable import rate, size
from .display import add_no_progress
from .targets import storage_options_from_args
from .numbers import parse_bytes, positive_int


def cmd_bench(args: argparse.Namespace) -> int:
    """``tierfs bench``: measure the tiers here; print the figures and write the JSON plan/simulate read."""
    from ..util import args as _args
    from . import measure

    storage_options = storage_options_from_args(args)
    if args.object is not None:
        _args.object_url(args.object, "--object")  # a typo is an error, not a benchmark of a local directory

    bar = None
    if not args.no_progress and sys.stderr.isatty():
        try:
            from tqdm import tqdm

            bar = tqdm(total=measure.steps_for(args.repeats, args.object), desc="bench", unit="op", leave=False,
                       file=sys.stderr)
        except ImportError:
            bar = None

    def tick(label: str) -> None:
        if bar is not None:
            bar.set_description(label)
            bar.update(1)

    try:
        data = measure.run(size=int(args.size), repeats=args.repeats, ram_dir=args.ram_dir, object_url=args.object,
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


def add_commands(sub: Any) -> None:
    """Register ``bench`` with the ``tierfs`` parser's subparsers."""
    p = sub.add_parser("bench", help="measure the tiers on this machine for plan/simulate", description=(
        "Measure RAM-tier save and restore through a TieredStore, object-tier upload and download for "
        "--object URL, and (under torchrun) peer transfer over gloo send/recv. Writes a JSON file that "
        "'tierfs plan --bench FILE' and 'tierfs simulate --bench FILE' read."))
    add_bench_args(p)
    p.set_defaults(func=cmd_bench)
