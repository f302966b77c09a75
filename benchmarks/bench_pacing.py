"""What pacing a peer transfer costs in CPU: the throttle's bursts against pacing every message.

    .venv/bin/python benchmarks/bench_pacing.py [--size-mib 512] [--repeats 7] [--bursts-mib 0,64]

Two processes (gloo on 127.0.0.1) exchange ``--size-mib`` each way the way the peer tier does
(``TorchGroup.exchange`` of the peer tier's messages over its two connections, from a background thread
at the store's priority, a thread checking nothing as messages land), unloaded:

- unpaced (``background_bandwidth=None``);
- paced at the default 256 MB/s by ``Throttle(rate, burst)`` for each ``--bursts-mib``: 0 waits before
  every message (tierfs's earlier pacing), 64 is the default (bursts of 64 MiB, then a wait until back
  on the rate).

For each: wall time and the process's CPU (every thread, ended ones included, ``getrusage``) per rank and
transfer; the variants take turns in every repeat; medians over ranks and repeats. The CPU includes the
idle polling of the process's four gloo groups (about 1.5 ms per second each), so a paced transfer, 2 s
where an unpaced one takes 0.2-0.3, carries about 0.01 s of it. Every received byte
is compared with what the other rank sent. Results go to stdout (markdown), progress to stderr.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import MiB, launch_ranks, log, machine_note  # noqa: E402

RATE = 256e6  # the store's default background_bandwidth


def process_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def worker(args: argparse.Namespace) -> None:
    import numpy as np
    import torch.distributed as dist

    from tierfs.util.worker import BACKGROUND_NICE, Throttle
    from tierfs.ranks import TorchGroup
    from tierfs.tiers.peer import Wire

    CHUNK = Wire().chunk  # the peer tier's message size

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    peer = 1 - rank
    say = log if rank == 0 else (lambda *a: None)  # noqa: E731
    group = TorchGroup().fork("gloo", nice=BACKGROUND_NICE, lanes=2)  # as PeerTier's copy groups
    n = args.size_mib * MiB
    out = np.random.default_rng(rank).integers(0, 256, n, dtype=np.uint8)
    expect = np.random.default_rng(peer).integers(0, 256, n, dtype=np.uint8)
    into = np.ones(n, dtype=np.uint8)  # faulted in before any timing
    variants = {"unpaced": None, **{f"paced, bursts of {b} MiB" if b else "paced per message (burst 0)": b
                                    for b in args.bursts_mib}}
    results: dict[str, list[tuple[float, float]]] = {k: [] for k in variants}

    def one(burst_mib: int | None) -> tuple[float, float]:
        pace = None if burst_mib is None else Throttle(RATE, burst_mib * MiB).consume
        into[:] = 0
        dist.barrier()
        took: list[float] = []

        def run() -> None:  # the store's worker thread: background priority
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)
            t0 = time.perf_counter()
            group.exchange([(peer, out[i:i + CHUNK]) for i in range(0, n, CHUNK)],
                           [(peer, into[i:i + CHUNK]) for i in range(0, n, CHUNK)],
                           pace=pace, on_received=lambda i: None)
            took.append(time.perf_counter() - t0)

        cpu0 = process_cpu()
        th = threading.Thread(target=run)
        th.start()
        th.join()
        cpu = process_cpu() - cpu0
        if not np.array_equal(into, expect):
            raise SystemExit(f"rank {rank}: received bytes differ from what rank {peer} sent")
        return took[0], cpu

    one(None)  # warm-up: connections made
    names = list(variants)
    for r in range(args.repeats):
        for k in names[r % len(names):] + names[:r % len(names)]:
            results[k].append(one(variants[k]))
        say(f"repeat {r + 1}/{args.repeats} done")
    gathered: list = [None, None]
    dist.all_gather_object(gathered, results)
    if rank == 0:
        report(args, gathered)
    dist.destroy_process_group()


def report(args: argparse.Namespace, gathered: list) -> None:
    every = {k: [x for g in gathered for x in g[k]] for k in gathered[0]}
    base = statistics.median(c for _, c in every["unpaced"])
    print(f"## Pacing a peer transfer: 2 ranks x {args.size_mib} MiB each way, unloaded\n")
    print(f"- machine: {machine_note()}")
    print(f"- command: `.venv/bin/python benchmarks/bench_pacing.py --size-mib {args.size_mib} --repeats "
          f"{args.repeats} --bursts-mib {','.join(map(str, args.bursts_mib))}`\n")
    print("| variant | median s | CPU per rank and transfer, median s (min-max) | CPU above unpaced |")
    print("|---|---|---|---|")
    for k, rows in every.items():
        cpu = [c for _, c in rows]
        print(f"| {k} | {statistics.median(t for t, _ in rows):.2f} | {statistics.median(cpu):.3f} "
              f"({min(cpu):.3f}-{max(cpu):.3f}) | {statistics.median(cpu) - base:+.3f} |")
    print(f"\n- paced at {RATE / 1e6:.0f} MB/s (the default `background_bandwidth`); medians over 2 ranks x "
          f"{args.repeats} repeats; every received byte checked")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mib", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--bursts-mib", type=lambda s: [int(x) for x in s.split(",")], default=[0, 64])
    ap.add_argument("--worker", action="store_true")
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return 0
    return launch_ranks(__file__, sys.argv[1:], 2)


if __name__ == "__main__":
    raise SystemExit(main())
