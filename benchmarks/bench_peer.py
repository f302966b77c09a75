"""Peer replication on loopback: throughput against a plain socket copy, and the cost to training.

    .venv/bin/python benchmarks/bench_peer.py [--size-mib 512] [--repeats 5] [--world 2]

Starts ``--world`` processes (gloo on 127.0.0.1, each its own node with its own RAM directory). Every rank
holds a shard of ``--size-mib``; with ``replicas=1`` on a ring every rank sends its shard to the next
rank and receives the previous one's, so each link carries one shard each way at once. In one run:

- a plain TCP socket copy of the same bytes in the same pattern (one sender and one receiver thread per
  rank, ``sendall`` / ``recv_into`` a preallocated buffer), and raw gloo ``isend``/``irecv`` of tensors;
- tierfs replication, unthrottled: from the RAM commit until every receiver has verified its copy and
  the step counts as replicated (the store's own timing, from its log). The three run in interleaved
  rounds (socket, gloo, tierfs, socket, ...), so each sees the same moment of a shared machine. The CPU
  of each (every thread of the process) is measured too; replication's as a save with peers minus a
  RAM-only save of the same state in the same round;
- a training-like loop (1-thread 512x512 matmuls into preallocated tensors in every rank, so both cores
  are busy; a save every ``--interval`` seconds of work with ``blocking=False``): without checkpoints,
  with RAM-only saves, with RAM-only saves each followed by a plain socket copy of as many bytes (from
  memory, started as ``save`` returns) on background threads (the floor of any replication over TCP: no
  checks, no throttle), and with RAM + peers at the default throttle and unthrottled. The variants take
  turns in ``--rounds`` rounds of ``--saves`` saves each, in an order that rotates by one every round;
  every store is opened and warmed up with three saves first (steady state: RAM buffers and replica
  buffers are mapped and reused, as in a long job).
  The slowdown excludes the time inside ``save`` (the stall, see bench_async.py); "replica lands" is the
  time from ``save`` until that step is replicated.
- a lost node (``benchmarks/_lostnode.py``): ``restore_into`` on a replaced node, its shard from the peer
  keeping its replica, or, for a data-parallel state, from the ranks holding it in RAM, beside a plain gloo
  transfer of as many bytes to it (``--lost-node-only`` runs this phase alone).

Results are medians over ranks and repeats; rank 0 prints the tables (stdout) and progress (stderr).
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(__file__))
from _common import GB, MiB, Result, Scratch, launch_ranks, log, machine_note, table  # noqa: E402

from _lostnode import lost_node, report as report_lost_node  # noqa: E402

from tierfs.util.worker import BACKGROUND_NICE  # noqa: E402


# -- inside each rank -------------------------------------------------------------------------------
class Replicated(logging.Handler):
    """Collects the store's "step N replicated to peers: X MB sent in Ys" records."""

    def __init__(self) -> None:
        super().__init__()
        self.seconds: dict[int, float] = {}
        self.at: dict[int, float] = {}

    def emit(self, record: logging.LogRecord) -> None:
        if record.msg.startswith("step %d replicated to peers"):
            step, _mb, secs = record.args
            self.seconds[step], self.at[step] = secs, time.perf_counter()


def socket_copy(dist, buf_out, buf_in) -> float:
    """Ring over TCP: send ``buf_out`` to the next rank while receiving ``buf_in`` from the previous."""
    rank, world = dist.get_rank(), dist.get_world_size()
    srv = socket.create_server(("127.0.0.1", 0))
    ports = [None] * world
    dist.all_gather_object(ports, srv.getsockname()[1])
    out = socket.create_connection(("127.0.0.1", ports[(rank + 1) % world]))
    conn, _ = srv.accept()
    for s in (out, conn):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    mv_in = memoryview(buf_in)

    def recv() -> None:
        got = 0
        while got < len(mv_in):
            n = conn.recv_into(mv_in[got:], min(len(mv_in) - got, 4 << 20))
            if not n:
                raise ConnectionError("peer closed")
            got += n

    dist.barrier()
    t0 = time.perf_counter()
    th = threading.Thread(target=recv)
    th.start()
    out.sendall(memoryview(buf_out))
    th.join()
    dt = time.perf_counter() - t0
    for s in (out, conn, srv):
        s.close()
    return dt


def gloo_copy(dist, t_out, t_in) -> float:
    rank, world = dist.get_rank(), dist.get_world_size()
    dist.barrier()
    t0 = time.perf_counter()
    r = dist.irecv(t_in, (rank - 1) % world)
    s = dist.isend(t_out, (rank + 1) % world)
    r.wait()
    s.wait()
    return time.perf_counter() - t0


def matmul(n: int) -> float:
    """``n`` 1-thread 512x512 matmuls into preallocated tensors: like a training step, the loop allocates
    nothing, so its own time is compute, not page faults (``a = (a @ b) * 0.001`` spent about 12% of it
    in the kernel, and a varying share: most of the noise between rounds)."""
    import torch

    a, b, c = torch.randn(512, 512), torch.randn(512, 512), torch.empty(512, 512)
    t0 = time.perf_counter()
    for _ in range(n):
        torch.mm(a, b, out=c)
        c.mul_(0.001)
        a, c = c, a
    return time.perf_counter() - t0


def process_cpu() -> float:
    """CPU seconds used so far by every thread of this process."""
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def background_cpu() -> float:
    """CPU seconds used so far by this process, but for the calling thread (Linux): every other thread,
    including those that have ended (the store starts a receiving thread per transfer)."""
    import resource

    me = resource.getrusage(resource.RUSAGE_THREAD)
    return process_cpu() - me.ru_utime - me.ru_stime


class SocketRing:
    """The floor of any TCP replication: after a RAM-only save, a plain socket copy of as many bytes as a
    shard (a buffer in memory) to the next rank and from the previous one, on two background threads at
    the store's CPU priority, unthrottled and unchecked. Connections and buffers are set up once, like the
    store's."""

    def __init__(self, dist, buf_out, buf_in) -> None:
        rank, world = dist.get_rank(), dist.get_world_size()
        srv = socket.create_server(("127.0.0.1", 0))
        ports = [None] * world
        dist.all_gather_object(ports, srv.getsockname()[1])
        self.out = socket.create_connection(("127.0.0.1", ports[(rank + 1) % world]))
        self.conn, _ = srv.accept()
        srv.close()
        self.buf_out, self.buf_in = buf_out, buf_in
        self.threads: list[threading.Thread] = []

    def _send(self) -> None:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)
        self.out.sendall(memoryview(self.buf_out))

    def _recv(self) -> None:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)
        mv, got = memoryview(self.buf_in), 0
        while got < len(mv):
            n = self.conn.recv_into(mv[got:], min(len(mv) - got, 4 << 20))
            if not n:
                raise ConnectionError("peer closed")
            got += n

    def start(self) -> None:
        self.threads = [threading.Thread(target=self._send), threading.Thread(target=self._recv)]
        for t in self.threads:
            t.start()

    def wait(self) -> None:
        for t in self.threads:
            t.join()

    def close(self) -> None:
        self.out.close()
        self.conn.close()


def train_loop(store, state, iters: int, chunk: int, every: int, first_step: int, handler: Replicated,
               ring: SocketRing | None = None) -> tuple[float, list[float], float]:
    """``iters`` chunks of matmuls, a save at the start of every ``every`` chunks (so the background work
    of every save overlaps training), followed by a socket copy with ``ring``; returns (time outside save,
    landings, CPU seconds of the other threads: the store's background work)."""
    busy, saved, cpu0 = 0.0, {}, background_cpu()
    for i in range(iters):
        if store is not None and i % every == 0:
            step = first_step + i
            saved[step] = time.perf_counter()
            store.save(step, state, blocking=False)
            if ring is not None:
                ring.wait()
                ring.start()
        busy += matmul(chunk)
    if store is not None:
        store.wait_until_finished()
    if ring is not None:
        ring.wait()
    return busy, [handler.at[s] - t for s, t in saved.items() if s in handler.at], background_cpu() - cpu0


def worker(args: argparse.Namespace) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist

    from tierfs import TieredStore
    from tierfs.policies import LatestN
    from tierfs.tiers import MemoryTier, PeerTier

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    say = log if rank == 0 else (lambda *a: None)  # noqa: E731
    handler = Replicated()
    logging.getLogger("tierfs").addHandler(handler)
    logging.getLogger("tierfs").setLevel(logging.INFO)
    nbytes = args.size_mib * MiB
    g = torch.Generator().manual_seed(rank)
    state = {f"layer{i}": torch.randn(nbytes // 4 // 8, generator=g) for i in range(8)}
    scratch = Scratch(f"bench-peer-{rank}-")
    results: dict[str, list[float]] = {}
    if args.lost_node_only:
        try:
            results = lost_node(dist, scratch, nbytes, args.repeats, say)
            gathered: list = [None] * world
            dist.all_gather_object(gathered, results)
        finally:
            scratch.cleanup()
        if rank == 0:
            report_lost_node(nbytes, world, {k: [x for r in gathered for x in r.get(k, [])]
                                             for k in set().union(*gathered)})
            print(f"- machine: {machine_note()}\n- command: `.venv/bin/python benchmarks/bench_peer.py "
                  f"--lost-node-only --size-mib {args.size_mib} --repeats {args.repeats} --world {world}`")
        dist.destroy_process_group()
        return
    try:
        say(f"{world} ranks, {args.size_mib} MiB per rank: plain socket copy, gloo, tierfs replication")
        buf_out = np.random.default_rng(rank).integers(0, 255, nbytes, dtype=np.uint8)
        buf_in = np.zeros(nbytes, np.uint8)  # pages faulted in before any timing
        t_out, t_in = torch.from_numpy(buf_out), torch.from_numpy(buf_in)
        for key in ("socket", "gloo", "tierfs", "cpu socket", "cpu gloo", "cpu tierfs"):
            results[key] = []
        ram = MemoryTier(scratch.fresh("ram"), keep=LatestN(2))
        with TieredStore([ram, PeerTier(replicas=1)], background_bandwidth=None) as store, \
                TieredStore([MemoryTier(scratch.fresh("solo"), keep=LatestN(2))]) as solo:
            for step in range(2):  # warm-up: replica buffers mapped, then reused
                for st in (store, solo):
                    st.save(step, state)
                    st.wait_until_finished()
            socket_copy(dist, buf_out, buf_in)
            gloo_copy(dist, t_out, t_in)
            # interleaved rounds: all three see the same moment of a shared machine
            for step in range(2, 2 + args.repeats):
                for key, copy in (("socket", lambda: socket_copy(dist, buf_out, buf_in)),
                                  ("gloo", lambda: gloo_copy(dist, t_out, t_in))):
                    cpu0 = process_cpu()
                    results[key].append(copy())
                    results[f"cpu {key}"].append(process_cpu() - cpu0)
                spent = []  # CPU of a save: with peers, then RAM only; replication's is the difference
                for st in (store, solo):
                    dist.barrier()
                    cpu0 = process_cpu()
                    st.save(step, state)
                    st.wait_until_finished()
                    spent.append(process_cpu() - cpu0)
                results["tierfs"].append(handler.seconds[step])
                results["cpu tierfs"].append(spent[0] - spent[1])
        del t_out, t_in
        scratch.remove("ram")
        scratch.remove("solo")

        every = max(1, int(args.interval * 1e3 / args.chunk_ms))
        iters = every * args.saves
        variants = [("no checkpoints", None, None), ("RAM only", [], None),
                    ("RAM + plain socket copy (floor)", "RAM only", None),
                    ("RAM + peers, default throttle", [PeerTier(1)], "default"),
                    ("RAM + peers, unthrottled", [PeerTier(1)], None)]
        stores = {}
        ring = SocketRing(dist, buf_out, buf_in)  # the throughput phase's buffers, already faulted in
        try:
            for n, (label, extra, bw) in enumerate(variants):
                if extra is None or isinstance(extra, str):  # none, or another variant's store
                    continue
                kw = {} if bw == "default" else {"background_bandwidth": None}
                store = stores[label] = TieredStore([MemoryTier(scratch.fresh(f"loop{n}"), keep=LatestN(2)), *extra],
                                                    **kw)
                for step in range(3):  # warm-up outside the timed loop: steady state reuses mapped buffers
                    store.save(step, state)
                    store.wait_until_finished()
            # calibrated with the stores open and idle; one chunk size on every rank, so saves coincide
            per = [None] * world
            dist.all_gather_object(per, statistics.median(matmul(20) / 20 for _ in range(15)))
            chunk = max(1, int(args.chunk_ms / 1e3 / max(statistics.median(per), 1e-6)))
            say(f"training loop: {args.rounds} rounds of {iters} chunks of {chunk} matmuls per variant, a save "
                f"every {every} chunks")
            # interleaved rounds, as above: each variant runs a while in every round, so a slow minute of
            # the machine falls on all of them; the order rotates, so none always follows the same one
            turns = 0
            for rnd in range(args.rounds):
                for label, extra, _ in variants[rnd % len(variants):] + variants[:rnd % len(variants)]:
                    dist.barrier()
                    store = stores.get(extra if isinstance(extra, str) else label)
                    busy, lands, cpu = train_loop(store, state, iters, chunk, every, 100 + turns * iters, handler,
                                                  ring if isinstance(extra, str) else None)
                    turns += 1
                    results.setdefault(f"loop: {label}", []).append(busy)
                    results.setdefault(f"cpu: {label}", []).append(cpu / args.saves)
                    if extra and not isinstance(extra, str):
                        results.setdefault(f"lands: {label}", []).extend(lands)
        finally:
            for store in stores.values():
                store.close()
            ring.close()
        results.update(lost_node(dist, scratch, nbytes, args.repeats, say))
        gathered = [None] * world
        dist.all_gather_object(gathered, results)
    finally:
        scratch.cleanup()
    if rank == 0:
        report(args, world, nbytes, gathered)
        report_lost_node(nbytes, world, {k: [x for r in gathered for x in r.get(k, [])]
                                         for k in set().union(*gathered) if ": " in k and k.split(": ")[0] in
                                         ("own shards", "data parallel")})
    dist.destroy_process_group()


def report(args, world: int, nbytes: int, gathered: list[dict[str, list[float]]]) -> None:
    # every rank's figures under every key any rank has: some phases time only the ranks they concern
    every = {k: [t for r in gathered for t in r.get(k, [])] for k in dict.fromkeys(k for r in gathered for k in r)}
    print(f"## Peer replication, {world} ranks x {args.size_mib} MiB, ring, replicas=1\n")
    print(f"- machine: {machine_note()}")
    print(f"- command: `.venv/bin/python benchmarks/bench_peer.py --size-mib {args.size_mib} --repeats "
          f"{args.repeats} --world {world} --interval {args.interval} --saves {args.saves} --rounds {args.rounds}`\n")
    rows = [Result("plain TCP socket copy (ring, both directions)", nbytes, every["socket"]),
            Result("gloo isend/irecv of tensors", nbytes, every["gloo"]),
            Result("tierfs replication, unthrottled (commit -> verified)", nbytes, every["tierfs"])]
    cpu = {k: statistics.median(every[f"cpu {k}"]) for k in ("socket", "gloo", "tierfs")}
    print(table("Throughput per rank (each rank sends and receives one shard)", rows, floor=rows[0],
                ratio_label="x socket", extra={
                    "CPU per rank and transfer (every thread, medians)": f"socket {cpu['socket']:.3f} s, gloo "
                    f"{cpu['gloo']:.3f} s, tierfs replication {cpu['tierfs']:.3f} s (a save with peers minus a "
                    "RAM-only save, in the same round)"}))
    base = statistics.median(every["loop: no checkpoints"])

    def paired(key: str, ref: str) -> float:
        """Median over ranks and rounds of a variant's time / the reference's time in the same round."""
        return statistics.median(a / b for r in gathered for a, b in zip(r[key], r[ref])) - 1

    print("### Training-like loop (1-thread matmuls in every rank; time outside save)\n")
    print("| variant | median s | vs no checkpoints | vs RAM only | replica lands (median / max s) | "
          "background CPU per save (s) |")
    print("|---|---|---|---|---|---|")
    for key in [k for k in every if k.startswith("loop: ")]:
        label = key[len("loop: "):]
        lands = every.get(f"lands: {label}")
        land = f"{statistics.median(lands):.2f} / {max(lands):.2f}" if lands else "-"
        print(f"| {label} | {statistics.median(every[key]):.2f} | {paired(key, 'loop: no checkpoints') * 100:+.1f}% | "
              f"{paired(key, 'loop: RAM only') * 100:+.1f}% | {land} | "
              f"{statistics.median(every[f'cpu: {label}']):.2f} |")
    print("\n- slowdowns: medians, over ranks and rounds, of a variant's time over the other's in the same round;"
          " background CPU: per rank, of every thread but the training one, ended ones included (getrusage)")
    ratio = statistics.median(every["socket"]) / statistics.median(every["tierfs"])
    print(f"- save interval: {args.interval:.1f} s of training asked, {base / args.saves:.1f} s measured (loop "
          f"without checkpoints / saves per round); replication unthrottled = {ratio:.2f}x the socket copy "
          f"(target >= 0.8)")


# -- the launcher -----------------------------------------------------------------------------------
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mib", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--interval", type=float, default=8.0, help="seconds of training between saves")
    ap.add_argument("--saves", type=int, default=1, help="saves per training-loop variant and round")
    ap.add_argument("--rounds", type=int, default=6, help="rounds of the training-loop variants")
    ap.add_argument("--chunk-ms", type=float, default=50.0)
    ap.add_argument("--lost-node-only", action="store_true", help="only the lost-node phase")
    ap.add_argument("--worker", action="store_true")
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return 0
    return launch_ranks(__file__, sys.argv[1:], args.world)


if __name__ == "__main__":
    raise SystemExit(main())
