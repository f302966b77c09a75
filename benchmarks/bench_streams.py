"""The transport of a replica's bytes: gloo against tierfs's streams against a plain socket copy.

Two ranks (each its own node) swap a shard of ``--mib`` MiB each way, from a file mapped on /dev/shm into
another mapped file (as a replica moves from one RAM tier into another), in 8 MiB messages:

- **gloo**: ``TorchGroup.exchange`` over two gloo groups (``TIERFS_STREAMS=0``; the peer tier's default of
  two connections);
- **streams**: the same call over the group's streams (``tierfs.ranks.streams``: ``sendall`` and
  ``recv_into`` on connections of tierfs's own);
- **socket floor**: a plain ``sendall`` to the peer and ``recv_into`` on a thread, no tierfs.

Reported per variant, medians over ``--rounds`` rounds of each rank: the CPU seconds the process spends
per round (every thread), the wall time, and both against the floor. The receiver checks nothing here: this
is the transport alone (a replica's receiver also checks every block's crc32c, the same in either case).

Then the small rounds a save also makes, ``--small`` times each: a 1-byte exchange (a transfer's yes/no)
over gloo and over the streams, and an all-reduce of three integers (a vote, which stays on gloo); the CPU
microseconds the process spends per round and the wall time, medians of both ranks.

    .venv/bin/python benchmarks/bench_streams.py [--mib 30] [--rounds 20] [--small 500] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import resource
import socket
import statistics
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(__file__))
from _common import MiB, launch_ranks, log, machine_note, results_path  # noqa: E402

VARIANTS = ("gloo", "streams", "socket floor")
SMALL = ("1-byte exchange, gloo", "1-byte exchange, streams", "all-reduce of 3 integers, gloo")
CHUNK = 8 << 20


def mapped(path: str, size: int):
    import numpy as np

    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.ftruncate(fd, size)
        mm = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    a = np.frombuffer(mm, dtype=np.uint8)
    a[:] = 0  # its pages exist, as a RAM tier's reused buffers' do
    return a


def cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def worker(args: argparse.Namespace) -> None:
    import numpy as np
    import torch.distributed as dist

    from tierfs.ranks import TorchGroup

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    peer = 1 - rank
    size = args.mib * MiB
    scratch = tempfile.mkdtemp(prefix="bench-streams-", dir="/dev/shm")
    try:
        src, dst = mapped(f"{scratch}/src", size), mapped(f"{scratch}/dst", size)
        src[:] = np.random.default_rng(rank).integers(0, 255, size, dtype=np.uint8)
        os.environ["TIERFS_STREAMS"] = "0"
        base = TorchGroup()
        over_gloo = base.fork(lanes=2)
        os.environ["TIERFS_STREAMS"] = "1"
        over_streams = base.fork()
        pieces = [(a, min(size, a + CHUNK)) for a in range(0, size, CHUNK)]

        def exchange(g) -> None:
            g.exchange([(peer, src[a:b]) for a, b in pieces], [(peer, dst[a:b]) for a, b in pieces],
                       on_received=lambda i: None)

        ports: list = [None, None]
        srv = socket.create_server(("127.0.0.1", 0))
        dist.all_gather_object(ports, srv.getsockname()[1])
        accepted: dict = {}
        t = threading.Thread(target=lambda: accepted.update(c=srv.accept()[0]))
        t.start()
        out = socket.create_connection(("127.0.0.1", ports[peer]))
        t.join()
        inn = accepted["c"]

        def plain() -> None:
            def receive() -> None:
                view, got = memoryview(dst), 0
                while got < size:
                    got += inn.recv_into(view[got:], min(size - got, CHUNK))
            r = threading.Thread(target=receive)
            r.start()
            out.sendall(memoryview(src))
            r.join()

        runs = {"gloo": lambda: exchange(over_gloo), "streams": lambda: exchange(over_streams),
                "socket floor": plain}
        want = np.random.default_rng(peer).integers(0, 255, size, dtype=np.uint8)
        result: dict = {v: {"cpu": [], "wall": []} for v in VARIANTS}
        for rnd in range(args.rounds):
            for v in VARIANTS[rnd % 3:] + VARIANTS[:rnd % 3]:  # each variant first in turn
                dst[:] = 0
                dist.barrier()
                c0, w0 = cpu(), time.perf_counter()
                runs[v]()
                result[v]["cpu"].append(cpu() - c0)
                result[v]["wall"].append(time.perf_counter() - w0)
                if not np.array_equal(dst, want):
                    raise SystemExit(f"{v}: the bytes received differ from those sent")
        one_out, one_in = np.ones(1, np.uint8), np.zeros(1, np.uint8)
        smalls = {"1-byte exchange, gloo": lambda: over_gloo.exchange([(peer, one_out)], [(peer, one_in)]),
                  "1-byte exchange, streams": lambda: over_streams.exchange([(peer, one_out)], [(peer, one_in)],
                                                                             bulk=True),
                  "all-reduce of 3 integers, gloo": lambda: base.all_reduce([rank, 1, 2])}
        for v, run in smalls.items():
            run()  # connections made
            dist.barrier()
            c0, w0 = cpu(), time.perf_counter()
            for _ in range(args.small):
                run()
            result[v] = {"cpu": (cpu() - c0) / args.small, "wall": (time.perf_counter() - w0) / args.small}
        gathered: list = [None, None]
        dist.all_gather_object(gathered, result)
        if rank == 0:
            with open(args.json, "w") as f:
                json.dump(gathered, f)
        out.close()
        inn.close()
        srv.close()
    finally:
        import shutil

        shutil.rmtree(scratch, ignore_errors=True)
    dist.destroy_process_group()


def report(ranks: list[dict], args: argparse.Namespace) -> str:
    med = {v: {k: statistics.median(x for r in ranks for x in r[v][k][1:]) for k in ("cpu", "wall")}
           for v in VARIANTS}  # the first round of each variant left out: connections made then
    floor = med["socket floor"]
    lines = [f"## bench_streams: {args.mib} MiB each way between 2 ranks, mapped files on /dev/shm, "
             f"{args.rounds} rounds\n",
             "| variant | CPU s per round (process) | x the floor | wall s | x the floor |", "|---|---|---|---|---|"]
    for v in VARIANTS:
        lines.append(f"| {v} | {med[v]['cpu']:.4f} | {med[v]['cpu'] / floor['cpu']:.2f}x | {med[v]['wall']:.4f} | "
                     f"{med[v]['wall'] / floor['wall']:.2f}x |")
    lines.append("")
    lines.append(f"- streams against gloo: CPU {med['streams']['cpu'] / med['gloo']['cpu']:.2f}x, wall "
                 f"{med['streams']['wall'] / med['gloo']['wall']:.2f}x (medians over both ranks' rounds)")
    lines += ["", f"### Small rounds ({args.small} of each)", "",
              "| round | CPU us per round (process) | wall us |", "|---|---|---|"]
    for v in SMALL:
        lines.append(f"| {v} | {statistics.median(r[v]['cpu'] for r in ranks) * 1e6:.0f} | "
                     f"{statistics.median(r[v]['wall'] for r in ranks) * 1e6:.0f} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=30, help="MiB each rank sends (and receives) per round")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--small", type=int, default=500, help="rounds of each small exchange")
    ap.add_argument("--out", default=None, help="results file (no extension); default benchmarks/results/...")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return 0
    with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
        argv = [a for a in sys.argv[1:] if a != "--worker"]
        code = launch_ranks(__file__, [*argv, "--json", tmp.name], 2)
        if code:
            return code
        with open(tmp.name) as f:
            ranks = json.load(f)
    text = (report(ranks, args) + f"- machine: {machine_note()}\n- command: `.venv/bin/python "
            f"benchmarks/bench_streams.py {' '.join(sys.argv[1:])}`\n")
    print(text)
    out = args.out or results_path("bench_streams")
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out + ".md", "w") as f:
        f.write(text)
    log(f"wrote {out}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
