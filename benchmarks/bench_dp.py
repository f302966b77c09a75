"""Data-parallel checkpointing: replicas declared with ``replicated=`` stored once, against every rank storing all.

    .venv/bin/python benchmarks/bench_dp.py [--worlds 1,2,4] [--hidden 256] [--layers 12] [--warmup 2] [--saves 4] [--retries 2]
                                            [--bandwidth MBPS]

For each data-parallel degree in ``--worlds`` and each variant one job of that many ranks (gloo on 127.0.0.1,
each rank its own node with its own RAM directory under /dev/shm; one file:// object directory under /tmp
shared by all), so that only one store is open on the machine while its RAM is measured. Every rank holds
the same real model and its Adam state (a stack of ``--layers`` blocks of Linear(h, 4h), LayerNorm,
Linear(4h, h), LayerNorm with h = ``--hidden``, trained one step so Adam's moments exist; same seed and same
batches on every rank, so the replicas are bit-identical) plus a small tensor of its own (``mine/rng``,
4 KiB). Between saves every rank trains one more step on the same batch.

The store of every job has the same tiers (RAM ``LatestN(1)``, ``PeerTier(1)`` when world > 1, object
``LatestN(1)``, unthrottled, or with ``--bandwidth`` each rank's background transfers paced to that many
MB/s, as when each node's own link to the object store is the limit); the variants:

- ``replicated``: ``save(step, state, replicated=["model", "optim"], blocking=False)``: shared tiers store
  the replicated arrays once, peers replicate only what no other node holds;
- ``baseline``: ``save(step, state, blocking=False)``: every rank stores its whole state on every tier.

Each save is followed by ``wait_until_finished()``. ``--warmup`` saves, then ``--saves`` timed ones. Per
timed save: the bytes of the step's ``*.bin`` files on the object tier and their ratio to the distinct bytes
(model + Adam once, plus every rank's own tensor); the bytes in each rank's RAM step directory and in its
replicas for peers (``<ram>/peers``), over the rank's state bytes; the bytes each rank sent to peers (the
store's "replicated to peers" log line); the time from calling ``save`` until ``wait_until_finished``
returns (the step is on the object tier and replicated: durable) and the time inside ``save`` (the stall;
it returns once the state is copied into the RAM tier's buffers), both the slowest rank's; and the RAM
peak: a thread of rank 0 samples the used bytes of the /dev/shm file system (``statvfs``) every ~0.5 ms,
less a baseline taken right after the store is opened and before its first save (so pooled and spare
buffers count), the peak over the save (from the barrier before it to the barrier after it) divided by
the sum of every rank's state bytes: all ranks share /dev/shm here, so it is the average per rank. A job
during which /dev/shm changed outside it (its used bytes after the job, its files removed, differ from
before it by more than 1 MiB) is run again, up to ``--retries`` times.

Tables show medians over saves (the RAM peak: the largest); the launcher prints them (stdout) and progress
(stderr).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(__file__))
from _common import MiB, Scratch, launch_ranks, log, machine_note  # noqa: E402

VARIANTS = ("replicated", "baseline")
DECLARED = ["model", "optim"]
SHM = "/dev/shm"


# -- inside each rank -------------------------------------------------------------------------------
class Sent(logging.Handler):
    """Collects the store's "step N replicated to peers: X sent in Ys" records: bytes sent per step."""

    def __init__(self) -> None:
        super().__init__()
        self.nbytes: dict[int, int] = {}

    def emit(self, record: logging.LogRecord) -> None:
        if record.msg.startswith("step %d replicated to peers"):
            step, nbytes, _secs = record.args  # type: ignore[misc]
            self.nbytes[int(step)] = int(nbytes)


def shm_used() -> int:
    """Used bytes of the /dev/shm file system (one syscall: no directory walk, which counts a file renamed
    between two directories during the walk twice)."""
    s = os.statvfs(SHM)
    return (s.f_blocks - s.f_bfree) * s.f_frsize


class ShmPeak(threading.Thread):
    """Samples ``shm_used()`` every ``interval`` seconds; ``take()`` returns the peak since the last
    ``take()`` (or the start), the number of samples and the largest gap between two samples."""

    def __init__(self, interval: float = 0.0005) -> None:
        super().__init__(name="shm-peak", daemon=True)
        self.interval = interval
        self.lock = threading.Lock()
        self.halt = threading.Event()
        self.peak, self.samples, self.gap, self.last = 0, 0, 0.0, time.perf_counter()

    def run(self) -> None:
        while not self.halt.is_set():
            used = shm_used()
            now = time.perf_counter()
            with self.lock:
                self.peak = max(self.peak, used)
                self.samples += 1
                self.gap = max(self.gap, now - self.last)
                self.last = now
            time.sleep(self.interval)

    def take(self) -> tuple[int, int, float]:
        used = shm_used()
        with self.lock:
            out = (max(self.peak, used), self.samples, self.gap)
            self.peak, self.samples, self.gap = used, 0, 0.0
        return out

    def stop(self) -> None:
        self.halt.set()
        self.join()


def tensors(tree):
    """Every tensor leaf of a nested state (dicts with any keys, lists, tuples)."""
    import torch

    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for v in tree.values():
            yield from tensors(v)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            yield from tensors(v)


def tree_bytes(tree) -> int:
    return sum(t.numel() * t.element_size() for t in tensors(tree))


def bin_bytes(path: str, step_dir: str) -> int:
    """Bytes of the ``*.bin`` files in every directory named ``step_dir`` under ``path`` (itself included)."""
    total = 0
    for d, _, files in os.walk(path):
        if os.path.basename(d) == step_dir:
            total += sum(os.path.getsize(os.path.join(d, f)) for f in files if f.endswith(".bin"))
    return total


def footprint(path: str) -> int:
    """What the files directly in ``path`` take of a tmpfs: their allocated pages (data, manifest, marker)."""
    return sum(os.stat(e.path).st_blocks * 512 for e in os.scandir(path) if e.is_file())


def build(hidden: int, layers: int):
    """The model, its Adam optimizer after one step, and the batch every rank trains on (fixed seeds)."""
    import torch

    torch.manual_seed(0)
    blocks = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(hidden, 4 * hidden), torch.nn.LayerNorm(4 * hidden),
                   torch.nn.Linear(4 * hidden, hidden), torch.nn.LayerNorm(hidden)]
    model = torch.nn.Sequential(*blocks)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    batch = torch.randn(8, hidden, generator=torch.Generator().manual_seed(1))
    return model, opt, batch


def train_step(model, opt, batch) -> None:
    model(batch).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from tierfs import TieredStore
    from tierfs.policies import LatestN
    from tierfs.tiers import MemoryTier, ObjectTier, PeerTier

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    v = args.variant
    say = log if rank == 0 else (lambda *a: None)  # noqa: E731
    tierfs_log = logging.getLogger("tierfs")
    tierfs_log.setLevel(logging.INFO)
    handler = Sent()
    tierfs_log.addHandler(handler)

    model, opt, batch = build(args.hidden, args.layers)
    train_step(model, opt, batch)  # Adam's exp_avg / exp_avg_sq exist from here on
    mine = torch.randn(1024, generator=torch.Generator().manual_seed(1000 + rank))

    def state() -> dict:
        return {"model": model.state_dict(), "optim": opt.state_dict(), "mine": {"rng": mine}}

    st = state()
    shared_bytes, mine_bytes = tree_bytes({"model": st["model"], "optim": st["optim"]}), tree_bytes(st["mine"])
    own_bytes = shared_bytes + mine_bytes
    all_own: list = [None] * world
    dist.all_gather_object(all_own, own_bytes)
    total_bytes = sum(all_own)  # every rank's state: the RAM peak is over this (all ranks share /dev/shm)
    say(f"world {world} {v}: {own_bytes / MiB:.1f} MiB per rank ({sum(1 for _ in tensors(st))} tensors, "
        f"{mine_bytes} B of its own)")
    ram_dir = os.path.join(args.ram_root, f"node{os.environ['TIERFS_NODE_RANK']}")
    kw = {"replicated": DECLARED} if v == "replicated" else {}
    rows: list[dict] = []
    peaks: list[dict] = []
    sampler = None
    tiers = [MemoryTier(ram_dir, keep=LatestN(1))]
    if world > 1:
        tiers.append(PeerTier(replicas=1))
    tiers.append(ObjectTier(f"file://{args.obj_root}", keep=LatestN(1)))
    store = TieredStore(tiers, background_bandwidth=args.bandwidth * 1e6 if args.bandwidth else None)
    try:
        dist.barrier()  # every rank's store open, none has saved
        base = shm_used() if rank == 0 else 0
        dist.barrier()
        if rank == 0:
            sampler = ShmPeak()
            sampler.start()
        for step in range(args.warmup + args.saves):
            timed = step >= args.warmup  # the warm-up saves work out the layout and fill the pool
            handler.nbytes.clear()
            dist.barrier()
            if sampler is not None:
                sampler.take()  # the peak from here on
            t0 = time.perf_counter()
            store.save(step, state(), blocking=False, **kw)
            t1 = time.perf_counter()
            store.wait_until_finished()
            t2 = time.perf_counter()
            dist.barrier()  # every rank done: the object tier's step is complete, peers hold their replicas
            if sampler is not None:
                peak, samples, gap = sampler.take()
                if timed:
                    peaks.append({"step": step, "peak": peak - base, "samples": samples, "gap": gap})
            sdir = f"step_{step:012d}"
            if timed:
                rows.append({"step": step, "stall": t1 - t0, "durable": t2 - t0,
                             "ram": bin_bytes(os.path.join(ram_dir, sdir), sdir),
                             "shard": footprint(os.path.join(ram_dir, sdir)),
                             "replicas": bin_bytes(os.path.join(ram_dir, "peers"), sdir),
                             "sent": handler.nbytes.get(step, 0 if world == 1 else -1),
                             "objects": bin_bytes(os.path.join(args.obj_root, sdir), sdir) if rank == 0 else 0})
            train_step(model, opt, batch)  # the same on every rank: the replicas stay identical
            say(f"world {world} {v}: save {step} done" + ("" if timed else " (warm-up)"))
    finally:
        if sampler is not None:
            sampler.stop()
        store.close()
        tierfs_log.removeHandler(handler)
    gathered: list = [None] * world
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        out = {"world": world, "variant": v, "own_bytes": own_bytes, "shared_bytes": shared_bytes,
               "mine_bytes": mine_bytes, "total_bytes": total_bytes, "distinct": shared_bytes + world * mine_bytes,
               "ranks": gathered, "peaks": peaks, "machine": machine_note()}
        with open(args.result, "w") as f:
            json.dump(out, f)
    dist.destroy_process_group()


# -- the launcher -----------------------------------------------------------------------------------
def spread(values: list[float], fmt: str) -> str:
    """One value, or ``min-max`` when the ranks differ in the shown precision."""
    lo, hi = format(min(values), fmt), format(max(values), fmt)
    return lo if lo == hi else f"{lo}-{hi}"


def size(nbytes: float) -> str:
    for unit, scale in (("MiB", MiB), ("KiB", 1024)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes:.0f} B"


def report(args: argparse.Namespace, jobs: dict[int, dict[str, dict]]) -> None:
    j0 = next(iter(jobs.values()))[VARIANTS[0]]
    print("## Data-parallel checkpointing: replicas stored once (`replicated=`) vs every rank storing all\n")
    print(f"- machine: {j0['machine']}")
    print(f"- command: `.venv/bin/python benchmarks/bench_dp.py --worlds {args.worlds} --hidden {args.hidden} "
          f"--layers {args.layers} --warmup {args.warmup} --saves {args.saves} --retries {args.retries}"
          + (f" --bandwidth {args.bandwidth:g}" if args.bandwidth else "") + "`")
    print(f"- state per rank: {j0['own_bytes'] / MiB:.2f} MiB = model + Adam {j0['shared_bytes'] / MiB:.2f} MiB "
          f"(identical on every rank; `replicated={DECLARED}` in the replicated variant) + its own "
          f"`mine/rng` {j0['mine_bytes']} B; distinct bytes = model + Adam once + world x own")
    print("- tiers: RAM LatestN(1) in /dev/shm per rank (each rank its own node), PeerTier(replicas=1) when world "
          "> 1, file:// object tier LatestN(1) in /tmp (shared), background_bandwidth="
          + (f"{args.bandwidth:g} MB/s per rank (each node's link to the store)" if args.bandwidth else "None")
          + "; one job per world "
          "size and variant (one store open at a time); `save(..., blocking=False)` then "
          f"`wait_until_finished()`, one training step between saves; {args.saves} timed saves after "
          f"{args.warmup} warm-up saves\n")
    for v in VARIANTS:
        print(f"### {v}: " + ("`save(step, state, replicated=[\"model\", \"optim\"], blocking=False)`"
                              if v == "replicated" else
                              "`save(step, state, blocking=False)` (every rank stores its whole state)") + "\n")
        print("| world | object MiB / step | object / distinct | RAM per rank / state | replicas per rank / state "
              "(most) | peers sent per rank (most) | RAM peak / state | RAM peak / state, every save | "
              "RAM peak / shard | save -> durable s | stall s | durable s, every save |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for world in sorted(jobs):
            job = jobs[world][v]
            own = job["own_bytes"]
            ranks = job["ranks"]
            n = len(ranks[0])
            objects = statistics.median(ranks[0][i]["objects"] for i in range(n))
            ram = [statistics.median(x["ram"] for x in r) / own for r in ranks]
            reps = [statistics.median(x["replicas"] for x in r) / own for r in ranks]
            rep_bytes = [statistics.median(x["replicas"] for x in r) for r in ranks]
            sent = [statistics.median(x["sent"] for x in r) for r in ranks]
            durable = [max(r[i]["durable"] for r in ranks) for i in range(n)]
            stall = [max(r[i]["stall"] for r in ranks) for i in range(n)]
            peaks = [p["peak"] / job["total_bytes"] for p in job["peaks"]]
            shards = [p["peak"] / sum(r[i]["shard"] for r in ranks) for i, p in enumerate(job["peaks"])]
            peers = world > 1
            flag = " (!)" if abs(job["shm_drift"]) > MiB else ""
            print(f"| {world} | {objects / MiB:.2f} | {objects / job['distinct']:.3f} | {spread(ram, '.3f')} | "
                  f"{spread(reps, '.3f') + ' (' + size(max(rep_bytes)) + ')' if peers else '-'} | "
                  f"{(size(max(sent)) if min(sent) >= 0 else 'no log line') if peers else '-'} | "
                  f"{max(peaks):.3f}{flag} | {' '.join(f'{p:.3f}' for p in peaks)} | {max(shards):.4f}{flag} | "
                  f"{statistics.median(durable):.3f} | {statistics.median(stall):.3f} | "
                  f"{' '.join(f'{t:.3f}' for t in durable)} |")
        print()
    samples = [p for w in jobs.values() for j in w.values() for p in j["peaks"]]
    drift = [f"world {w} {v} {j['shm_drift'] / MiB:+.1f} MiB ({j['attempts']} run{'s' if j['attempts'] > 1 else ''})"
             for w, vs in sorted(jobs.items()) for v, j in vs.items()]
    print("- medians over saves; object bytes: the step's `*.bin` files on the object tier; RAM and replicas: the "
          "`*.bin` files of the step in the rank's RAM step directory and under its `peers/`, over the rank's "
          "state bytes (min-max over ranks when they differ); peer bytes sent: the store's \"replicated to "
          "peers\" log line; save -> durable: from calling `save` until "
          "`wait_until_finished` returns (object tier and peers done), stall: time inside `save` (returns "
          "once the state is copied into the RAM tier's buffers), both the slowest rank's")
    print("- RAM peak / state: the most /dev/shm held during a save (`statvfs` used bytes, sampled every ~0.5 ms "
          "by a thread of rank 0 from the barrier before `save` to the barrier after `wait_until_finished`), "
          "less the used bytes right after the store was opened (before its first save: pooled and spare "
          "buffers count), over the sum of every rank's state bytes (all ranks share /dev/shm: the average per "
          "rank); the column is the largest over the timed saves. Samples per save: "
          f"{min(p['samples'] for p in samples)}-{max(p['samples'] for p in samples)}, largest gap between two "
          f"samples {max(p['gap'] for p in samples) * 1e3:.1f} ms; /dev/shm used after each job less before it "
          f"(other users of the machine's /dev/shm): {', '.join(drift)}; a job with a change over 1 MiB is run "
          f"again (up to {args.retries} times), its peak marked (!) if the last run still has one")
    print("- RAM peak / shard: the same peak over the sum of every rank's shard as the RAM tier stores it: the "
          "pages its files take in the committed step's directory (data, manifest, marker), the largest over "
          "the timed saves")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", default="1,2,4", help="data-parallel degrees, one job per variant each")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2, help="untimed saves first (layout, buffer pool)")
    ap.add_argument("--saves", type=int, default=4, help="timed saves per job (after the warm-up saves)")
    ap.add_argument("--retries", type=int, default=2,
                    help="runs again a job during which /dev/shm changed by more than 1 MiB outside it")
    ap.add_argument("--bandwidth", type=float, default=0,
                    help="each rank's background bandwidth in MB/s, as a node's own link to the object store "
                         "(default 0: unpaced)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    ap.add_argument("--ram-root", help=argparse.SUPPRESS)
    ap.add_argument("--obj-root", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        # the store is closed and the result written: skip the interpreter's teardown, where torch's gloo
        # teardown aborts now and then ("terminate called without an active exception"; as tierfs.testing's
        # launcher does)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    worlds = [int(w) for w in args.worlds.split(",")]
    jobs: dict[int, dict[str, dict]] = {}
    for i, world in enumerate(worlds):
        jobs[world] = {}
        for v in VARIANTS if i % 2 == 0 else VARIANTS[::-1]:  # the order alternates from one world to the next
            for attempt in range(1 + args.retries):
                before = shm_used()
                scratch = Scratch("bench-dp-")
                obj_root = tempfile.mkdtemp(dir="/tmp", prefix="bench-dp-")
                result = os.path.join(obj_root, "result.json")
                try:
                    log(f"world {world} {v}: {world} ranks")
                    t0 = time.perf_counter()
                    rc = launch_ranks(__file__, ["--variant", v, "--hidden", str(args.hidden), "--layers",
                                                 str(args.layers), "--warmup", str(args.warmup), "--saves",
                                                 str(args.saves), "--bandwidth", str(args.bandwidth),
                                                 "--ram-root", scratch.root, "--obj-root",
                                                 os.path.join(obj_root, "obj"), "--result", result], world)
                    if rc:
                        log(f"world {world} {v}: a rank failed (exit code {rc})")
                        return rc
                    with open(result) as f:
                        jobs[world][v] = json.load(f)
                    log(f"world {world} {v}: done in {time.perf_counter() - t0:.0f} s")
                finally:
                    scratch.cleanup()
                    shutil.rmtree(obj_root, ignore_errors=True)
                drift = jobs[world][v]["shm_drift"] = shm_used() - before
                jobs[world][v]["attempts"] = attempt + 1
                if abs(drift) <= MiB:
                    break
                # something else on the machine took or gave back /dev/shm meanwhile: the peak is not ours
                log(f"world {world} {v}: /dev/shm changed by {drift / MiB:+.1f} MiB outside this job"
                    + (", again" if attempt < args.retries else ", kept (flagged)"))
    report(args, jobs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
