"""The erasure-coded tier against PeerTier: codec speed, RAM, network bytes, a lost node, training slowdown.

    .venv/bin/python benchmarks/bench_erasure.py [--tierfs-rev HEAD] [--size-mib 64] [--no-write]

In one run (each process of a job is its own node, gloo on 127.0.0.1, its RAM directory under /dev/shm):

1. **codec**, in this process pinned to one CPU: ``tierfs.tiers._erasure.encode`` of ``--codec-mib`` of data
   cut into 4 pieces, for 4+1 (XOR) and 4+2 (Reed-Solomon, ISA-L through pyeclib), and ``decode`` of one
   lost data piece (4+1, 4+2) and two (4+2). GB/s are the stripe's data bytes per second either way (as in
   bench_codecs.py), medians of ``--codec-runs``; every result is checked.
2. **RAM per rank**: a job of ``data + parity`` ranks (5 for 4+1, 6 for 4+2), every rank holding a shard of
   ``--size-mib`` of its own (8 float32 tensors), saves steps 1 and 2 (RAM tier and replicator both
   ``LatestN(1)``, unthrottled) with RAM only, ``ErasureCodedTier(data, parity)`` and
   ``PeerTier(replicas=parity)``; then each rank's tmpfs bytes (allocated blocks of its RAM directory:
   its own step, the replicator's directory, the spare buffers of its pool) and its private RSS
   (``RssAnon``: the mapped tmpfs pages are counted once, as tmpfs). The ratio per kept step is the own
   step plus the replicator's step over the shard.
3. **network bytes per save**: while step 2 replicates, the benchmark wraps ``exchange`` of the tier's
   transfer groups (every point-to-point byte the tier moves goes through it: headers, blocks and their
   checksum tails) and sums the send buffers' ``nbytes`` per rank; the store's own small collectives
   (agreements) are not counted. Beside it, the loopback interface's transmitted bytes (``/proc/net/dev``,
   TCP/IP headers and anything else on loopback included) over the ranks.
   The replication times (commit -> every piece or copy verified, the store's log) of steps 2-5 too, and
   the CPU each save takes (every thread of the rank, getrusage) beside a RAM-only save's.
4. **a lost node**: each round saves step 1, closes the store, removes the last rank's RAM directory,
   opens the store again and times ``restore_into`` on every rank (and until the lost rank's pieces or
   replicas for others are re-seeded), for the erasure-coded tier and PeerTier in turns; in the same round
   a plain gloo ``send``/``recv`` of the shard's bytes from rank 0 to the lost rank: the one-way transfer
   floor (target: the lost rank's restore <= 2x it). The bytes each rank's restore sent to each other rank
   are counted as in 3, then sent again by every rank at once with plain gloo (the *replay*): what moving
   the restore's traffic costs on this machine, without its checks, decoding and rounds.
5. **training slowdown** (4+1 job only): every rank trains a small MLP (``--width``, 4 layers, AdamW,
   one thread, a 4-byte all-reduce of the loss per step to keep the ranks in step) ``--train-steps``
   steps per run, saving ``blocking=False`` in the middle of every ``--save-every`` steps (default
   throttle), with no checkpoints, RAM only, RAM + erasure and RAM + peers; runs take turns in ``--rounds``
   rounds in an order that rotates, each store opened and warmed up (3 saves) before its run and closed
   after it (an open store's idle gloo groups would cost every variant's runs).
   Slowdown: median over ranks and rounds of a run's mean step time (save calls included) over the same
   round's run without checkpoints. ``--loop device`` replaces the MLP's training step (after the five
   that make AdamW's state) by the host side of an accelerator's step, as ``bench_every_step.py --loop
   device`` does: ``--launch`` of ``--step-time`` in Python holding the GIL, the rest a sleep (the GIL
   free, no core used), then the all-reduce; the ranks then leave cores spare, and what a store costs is
   its time on the training thread and in the GIL, not the cores (a GPU job's shape). Other jobs on a shared machine move step times by tens of percent, so
   the CPU the store's threads spend per save (beside the run without checkpoints) is reported too.

The table goes to stdout (and ``benchmarks/results/bench_erasure-YYYYMMDD-<n>.md``, the per-rank figures
beside it as ``.json``), progress to stderr.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import GB, MiB, Scratch, export_tierfs, launch_ranks, log, machine_note  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")


# -- 1. the codec, in this process ------------------------------------------------------------------
def codec(total: int, runs: int) -> dict[str, dict[str, float]]:
    """encode / decode GB/s (of ``total`` data bytes) on one CPU, medians of ``runs`` (after one warm-up)."""
    import numpy as np

    from tierfs.tiers import _erasure

    def median_s(fn) -> tuple[float, object]:
        out = fn()
        times = []
        for _ in range(runs):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times), out

    d = 4
    rng = np.random.default_rng(0)
    data = [rng.integers(0, 256, total // d, dtype=np.uint8) for _ in range(d)]
    out: dict[str, dict[str, float]] = {}
    for p in (1, 2):
        if p > 1 and not _erasure.available():
            log("pyeclib (ISA-L) is not installed: no 4+2 codec figures")
            continue
        code = f"4+{p}"
        t, parity = median_s(lambda: _erasure.encode(data, p))
        pieces = dict(enumerate(data + list(parity)))
        out[f"encode {code}"] = {"s": t, "GB/s": total / t / GB}
        for lost in ([0],) if p == 1 else ([0], [0, 1]):
            have = {i: a for i, a in pieces.items() if i not in lost}
            t, got = median_s(lambda: _erasure.decode(have, d, p, lost))
            assert all(np.array_equal(got[w], data[w]) for w in lost), f"decode {code} {lost} is wrong"
            out[f"decode {code}, {len(lost)} lost"] = {"s": t, "GB/s": total / t / GB}
        log(f"codec {code}: " + ", ".join(f"{k} {v['GB/s']:.2f} GB/s" for k, v in out.items() if code in k))
    return out


# -- inside each rank ---------------------------------------------------------------------------------
class Replicated(logging.Handler):
    """The store's "step N replicated to peers: X sent in Ys" records: seconds per step."""

    def __init__(self) -> None:
        super().__init__()
        self.seconds: dict[int, float] = {}

    def emit(self, record: logging.LogRecord) -> None:
        if isinstance(record.msg, str) and record.msg.startswith("step %d replicated to peers"):
            step, _n, secs = record.args
            self.seconds[int(step)] = float(secs)


def count_exchanges(tier, counts: dict[str, int]) -> None:
    """Sum the bytes of every send and receive buffer of the tier's transfer groups' ``exchange`` calls, in
    ``counts["sent"]`` and ``counts["received"]`` and per group: ``"copy sent"`` (the background worker's:
    replication, re-seeding), ``"main sent"`` (a restore's), ..., and ``"main to <rank>"``: sent to each peer."""
    for role, g in tier._groups.items():
        orig = g.exchange

        def exchange(sends, recvs, *a, _orig=orig, _role=role, **kw):
            for key, bufs in (("sent", sends), ("received", recvs)):
                n = sum(int(b.nbytes) for _, b in bufs)
                counts[key] = counts.get(key, 0) + n
                counts[f"{_role} {key}"] = counts.get(f"{_role} {key}", 0) + n
            for peer, b in sends:
                counts[f"{_role} to {peer}"] = counts.get(f"{_role} to {peer}", 0) + int(b.nbytes)
            return _orig(sends, recvs, *a, **kw)

        g.exchange = exchange


def process_cpu() -> float:
    """CPU seconds used so far by every thread of this process."""
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def background_cpu() -> float:
    """CPU seconds used so far by this process's threads but the calling one (Linux; ended ones included)."""
    import resource

    me = resource.getrusage(resource.RUSAGE_THREAD)
    return process_cpu() - me.ru_utime - me.ru_stime


def lo_bytes() -> int:
    """Bytes the loopback interface transmitted so far (/proc/net/dev)."""
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == "lo":
                return int(rest.split()[8])
    return 0


def proc_status() -> dict[str, int]:
    """VmRSS, RssAnon, RssShmem, VmHWM of this process, in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("VmRSS", "RssAnon", "RssShmem", "VmHWM"):
                out[k] = int(v.split()[0]) * 1024
    return out


def reset_peak() -> None:
    """Set VmHWM back to the current RSS (Linux: ``5`` into clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def tmpfs_bytes(path: str) -> dict[str, int]:
    """Allocated bytes under a RAM tier's directory: the replicator's directory, the pools, the rest."""
    out = {"own": 0, "replicator": 0, "pool": 0}
    for root, _dirs, files in os.walk(path):
        rel = os.path.relpath(root, path).split(os.sep)
        kind = "replicator" if rel[0] in ("erasure", "peers") else "pool" if rel[0].startswith(".pool.") else "own"
        for name in files:
            try:
                out[kind] += os.lstat(os.path.join(root, name)).st_blocks * 512
            except FileNotFoundError:
                pass
    return out


def replay(dist, sends: dict[int, int]) -> float:
    """Every rank sends ``sends[peer]`` bytes to each peer at once with plain gloo isend/irecv (no checks, no
    computing, no rounds): seconds until every rank's transfers ended. The floor of moving a restore's bytes
    between these processes, whatever their order."""
    import torch

    rank, world = dist.get_rank(), dist.get_world_size()
    rows: list = [None] * world
    dist.all_gather_object(rows, sends)
    ins = {src: torch.ones(rows[src][rank], dtype=torch.uint8) for src in range(world) if rows[src].get(rank)}
    out = torch.ones(max([0, *sends.values()]), dtype=torch.uint8)
    dist.barrier()
    t0 = time.perf_counter()
    works = [dist.irecv(buf, src) for src, buf in ins.items()]
    works += [dist.isend(out[:n], dst) for dst, n in sends.items()]
    for w in works:
        w.wait()
    took = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return float(took[0])


def make_state(rank: int, nbytes: int) -> dict:
    import torch

    g = torch.Generator().manual_seed(rank)
    return {f"layer{i}": torch.randn(nbytes // 4 // 8, generator=g) for i in range(8)}


def ram_and_bytes(dist, scratch: Scratch, state: dict, nbytes: int, makers, handler: Replicated, timed: int,
                  say) -> dict:
    """Phases 2 and 3: per variant, RAM after steps 1-2 and the bytes of step 2's replication; then the
    replication time of steps 2 .. 1 + ``timed``."""
    from tierfs import TieredStore
    from tierfs.policies import LatestN
    from tierfs.tiers import MemoryTier

    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict = {}
    for label, make in [("RAM only", None), *makers]:
        path = scratch.fresh(f"ram-{len(out)}")
        gc.collect()
        before = proc_status()
        rep = make() if make else None
        counts: dict[str, int] = {}
        handler.seconds.clear()
        row: dict = {}
        with TieredStore([MemoryTier(path, keep=LatestN(1))] + ([rep] if rep else []),
                         background_bandwidth=None) as store:
            if rep is not None:
                count_exchanges(rep, counts)
            for step in (1, 2):
                dist.barrier()
                counts.clear()
                reset_peak()
                lo0 = lo_bytes()
                store.save(step, state)
                store.wait_until_finished()
                dist.barrier()
                lo1 = lo_bytes()
            row["sent"], row["received"] = counts.get("sent", 0), counts.get("received", 0)
            row["lo per rank"] = (lo1 - lo0) / world
            after = proc_status()
            row["peak RSS during step 2"] = after["VmHWM"]
            row["RssAnon"], row["RssShmem"], row["VmRSS"] = after["RssAnon"], after["RssShmem"], after["VmRSS"]
            row["RssAnon before"] = before["RssAnon"]
            row["tmpfs"] = tmpfs_bytes(path)
            row["kept steps"] = {t.name: sorted(t.list_steps()) for t in store.tiers}
            cpu0 = process_cpu()
            for step in range(3, 2 + timed):
                dist.barrier()
                store.save(step, state)
                store.wait_until_finished()
            row["cpu per save"] = (process_cpu() - cpu0) / max(1, timed - 1)
            row["replicate s"] = [handler.seconds[s] for s in range(2, 2 + timed) if s in handler.seconds]
        scratch.remove(os.path.basename(path))
        out[label] = row
        say(f"RAM and bytes: {label} done")
    return out


def lost_node(dist, scratch: Scratch, state: dict, nbytes: int, makers, rounds: int, say) -> dict:
    """Phase 4 (see the module docstring)."""
    import torch

    from tierfs import TieredStore
    from tierfs.policies import LatestN
    from tierfs.tiers import MemoryTier

    rank, world = dist.get_rank(), dist.get_world_size()
    lost = world - 1
    buf = torch.zeros(nbytes // 4)
    out: dict = {}
    for rnd in range(rounds):
        for label, make in (makers if rnd % 2 == 0 else makers[::-1]):
            path = scratch.fresh(f"lost-{rnd}")
            with TieredStore([MemoryTier(path, keep=LatestN(1)), make()], background_bandwidth=None) as store:
                store.save(1, state)
                store.wait_until_finished()
            dist.barrier()
            if rank == lost:
                shutil.rmtree(path)
            target = {k: torch.zeros_like(v) for k, v in state.items()}
            counts: dict[str, int] = {}
            rep = make()
            with TieredStore([MemoryTier(path, keep=LatestN(1)), rep], background_bandwidth=None) as store:
                count_exchanges(rep, counts)
                dist.barrier()
                reset_peak()
                rss0 = proc_status()["VmRSS"]
                t0 = time.perf_counter()
                info = store.restore_into(target)
                restored = time.perf_counter() - t0
                peak = proc_status()["VmHWM"] - rss0
                store.wait_until_finished()
                reseeded = time.perf_counter() - t0
            assert all(torch.equal(target[k], state[k]) for k in state), f"{label}: restore is not bit-exact"
            if rank == lost:
                assert info.tier == rep.name, f"{label}: the lost rank restored from {info.tier}, not {rep.name}"
            dist.barrier()  # the one-way floor: the shard's bytes, rank 0 -> the lost rank
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(buf, lost)
            elif rank == lost:
                dist.recv(buf, 0)
            one_way = time.perf_counter() - t0
            floor = replay(dist, {int(k.split()[-1]): v for k, v in counts.items() if k.startswith("main to ")})
            row = out.setdefault(label, {"restore s": [], "until re-seeded s": [], "one-way s": [], "replay s": [],
                                         "peak growth": [],
                                         "received in restore": [], "sent in restore": [], "sent in re-seed": []})
            row["restore s"].append(restored)
            row["peak growth"].append(peak)
            row["until re-seeded s"].append(reseeded)
            row["one-way s"].append(one_way)
            row["replay s"].append(floor)
            row["received in restore"].append(counts.get("main received", 0))
            row["sent in restore"].append(counts.get("main sent", 0))
            row["sent in re-seed"].append(counts.get("copy sent", 0))
            scratch.remove(f"lost-{rnd}")
        say(f"lost node: round {rnd + 1} of {rounds}")
    return out


def training(dist, scratch: Scratch, makers, args, say) -> dict:
    """Phase 5 (see the module docstring)."""
    import torch

    from tierfs import TieredStore
    from tierfs.policies import LatestN
    from tierfs.tiers import MemoryTier

    rank = dist.get_rank()
    torch.manual_seed(rank)
    w = args.width
    model = torch.nn.Sequential(*[m for _ in range(4) for m in (torch.nn.Linear(w, w), torch.nn.GELU())])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x, y = torch.randn(args.batch, w), torch.randn(args.batch, w)

    loss_sum = torch.zeros(1)

    def cpu_step() -> None:
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad(set_to_none=False)
        loss.backward()
        opt.step()
        loss_sum.copy_(loss.detach().reshape(1))
        dist.all_reduce(loss_sum)  # the ranks in step, as a data-parallel job's gradient all-reduce keeps them

    busy, idle = args.launch * args.step_time, (1 - args.launch) * args.step_time

    def device_step() -> None:  # a GPU job's host side: Python holding the GIL, then a wait for the device
        end, n = time.perf_counter() + busy, 0
        while time.perf_counter() < end:
            for i in range(100):
                n += i
        time.sleep(idle)
        dist.all_reduce(loss_sum)

    train_step = cpu_step

    def ckpt() -> dict:
        return {"model": model.state_dict(),
                "optim": {str(i): dict(s) for i, s in enumerate(opt.state.values())}}

    for _ in range(5):
        train_step()  # AdamW's state exists
    if args.loop == "device":
        train_step = device_step
    state_bytes = sum(t.nbytes for t in model.state_dict().values()) + sum(
        t.nbytes for s in opt.state.values() for t in s.values())
    makes: dict = {"no checkpoints": None, "RAM only": None, **dict(makers)}
    out: dict = {"state bytes": state_bytes, "runs": {}}
    labels = list(makes)
    next_step = {k: 100 for k in labels}
    opened = 0
    store = None

    def open_store(label: str):
        """The variant's store, fresh and warmed up (3 saves: RAM buffers, replicas, pools in steady state),
        open during its own run only: an open store's idle threads (each gloo group's I/O loop wakes every
        10 ms) would cost the other variants' runs too."""
        nonlocal opened
        opened += 1
        make = makes[label]
        tiers = [MemoryTier(scratch.fresh(f"train-{opened}"), keep=LatestN(1))] + ([make()] if make else [])
        st = TieredStore(tiers)  # the default throttle, as a job would run
        for _ in range(3):
            st.save(next_step[label], ckpt())
            st.wait_until_finished()
            next_step[label] += 1
        return st

    try:
        for rnd in range(args.rounds):
            for label in labels[rnd % len(labels):] + labels[:rnd % len(labels)]:
                store = open_store(label) if label != "no checkpoints" else None
                dist.barrier()
                times, stalls = [], []
                cpu0 = background_cpu()
                for i in range(args.train_steps):
                    t0 = time.perf_counter()
                    train_step()
                    if store is not None and i % args.save_every == args.save_every // 2:
                        t1 = time.perf_counter()
                        store.save(next_step[label], ckpt(), blocking=False)
                        stalls.append(time.perf_counter() - t1)
                        next_step[label] += 1
                    times.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                if store is not None:
                    store.wait_until_finished()
                tail = time.perf_counter() - t0
                cpu = background_cpu() - cpu0
                out["runs"].setdefault(label, []).append({"background cpu s": cpu, "saves": len(stalls),
                    "median step s": statistics.median(times), "mean step s": sum(times) / len(times),
                    "save call s": statistics.median(stalls) if stalls else 0.0, "tail s": tail})
                if store is not None:
                    store.close()
                    scratch.remove(f"train-{opened}")
                    store = None
            say(f"training: round {rnd + 1} of {args.rounds}")
    finally:
        if store is not None:
            store.close()
    return out


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from tierfs.tiers import ErasureCodedTier, PeerTier

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    say = log if rank == 0 else (lambda *a: None)  # noqa: E731
    handler = Replicated()
    logging.getLogger("tierfs").addHandler(handler)
    logging.getLogger("tierfs").setLevel(logging.INFO)
    data, parity = (int(x) for x in args.code.split(":"))
    makers = [(f"erasure {data}+{parity}", lambda: ErasureCodedTier(data=data, parity=parity)),
              (f"peer replicas={parity}", lambda: PeerTier(replicas=parity))]
    nbytes = args.size_mib * MiB
    state = make_state(rank, nbytes)
    scratch = Scratch(f"bench-erasure-{rank}-")
    import tierfs

    results: dict = {"rank": rank, "tierfs": os.path.dirname(tierfs.__file__)}
    try:
        t0 = time.perf_counter()
        results["ram"] = ram_and_bytes(dist, scratch, state, nbytes, makers, handler, args.timed_saves, say)
        results["seconds ram"] = time.perf_counter() - t0
        if args.lost_rounds:
            t0 = time.perf_counter()
            results["lost"] = lost_node(dist, scratch, state, nbytes, makers, args.lost_rounds, say)
            results["seconds lost"] = time.perf_counter() - t0
        if args.rounds:
            del state
            t0 = time.perf_counter()
            results["train"] = training(dist, scratch, makers, args, say)
            results["seconds train"] = time.perf_counter() - t0
        gathered: list = [None] * world
        dist.all_gather_object(gathered, results)
    finally:
        scratch.cleanup()
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(gathered, f)
    dist.destroy_process_group()


# -- the report -----------------------------------------------------------------------------------------
def med(xs) -> float:
    xs = list(xs)
    return statistics.median(xs) if xs else float("nan")


def summarize(job: list[dict], nbytes: int, lost: int) -> dict:
    """A job's figures, medians over ranks (and rounds)."""
    out: dict = {"ram": {}, "lost": {}, "train": {}}
    for label in job[0]["ram"]:
        rows = [r["ram"][label] for r in job]
        tm = [r["tmpfs"] for r in rows]
        out["ram"][label] = {
            "own MiB": med(t["own"] for t in tm) / MiB, "replicator MiB": med(t["replicator"] for t in tm) / MiB,
            "pool MiB": med(t["pool"] for t in tm) / MiB,
            "tmpfs MiB": med(sum(t.values()) for t in tm) / MiB,
            "RssAnon MiB": med(r["RssAnon"] for r in rows) / MiB,
            "total MiB": med(r["RssAnon"] + sum(r["tmpfs"].values()) for r in rows) / MiB,
            "peak RSS MiB": med(r["peak RSS during step 2"] for r in rows) / MiB,
            "per kept step x shard": med((t["own"] + t["replicator"]) / nbytes for t in tm),
            "replicator x shard": med(t["replicator"] / nbytes for t in tm),
            "sent x shard": med(r["sent"] / nbytes for r in rows), "sent min/max": [
                min(r["sent"] for r in rows) / nbytes, max(r["sent"] for r in rows) / nbytes],
            "received x shard": med(r["received"] / nbytes for r in rows),
            "lo x shard": job[0]["ram"][label]["lo per rank"] / nbytes,
            "replicate s": med(x for r in rows for x in r["replicate s"]),
            "cpu per save s": med(r["cpu per save"] for r in rows),
            "kept steps": rows[0]["kept steps"],
        }
    for label, r in out["ram"].items():
        r["extra x shard"] = (r["total MiB"] - out["ram"]["RAM only"]["total MiB"]) * MiB / nbytes
        r["cpu over RAM only s"] = r["cpu per save s"] - out["ram"]["RAM only"]["cpu per save s"]
    for label in job[0].get("lost", {}):
        mine = job[lost]["lost"][label]
        others = [r["lost"][label] for r in job if r["rank"] != lost]
        out["lost"][label] = {
            "restore s": med(mine["restore s"]), "one-way s": med(mine["one-way s"]),
            "ratio": med(a / b for a, b in zip(mine["restore s"], mine["one-way s"])),
            "ratios": [a / b for a, b in zip(mine["restore s"], mine["one-way s"])],
            "replay s": med(mine["replay s"]),
            "replay ratio": med(a / b for a, b in zip(mine["restore s"], mine["replay s"])),
            "others restore s": med(x for o in others for x in o["restore s"]),
            "until re-seeded s": med(mine["until re-seeded s"]),
            "received x shard": med(mine["received in restore"]) / nbytes,
            "peak x shard": med(mine["peak growth"]) / nbytes,
            "others sent x shard": med(x for o in others for x in o["sent in restore"]) / nbytes,
            "re-seed sent x shard": med(x for o in job for x in o["lost"][label]["sent in re-seed"]) / nbytes,
        }
    if "train" in job[0]:
        runs = [r["train"]["runs"] for r in job]
        out["train"]["state MiB"] = job[0]["train"]["state bytes"] / MiB
        for label in runs[0]:
            def paired(key: str) -> float:
                return med(a[key] / b[key] - 1 for r in runs for a, b in zip(r[label], r["no checkpoints"]))
            out["train"][label] = {
                "median step ms": med(x["median step s"] for r in runs for x in r[label]) * 1e3,
                "mean step ms": med(x["mean step s"] for r in runs for x in r[label]) * 1e3,
                "save call ms": med(x["save call s"] for r in runs for x in r[label]) * 1e3,
                "slowdown mean": paired("mean step s"), "slowdown median": paired("median step s"),
                # per save: this run's background CPU less the same round's run without checkpoints
                "background cpu per save ms": med(
                    (a["background cpu s"] - b["background cpu s"]) / a["saves"] * 1e3
                    for r in runs for a, b in zip(r[label], r["no checkpoints"]) if a["saves"]),
            }
    return out


def report(args, codec_res: dict, jobs: dict[str, dict], seconds: dict[str, float], which: str) -> str:
    nbytes = args.size_mib * MiB
    lines = ["# bench_erasure: ErasureCodedTier against PeerTier", "",
             f"- {time.strftime('%Y-%m-%d %H:%M:%S')}; {machine_note()}; load average at the end "
             f"{os.getloadavg()[0]:.1f} (a shared machine: other jobs ran beside it)",
             f"- {which}",
             f"- command: `{' '.join(['.venv/bin/python', 'benchmarks/bench_erasure.py', *sys.argv[1:]])}`",
             f"- the ranks imported tierfs from {sorted({r['tierfs'] for s in jobs.values() for r in s['raw']})}",
             f"- jobs: {', '.join(f'{k} {v:.0f} s' for k, v in seconds.items())}; shard {args.size_mib} MiB per rank "
             "(8 float32 tensors), each process its own node, gloo on 127.0.0.1", ""]
    cols = [(code, label) for code, s in jobs.items() for label in s["ram"] if label != "RAM only"]
    lines += ["## Summary", "",
              "| figure | " + " | ".join(label for _, label in cols) + " |",
              "|---|" + "---|" * len(cols)]

    def row(name: str, fn) -> None:
        cells = []
        for code, label in cols:
            try:
                cells.append(fn(jobs[code], label))
            except (KeyError, TypeError):
                cells.append("-")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")

    def codec_cell(kind: str):
        def fn(_s, label):
            if not label.startswith("erasure"):
                return "-"
            code = label.split()[1]
            hits = [v for k, v in codec_res.items() if k.startswith(f"{kind} {code}")]
            return ", ".join(f"{v['GB/s']:.2f}" for v in hits) if hits else "-"
        return fn

    row(f"codec encode, 1 CPU, GB/s of {args.codec_mib} MiB of data", codec_cell("encode"))
    row("codec decode, 1 CPU, GB/s (1 lost piece[, 2 lost])", codec_cell("decode"))
    row("world (ranks = nodes)", lambda s, label: str(s["world"]))
    row("RAM tier dir per kept step (own + replicator), x shard",
        lambda s, label: f"{s['ram'][label]['per kept step x shard']:.3f}")
    row("  of which the replicator's, x shard", lambda s, label: f"{s['ram'][label]['replicator x shard']:.3f}")
    row("RAM per rank: RssAnon + tmpfs (incl. pool), MiB (RAM only: see below)",
        lambda s, label: f"{s['ram'][label]['total MiB']:.0f} (RAM only {s['ram']['RAM only']['total MiB']:.0f})")
    row("  extra over RAM only (RssAnon + tmpfs), x shard", lambda s, label: f"{s['ram'][label]['extra x shard']:.3f}")
    row("bytes sent per rank per save (tier's exchanges), x shard",
        lambda s, label: f"{s['ram'][label]['sent x shard']:.3f}")
    row("loopback bytes per rank per save (/proc/net/dev), x shard",
        lambda s, label: f"{s['ram'][label]['lo x shard']:.3f}")
    row("replication time of a step (median, s)", lambda s, label: f"{s['ram'][label]['replicate s']:.2f}")
    row("CPU per save (every thread of a rank) over RAM only's (s)",
        lambda s, label: f"{s['ram'][label]['cpu over RAM only s']:.3f}")
    row("node loss: lost rank's restore_into (s)", lambda s, label: f"{s['lost'][label]['restore s']:.2f}")
    row("  one-way gloo send of the shard, same rounds (s)", lambda s, label: f"{s['lost'][label]['one-way s']:.2f}")
    row("  ratio restore / one-way (target <= 2x)", lambda s, label: f"{s['lost'][label]['ratio']:.2f}x")
    row("  plain gloo replay of the restore's bytes, all at once (s)",
        lambda s, label: f"{s['lost'][label]['replay s']:.2f}")
    row("  ratio restore / that replay", lambda s, label: f"{s['lost'][label]['replay ratio']:.2f}x")
    row("  bytes into the lost rank during restore, x shard",
        lambda s, label: f"{s['lost'][label]['received x shard']:.2f}")
    row("  the lost rank's peak RSS growth in restore_into, x shard",
        lambda s, label: f"{s['lost'][label]['peak x shard']:.2f}")
    row("training: slowdown of mean step vs no checkpoints",
        lambda s, label: f"{s['train'][label]['slowdown mean'] * 100:+.1f}% (RAM only "
                         f"{s['train']['RAM only']['slowdown mean'] * 100:+.1f}%)")
    row("training: background CPU per save (ms)",
        lambda s, label: f"{s['train'][label]['background cpu per save ms']:.0f} (RAM only "
                         f"{s['train']['RAM only']['background cpu per save ms']:.0f})")
    lines.append("")
    lines += ["- RAM per kept step: allocated tmpfs bytes of the rank's own step plus the replicator's directory "
              "(parity pieces with their stripes record and the group's manifests; or the replicas), over the "
              "shard; both tiers LatestN(1) after 2 saves. Expected: 1 + parity/data vs 1 + replicas.",
              "- bytes sent: the sum of the send buffers of every `exchange` on the tier's groups during step 2's "
              "replication, per rank (median; every rank sent the same here); loopback: the `lo` interface's "
              "transmitted bytes over the same interval / ranks (TCP/IP headers and the store's collectives "
              "included, and anything else that used loopback then).", ""]

    lines += ["## 1. Codec (`tierfs.tiers._erasure`, one CPU)", "",
              "| operation | median s | GB/s of data |", "|---|---|---|"]
    lines += [f"| {k} | {v['s']:.3f} | {v['GB/s']:.2f} |" for k, v in codec_res.items()]
    lines += ["", f"- {args.codec_mib} MiB of data in 4 pieces; medians of {args.codec_runs} runs after a warm-up; "
              "decode rebuilds the lost data pieces from the first 4 left (XOR: 3 data + parity).", ""]

    lines += ["## 2-3. RAM and network per rank, after saving steps 1 and 2", "",
              "| job | variant | own step MiB | replicator MiB | pool MiB | tmpfs MiB | RssAnon MiB | RssAnon + "
              "tmpfs MiB | peak RSS in save 2 MiB | per kept step x shard | sent x shard | received x shard | "
              "lo / rank x shard | replicate s | CPU per save s |", "|---|" + "---|" * 14]
    for code, s in jobs.items():
        for label, r in s["ram"].items():
            lines.append(f"| {code} | {label} | {r['own MiB']:.1f} | {r['replicator MiB']:.1f} | {r['pool MiB']:.1f} | "
                         f"{r['tmpfs MiB']:.1f} | {r['RssAnon MiB']:.0f} | {r['total MiB']:.0f} | "
                         f"{r['peak RSS MiB']:.0f} | {r['per kept step x shard']:.3f} | {r['sent x shard']:.3f} | "
                         f"{r['received x shard']:.3f} | {r['lo x shard']:.3f} | "
                         + (f"{r['replicate s']:.2f} |" if label != "RAM only" else "- |")
                         + f" {r['cpu per save s']:.3f} |")
    lines += ["", "- medians over ranks; pool: spare buffers the RAM tier keeps mapped for the next save (shared by "
              "the RAM tier and the replicator); RssAnon: private memory (the state itself, torch, buffers), the "
              "mapped tmpfs pages being counted as tmpfs; peak RSS: VmHWM (mapped tmpfs pages included) from "
              "just before save 2 until its replication ended; replicate s: the store's 'replicated to peers' "
              f"time of steps 2 to {1 + args.timed_saves}, unthrottled; CPU per save: every thread of the rank "
              f"(getrusage), over steps 3 to {1 + args.timed_saves}, each saved and waited for.", ""]

    if any(s["lost"] for s in jobs.values()):
        lines += ["## 4. A lost node: restore_into on a replaced node (its RAM directory removed)", "",
                  "| job | variant | lost rank restore s | one-way gloo s | ratio (each round) | replay s | "
                  "ratio to replay | other ranks restore s | until re-seeded s | into lost rank x shard | "
                  "sent per other rank x shard | "
                  "re-seed: sent per rank x shard | lost rank's peak RSS growth x shard |", "|---|" + "---|" * 12]
        for code, s in jobs.items():
            for label, r in s["lost"].items():
                lines.append(f"| {code} | {label} | {r['restore s']:.2f} | {r['one-way s']:.2f} | {r['ratio']:.2f}x "
                             f"({', '.join(f'{x:.2f}' for x in r['ratios'])}) | {r['replay s']:.2f} | "
                             f"{r['replay ratio']:.2f}x | {r['others restore s']:.2f} | "
                             f"{r['until re-seeded s']:.2f} | {r['received x shard']:.2f} | "
                             f"{r['others sent x shard']:.2f} | {r['re-seed sent x shard']:.2f} | "
                             f"{r['peak x shard']:.2f} |")
        lines += ["", "- medians over rounds (other ranks: over ranks and rounds); the last rank is lost; one-way: a "
                  "plain gloo send/recv of the shard's bytes, rank 0 -> the lost rank, in the same round; replay: the "
                  "bytes "
                  "each rank's restore sent to each other rank (counted), sent again by every rank at once with plain "
                  "gloo isend/irecv, until the last ended: what moving those bytes costs here, with no checks, no "
                  "decoding and no rounds (a rebuild's traffic is several shards: on one machine its ranks share the "
                  "CPUs and the memory bus, where separate nodes would each use their own); re-seeded: "
                  "until the lost rank's parity pieces (or replicas) for the others are computed again and the store "
                  "is idle; bytes: the tier's exchanges on its restore group (the restore's) and on its background "
                  "group (re-seeding), medians over ranks; peak RSS growth: the lost rank's VmHWM at the end of "
                  "restore_into over its VmRSS at the start (its target state allocated before; tmpfs pages it "
                  "maps count too).", ""]

    for code, s in jobs.items():
        if not s["train"]:
            continue
        t = s["train"]
        shape = "on this machine's CPUs" if args.loop == "cpu" else "device-shaped steps, on spare cores"
        lines += [f"## 5. Training slowdown ({code} job, {s['world']} ranks, {shape})", "",
                  "| variant | median step ms | mean step ms | save call ms (median) | slowdown, mean step | "
                  "slowdown, median step | background CPU per save ms |", "|---|---|---|---|---|---|---|"]
        for label, r in t.items():
            if isinstance(r, dict):
                lines.append(f"| {label} | {r['median step ms']:.2f} | {r['mean step ms']:.2f} | "
                             f"{r['save call ms']:.2f} | {r['slowdown mean'] * 100:+.1f}% | "
                             f"{r['slowdown median'] * 100:+.1f}% | "
                             + (f"{r['background cpu per save ms']:.0f} |" if label != "no checkpoints" else "- |"))
        step = (f"each step trains the MLP, batch {args.batch}" if args.loop == "cpu" else
                f"each step is a device-shaped one ({args.launch * args.step_time * 1e3:.0f} ms of Python holding "
                f"the GIL, then {(1 - args.launch) * args.step_time * 1e3:.0f} ms waiting as for a device: the GIL "
                "free, no core used), the state saved the MLP's")
        lines += ["", f"- an MLP of 4 Linear({args.width}, {args.width}) + GELU, AdamW, one thread per rank; {step}; "
                  f"state {t['state MiB']:.1f} MiB per rank (model + AdamW); {args.train_steps} steps per "
                  "run, "
                  f"a save (blocking=False, default throttle) in the middle of every {args.save_every} (so the "
                  f"background work of each falls within the run); {args.rounds} rounds; "
                  "slowdown: median over ranks and rounds of a run's step time over the same round's run without "
                  "checkpoints; every step ends with an all-reduce of the loss (4 bytes), which keeps the ranks in "
                  "step as a data-parallel job's gradient all-reduce would (a save is collective: without it, a save "
                  "call would wait out the ranks' drift); background CPU per save: every thread of the rank but the "
                  "training one (getrusage, ended threads included) during the run and until the store is idle, less "
                  "the same round's run without checkpoints, over the run's saves: robust where step times are not "
                  "(other jobs on this machine move them by tens of percent from run to run).", ""]
    return "\n".join(lines) + "\n"


def next_result(stem: str) -> str:
    day = time.strftime("%Y%m%d")
    n = 1
    while os.path.exists(os.path.join(RESULTS, f"{stem}-{day}-{n}.md")):
        n += 1
    return os.path.join(RESULTS, f"{stem}-{day}-{n}.md")


def git(*a: str) -> str:
    return subprocess.run(["git", "-C", REPO, *a], capture_output=True, text=True).stdout.strip()


def describe_tierfs(rev: str | None) -> str:
    if rev:
        subject = git("log", "-1", "--format=%s", rev)[:90]
        return f"tierfs as committed at {git('rev-parse', '--short', rev)} ({subject})"
    dirty = git("status", "--porcelain", "--", "tierfs")
    return (f"tierfs from this checkout's working tree, HEAD {git('rev-parse', '--short', 'HEAD')}"
            + (" (tierfs changed since: " + ", ".join(line[3:] for line in dirty.splitlines()) + ")" if dirty else ""))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mib", type=int, default=64, help="shard per rank")
    ap.add_argument("--codec-mib", type=int, default=256)
    ap.add_argument("--codec-runs", type=int, default=5)
    ap.add_argument("--codes", default="4:1,4:2", help="data:parity of each job (parity = PeerTier's replicas)")
    ap.add_argument("--timed-saves", type=int, default=4, help="saves whose replication is timed")
    ap.add_argument("--lost-rounds", type=int, default=3, help="lost-node rounds of the 4+1 job")
    ap.add_argument("--lost-rounds-more", type=int, default=3, help="lost-node rounds of the other jobs")
    ap.add_argument("--rounds", type=int, default=8, help="training rounds (4+1 job); 0: none")
    ap.add_argument("--train-steps", type=int, default=90)
    ap.add_argument("--save-every", type=int, default=30)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--loop", choices=("cpu", "device"), default="cpu",
                    help="training phase: the MLP trained on the CPUs, or a device-shaped step (see phase 5)")
    ap.add_argument("--step-time", type=float, default=0.2, help="seconds per device-shaped step")
    ap.add_argument("--launch", type=float, default=0.15, help="share of a device-shaped step in Python")
    ap.add_argument("--code", default="4:1", help=argparse.SUPPRESS)
    ap.add_argument("--out", default="", help=argparse.SUPPRESS)
    ap.add_argument("--tierfs-rev", default=None,
                    help="measure tierfs as committed at this revision (e.g. HEAD), not the working tree")
    ap.add_argument("--no-write", action="store_true", help="print only; write no results")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return 0
    t_start = time.perf_counter()
    which = describe_tierfs(args.tierfs_rev)
    log(which)
    tmp = tempfile.mkdtemp(prefix="bench-erasure-")
    if args.tierfs_rev:  # this process (the codec) and the ranks import the exported tierfs
        root = export_tierfs(args.tierfs_rev, os.path.join(tmp, "src"))
        sys.path.insert(0, root)
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    try:
        return run(args, which, tmp, t_start)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def run(args: argparse.Namespace, which: str, tmp: str, t_start: float) -> int:
    cpus = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(cpus)})
    try:
        codec_res = codec(args.codec_mib * MiB, args.codec_runs)
    finally:
        os.sched_setaffinity(0, cpus)
    gc.collect()
    jobs: dict[str, dict] = {}
    seconds = {"codec": time.perf_counter() - t_start}
    for n, code in enumerate(c.strip() for c in args.codes.split(",") if c.strip()):
        data, parity = (int(x) for x in code.split(":"))
        world = data + parity
        out = os.path.join(tmp, f"{data}-{parity}.json")
        extra = ["--code", code, "--out", out, "--lost-rounds",
                 str(args.lost_rounds if n == 0 else args.lost_rounds_more),
                 "--rounds", str(args.rounds if n == 0 else 0)]
        keep = [a for a in sys.argv[1:] if a != "--no-write"]
        log(f"job {data}+{parity}: {world} ranks")
        t0 = time.perf_counter()
        rc = launch_ranks(__file__, _strip(keep, ("--code", "--out", "--lost-rounds", "--rounds")) + extra, world)
        seconds[f"{data}+{parity}"] = time.perf_counter() - t0
        if rc:
            log(f"job {data}+{parity} failed (exit {rc})")
            return rc
        with open(out) as f:
            raw = json.load(f)
        jobs[f"{data}+{parity}"] = {"world": world, **summarize(raw, args.size_mib * MiB, world - 1), "raw": raw}
    text = report(args, codec_res, jobs, seconds, which)
    print(text)
    if not args.no_write:
        path = next_result("bench_erasure")
        os.makedirs(RESULTS, exist_ok=True)
        with open(path, "w") as f:
            f.write(text)
        with open(path[:-3] + ".json", "w") as f:
            json.dump({"tierfs": which, "args": vars(args), "codec": codec_res, "seconds": seconds,
                       "jobs": jobs}, f, indent=1)
        log(f"written: {path} (and .json)")
    log(f"total {time.perf_counter() - t_start:.0f} s")
    return 0


def _strip(argv: list[str], options: tuple[str, ...]) -> list[str]:
    """``argv`` without the given options and their values (the launcher sets them per job)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in options:
            skip = True
            continue
        if any(a.startswith(o + "=") for o in options):
            continue
        out.append(a)
    return out


if __name__ == "__main__":
    raise SystemExit(main())
