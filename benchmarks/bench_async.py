"""Asynchronous save: stall, time to commit, slowdown of training, and host memory over many saves.

    .venv/bin/python benchmarks/bench_async.py [--size-gib 2] [--repeats 5]

In one run, with a ~2 GiB transformer-shaped state:
- floor: ``copy_`` into preallocated tensors;
- tierfs ``CheckpointManager.save`` (RAM tier, steady state): time until it returns (the stall) and until
  the step is committed in RAM;
- DCP ``async_save`` to /dev/shm with default settings and with ``DefaultStager``: time until it returns and
  until the checkpoint is complete;
- a training-like loop (1-thread matmuls) alone, and while background work runs (checksums, commit and a
  copy to a disk-backed file:// tier), unthrottled and at the default throttle;
- RSS over 50 saves.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(__file__))
from _common import (GB, GiB, Result, Scratch, copy_into, like, log, machine_note, state_bytes,  # noqa: E402
                     table, transformer_state)


def rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmRSS"))


def matmul_loop(n: int) -> float:
    import torch

    a = torch.randn(512, 512)
    b = torch.randn(512, 512)
    t0 = time.perf_counter()
    for _ in range(n):
        a = (a @ b) * 0.001
    return time.perf_counter() - t0


def bench_stall(state, scratch, repeats):
    from tierfs import CheckpointManager
    from tierfs.policies import LatestN
    from tierfs.tiers import MemoryTier

    nbytes = state_bytes(state)
    floor = Result("floor: copy_ into preallocated tensors", nbytes)
    dst = like(state)
    copy_into(dst, state)

    stall = Result("tierfs save: returns (stall)", nbytes)
    commit = Result("tierfs save: committed in RAM", nbytes)
    with CheckpointManager([MemoryTier(scratch.fresh("ram"), keep=LatestN(2))]) as mgr:
        for step in range(3):  # warm-up: buffers get pooled and reused
            mgr.save(step, state)
            mgr.wait_until_finished()
        for step in range(3, 3 + repeats):
            t0 = time.perf_counter()  # the floor right before each save: the machine is noisy
            copy_into(dst, state)
            floor.times.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            mgr.save(step, state)
            t1 = time.perf_counter()
            mgr.wait_until_finished()
            t2 = time.perf_counter()
            stall.times.append(t1 - t0)
            commit.times.append(t2 - t0)
    scratch.remove("ram")
    del dst
    return floor, stall, commit


def bench_dcp_async(state, scratch, repeats):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    nbytes = state_bytes(state)
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        dist.init_process_group("gloo", rank=0, world_size=1)
    rows = []
    configs = [("default", {})]
    try:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        # CPU only: no pinned memory, no non-blocking device copies; staging itself is asynchronous
        opts = StagingOptions(use_pinned_memory=False, use_shared_memory=False, use_async_staging=True,
                              use_non_blocking_copy=False)
        configs.append(("DefaultStager", {"async_stager": DefaultStager(opts)}))
    except ImportError:
        log("DefaultStager not available in this torch")
    for label, kw in configs:
        ret = Result(f"DCP async_save ({label}): returns", nbytes)
        done = Result(f"DCP async_save ({label}): complete", nbytes)
        for i in range(repeats + 1):
            d = scratch.fresh(f"dcp-{i % 2}")
            t0 = time.perf_counter()
            fut = dcp.async_save(state, checkpoint_id=d, **kw)
            t1 = time.perf_counter()
            getattr(fut, "upload_completion", fut).result()
            t2 = time.perf_counter()
            if i:  # the first is warm-up
                ret.times.append(t1 - t0)
                done.times.append(t2 - t0)
        rows += [ret, done]
        scratch.remove("dcp-0")
        scratch.remove("dcp-1")
    return rows


def bench_slowdown(state, scratch, disk_dir, repeats, iters):
    """A 1-thread matmul loop alone, then while a save's background work runs."""
    import torch

    from tierfs import CheckpointManager
    from tierfs.policies import LatestN
    from tierfs.tiers import MemoryTier, ObjectTier

    torch.set_num_threads(1)
    base = [matmul_loop(iters) for _ in range(repeats)]
    out = {"alone": statistics.median(base)}
    for label, kw in (("unthrottled", {"background_bandwidth": None}), ("default throttle", {})):
        loops, lands = [], []
        with CheckpointManager([MemoryTier(scratch.fresh("ram"), keep=LatestN(2)),
                                ObjectTier(f"file://{disk_dir}/{label.replace(' ', '-')}", keep=LatestN(1))],
                               **kw) as mgr:
            mgr.save(0, state)
            mgr.wait_until_finished()
            for step in range(1, repeats + 1):
                t0 = time.perf_counter()
                mgr.save(step, state)
                landed = threading.Event()
                waiter = threading.Thread(target=lambda: (mgr.wait_until_finished(), landed.set()))
                waiter.start()
                loops.append(matmul_loop(iters))
                waiter.join()
                lands.append(time.perf_counter() - t0)
        out[label] = statistics.median(loops)
        out[label + " lands"] = statistics.median(lands)
        scratch.remove("ram")
    torch.set_num_threads(os.cpu_count() or 1)
    return out


def bench_rss(size_gib: float, saves: int = 50) -> dict:
    """In a fresh process: RSS before the manager, after each save, and the RAM tier's bytes."""
    import json
    import subprocess

    out = subprocess.run([sys.executable, __file__, "--rss-child", "--size-gib", str(size_gib),
                          "--saves", str(saves)], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def rss_child(size_gib: float, saves: int) -> None:
    import json

    from tierfs import CheckpointManager
    from tierfs.policies import LatestN
    from tierfs.tiers import MemoryTier

    state = transformer_state(int(size_gib * GiB))
    scratch = Scratch("tierfs-bench-rss-")
    try:
        base = rss()
        series, tier_bytes = [], 0
        tier = MemoryTier(scratch.fresh("ram"), keep=LatestN(2))
        with CheckpointManager([tier]) as mgr:
            for step in range(saves):
                for t in state.values():
                    t.add_(1.0)  # training changes the state between saves
                mgr.save(step, state)
                series.append(rss())
                tier_bytes = max(tier_bytes, tier.capacity().used)
            mgr.wait_until_finished()
            series.append(rss())
        print(json.dumps({"base": base, "series": series, "tier": tier_bytes, "state": state_bytes(state)}))
    finally:
        scratch.cleanup()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-gib", type=float, default=2.0)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--iters", type=int, default=400, help="matmuls per training-loop measurement")
    ap.add_argument("--disk", default="/tmp", help="where the disk-backed file:// tier goes")
    ap.add_argument("--rss-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--saves", type=int, default=50, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rss_child:
        return rss_child(args.size_gib, args.saves)
    import tempfile

    print(f"machine: {machine_note()}\n")
    log(f"building a {args.size_gib} GiB state")
    state = transformer_state(int(args.size_gib * GiB))
    nbytes = state_bytes(state)
    scratch = Scratch("tierfs-bench-async-")
    disk = tempfile.mkdtemp(dir=args.disk, prefix="tierfs-bench-")
    try:
        log("stall and commit")
        floor, stall, commit = bench_stall(state, scratch, args.repeats)
        log("DCP async_save")
        dcp_rows = bench_dcp_async(state, scratch, args.repeats)
        rows = [floor, stall, commit] + dcp_rows
        print(table(f"Asynchronous save, {nbytes / GB:.2f} GB state", rows, floor))
        dcp_done = min(r.median for r in dcp_rows if "complete" in r.name)
        print("| target | value | goal | |\n|---|---|---|---|")
        print(f"| stall / floor | {stall.median / floor.median:.2f} | <= 1.15 | "
              f"{'MET' if stall.median / floor.median <= 1.15 else 'MISSED'} |")
        print(f"| committed in RAM / floor | {commit.median / floor.median:.2f} | <= 2.5 | "
              f"{'MET' if commit.median / floor.median <= 2.5 else 'MISSED'} |")
        print(f"| DCP complete / tierfs committed | {dcp_done / commit.median:.2f} | >= 4 | "
              f"{'MET' if dcp_done / commit.median >= 4 else 'MISSED'} |\n")

        log("training slowdown")
        slow = bench_slowdown(state, scratch, disk, args.repeats, args.iters)
        print("### Training-like loop (1-thread matmuls) while background work runs\n")
        print("| condition | loop s (median) | slowdown | step lands on the slow tier after (s) |")
        print("|---|---|---|---|")
        print(f"| alone | {slow['alone']:.3f} | - | - |")
        for label in ("unthrottled", "default throttle"):
            print(f"| {label} | {slow[label]:.3f} | {100 * (slow[label] / slow['alone'] - 1):+.1f}% | "
                  f"{slow[label + ' lands']:.2f} |")
        print()

        log("RSS over 50 saves (fresh process)")
        del state
        r = bench_rss(args.size_gib)
        series, gib = r["series"], [x / GiB for x in r["series"]]
        allowed = r["base"] + 0.1 * r["state"] + r["tier"]  # process with its state, +10%, + tier buffers
        print("### Host memory over 50 saves (fresh process)\n")
        print(f"- process with its state before the manager: {r['base'] / GiB:.2f} GiB (state "
              f"{r['state'] / GiB:.2f} GiB); RAM-tier files at their peak (kept steps + steps in flight + spare set): {r['tier'] / GiB:.2f} GiB")
        print(f"- RSS after saves 1, 10, 25, 50: {gib[0]:.2f}, {gib[9]:.2f}, {gib[24]:.2f}, {gib[49]:.2f} GiB; "
              f"peak {max(gib):.2f} GiB")
        print(f"- growth from save 10 to 50: {(series[49] - series[9]) / 2**20:+.1f} MiB")
        print(f"- peak / (process with state + 0.1 x state + tier buffers): {max(series) / allowed:.3f} "
              f"(target <= 1, i.e. peak <= 1.1 x state + buffers on top of the process) "
              f"{'MET' if max(series) <= allowed else 'MISSED'}")
        print("- RSS counts the RAM tier's mapped tmpfs pages (shared memory), so the buffers show up in it")
    finally:
        scratch.cleanup()
        import shutil

        shutil.rmtree(disk, ignore_errors=True)


if __name__ == "__main__":
    main()
