"""DCP benchmark: ``dcp.save`` / ``dcp.load`` through tierfs's TieredWriter/TieredReader vs DCP's own
FileSystemWriter/Reader and FsspecWriter/Reader, all on /dev/shm.

    .venv/bin/python benchmarks/bench_dcp.py [--size-gib 2] [--repeats 5] [--procs 1]
    .venv/bin/python benchmarks/bench_dcp.py --stall [--size-gib 2] [--procs 1]

* state: a fp32 "transformer" (_common.transformer_state, fixed seed). With ``--procs N`` (gloo on
  localhost) every rank holds ``size/N`` of distinct tensors (fqns prefixed ``r<rank>.``, so DCP does not
  deduplicate them) and saves/loads its own part; a timing is rank 0's, between barriers.
* tierfs: ``dcp.save(state, storage_writer=TieredWriter(store, step))`` with
  ``store = TieredStore([MemoryTier(/dev/shm/..., keep=LatestN(1))])`` (each rank its own node and RAM
  directory, as in the tests; ``--shared-ram``: one node, every rank shares one RAM directory), in
  steady state: 3 warm-up saves to new steps first, then every timed save to a new step (crc32c
  included). ``dcp.load(target, storage_reader=TieredReader(store))`` (newest step, every block verified).
* DCP: ``FileSystemWriter(dir, thread_count=2)`` and ``FsspecWriter("file://" + dir, thread_count=2)``,
  each timed save into a fresh directory; ``FileSystemReader(dir)`` / ``FsspecReader("file://" + dir)``.
* loads go into preallocated tensors (zeroed, untimed, before each repeat); the first load of each kind
  is checked bit-exact. Medians of ``--repeats``; ratios are by time vs FileSystemWriter/Reader.
* the kinds run interleaved: ``--repeats`` rounds of saves, each round one save of every kind, then rounds
  of loads likewise, so every kind sees the same minutes of this shared machine; the ratio of the medians
  and the median of the per-round ratios are both reported.
* ``--stall``: how long an asynchronous save of torch state holds the training thread, in rounds after
  warm-up rounds: ``CheckpointManager.save`` (``dcp.save`` with ``TieredWriter(blocking=False)``),
  ``dcp.async_save`` with ``TieredWriter`` (DCP's stager copies the state, then a DCP thread saves it),
  ``store.save(blocking=False)`` (no DCP) and the floor, ``copy_`` into preallocated tensors; plus when the
  step is committed in RAM.

Progress goes to stderr, the result tables (markdown) to stdout. Scratch dirs are removed at the end.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import (GB, GiB, Result, Scratch, fmt_times, like, log, machine_note, same,  # noqa: E402
                     state_bytes, timed, transformer_state, verdict)

SAVE_TARGET = 3.0   # x FileSystemWriter(thread_count=2)
LOAD_TARGET = 2.5   # x FileSystemReader

KINDS = [("tierfs", "TieredWriter / TieredReader"),
         ("fs", "FileSystemWriter(thread_count=2) / FileSystemReader"),
         ("fsspec", "FsspecWriter(file://, thread_count=2) / FsspecReader")]


def run(args, root: str, rank: int, world: int) -> dict:
    """The measurements of one rank; ``root`` is a scratch dir shared by every rank."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    from tierfs import TieredStore
    from tierfs.adapters.dcp import TieredReader, TieredWriter
    from tierfs.policies import LatestN
    from tierfs.tiers import MemoryTier

    def barrier():
        if world > 1:
            dist.barrier()

    def clock(fn):
        barrier()
        t, out = timed(fn)
        barrier()
        return t, out

    size = int(args.size_gib * GiB / world)
    part = transformer_state(size, seed=args.seed + rank)
    state = {f"r{rank}.{k}": v for k, v in part.items()} if world > 1 else part
    nbytes = state_bytes(state)
    if rank == 0:
        log(f"rank 0 state: {len(state)} tensors, {nbytes / GiB:.3f} GiB; {world} process(es)")
    R = args.repeats
    out: dict = {"nbytes": nbytes, "tensors": len(state), "save": {}, "load": {}, "warm": []}
    target = like(state)

    def check(kind: str) -> None:
        if not same(target, state):
            raise AssertionError(f"{kind}: dcp.load produced different bytes")

    # Saves, then loads, in rounds: each round runs every kind once, so all kinds see the same minute of this
    # shared machine (the same copy runs at 5 or 18 GB/s depending on the minute)
    import shutil

    ram = os.path.join(root, "ram") if args.shared_ram else os.path.join(root, "ram", f"node{rank}")
    store = TieredStore([MemoryTier(ram, keep=LatestN(1))], threads=args.threads)  # memory: the machine is shared
    makers = {"fs": (lambda d: FileSystemWriter(d, thread_count=2), lambda d: FileSystemReader(d)),
              "fsspec": (lambda d: FsspecWriter("file://" + d, thread_count=2), lambda d: FsspecReader("file://" + d))}
    kinds = [k for k in makers if k not in args.skip]
    last: dict[str, str] = {}
    try:
        step = 0
        for _ in range(args.warmup):
            step += 1
            t, _ = clock(lambda: dcp.save(state, storage_writer=TieredWriter(store, step)))
            out["warm"].append(t)
            if rank == 0:
                log(f"tierfs warm-up save step {step}: {t:.3f}s")
        for k in ["tierfs", *kinds]:
            out["save"][k], out["load"][k] = [], []
        for i in range(R):
            step += 1
            t, _ = clock(lambda: dcp.save(state, storage_writer=TieredWriter(store, step)))
            out["save"]["tierfs"].append(t)
            if rank == 0:
                log(f"round {i + 1}/{R}: tierfs save {t:.3f}s ({nbytes * world / t / GB:.2f} GB/s)")
            for kind in kinds:
                d = os.path.join(root, f"{kind}{i}")
                if rank == 0:
                    if kind in last:
                        shutil.rmtree(last[kind], ignore_errors=True)
                    os.makedirs(d)
                barrier()
                last[kind] = d
                t, _ = clock(lambda: dcp.save(state, storage_writer=makers[kind][0](d)))
                out["save"][kind].append(t)
                if rank == 0:
                    log(f"round {i + 1}/{R}: {kind} save {t:.3f}s ({nbytes * world / t / GB:.2f} GB/s)")
        for i in range(R):
            for kind in ["tierfs", *kinds]:
                for v in target.values():
                    v.zero_()
                reader = TieredReader(store) if kind == "tierfs" else makers[kind][1](last[kind])
                t, _ = clock(lambda: dcp.load(target, storage_reader=reader))
                out["load"][kind].append(t)
                if i == 0:
                    check(kind)
                    if kind == "tierfs":
                        out["sources"] = {str(k): v for k, v in reader.sources.items()}
                if rank == 0:
                    log(f"round {i + 1}/{R}: {kind} load {t:.3f}s ({nbytes * world / t / GB:.2f} GB/s)")
    finally:
        store.close()
        barrier()
        if rank == 0:
            shutil.rmtree(os.path.join(root, "ram"), ignore_errors=True)
            for d in last.values():
                shutil.rmtree(d, ignore_errors=True)
        barrier()
    return out


def run_stall(args, root: str, rank: int, world: int) -> dict:
    """How long the training thread is held by an asynchronous save of torch state, three ways."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from tierfs import CheckpointManager
    from tierfs.adapters.dcp import TieredWriter
    from tierfs.policies import LatestN
    from tierfs.tiers import MemoryTier

    def barrier():
        if world > 1:
            dist.barrier()

    size = int(args.size_gib * GiB / world)
    part = transformer_state(size, seed=args.seed + rank)
    state = {f"r{rank}.{k}": v for k, v in part.items()} if world > 1 else part
    nbytes = state_bytes(state)
    floor_dst = like(state)
    ram = os.path.join(root, "ram", f"node{rank}")
    mgr = CheckpointManager([MemoryTier(ram, keep=LatestN(2))], threads=args.threads)
    store = mgr.store
    out: dict = {"nbytes": nbytes, "tensors": len(state), "stall": {k: [] for k, _ in STALL_KINDS},
                 "complete": {k: [] for k, _ in STALL_KINDS}}
    step = 0

    def once(kind: str) -> tuple[float, float]:
        nonlocal step
        step += 1
        barrier()
        gc.collect()  # outside the timing
        t0 = time.perf_counter()
        if kind == "floor":
            for k, t in floor_dst.items():
                t.copy_(state[k])
            t1 = time.perf_counter()
        elif kind == "store":
            store.save(step, state, blocking=False)
            t1 = time.perf_counter()
            store.wait_until_finished()
        elif kind == "manager":
            mgr.save(step, state)
            t1 = time.perf_counter()
            mgr.wait_until_finished()
        else:
            fut = dcp.async_save(state, storage_writer=TieredWriter(store, step))
            t1 = time.perf_counter()
            (fut.upload_completion if hasattr(fut, "upload_completion") else fut).result()
            store.wait_until_finished()
        t2 = time.perf_counter()
        barrier()
        return t1 - t0, t2 - t0

    try:
        for _ in range(args.warmup):
            for kind, _ in STALL_KINDS:
                once(kind)
        for i in range(args.repeats):
            for kind, _ in STALL_KINDS:
                stall, complete = once(kind)
                out["stall"][kind].append(stall)
                out["complete"][kind].append(complete)
                if rank == 0:
                    log(f"round {i + 1}/{args.repeats}: {kind}: returns after {stall:.3f}s, committed after "
                        f"{complete:.3f}s")
    finally:
        mgr.close()
        barrier()
        if rank == 0:
            import shutil
            shutil.rmtree(os.path.join(root, "ram"), ignore_errors=True)
    return out


STALL_KINDS = [("floor", "floor: copy_ into preallocated tensors"),
               ("store", "store.save(blocking=False) (no DCP)"),
               ("manager", "CheckpointManager.save: dcp.save + TieredWriter(blocking=False)"),
               ("async_save", "dcp.async_save + TieredWriter (blocking)")]


def child(args) -> int:
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        out = (run_stall if args.stall else run)(args, args.child_root, rank, world)
    finally:
        dist.destroy_process_group()
    print(json.dumps({"rank": rank, **out}), flush=True)
    return 0


def launch(args, root: str) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    here = os.path.dirname(os.path.abspath(__file__))
    procs = []
    for rank in range(args.procs):
        env = os.environ | {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                            "WORLD_SIZE": str(args.procs), "LOCAL_RANK": str(rank if args.shared_ram else 0),
                            "TIERFS_NODE_RANK": str(0 if args.shared_ram else rank),
                            "PYTHONPATH": os.path.dirname(here)}
        cmd = [sys.executable, os.path.abspath(__file__), "--child-root", root, "--size-gib", str(args.size_gib),
               "--repeats", str(args.repeats), "--warmup", str(args.warmup), "--seed", str(args.seed)]
        cmd += [f"--skip={k}" for k in args.skip] + (["--shared-ram"] if args.shared_ram else [])
        cmd += ["--stall"] if args.stall else []
        if args.threads is not None:
            cmd += ["--threads", str(args.threads)]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, env=env, text=True))
    outs = []
    for p in procs:
        o, _ = p.communicate()
        if p.returncode != 0:
            raise RuntimeError(f"a benchmark process failed (exit {p.returncode})")
        outs.append(json.loads(o.strip().splitlines()[-1]))
    return sorted(outs, key=lambda o: o["rank"])[0]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gib", type=float, default=2.0, help="total state size in GiB (default 2)")
    ap.add_argument("--procs", type=int, default=1, help="processes (gloo); each holds size/procs (default 1)")
    ap.add_argument("--repeats", type=int, default=5, help="timed repeats per operation (default 5)")
    ap.add_argument("--warmup", type=int, default=3, help="tierfs warm-up saves before timing (default 3)")
    ap.add_argument("--threads", type=int, default=None, help="TieredStore(threads=...) (default: tierfs's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip", action="append", default=[], choices=["fs", "fsspec"],
                    help="leave out a baseline (quick checks)")
    ap.add_argument("--shared-ram", action="store_true",
                    help="with --procs: all ranks on one tierfs node sharing one RAM directory (default: a node "
                         "and RAM directory per rank)")
    ap.add_argument("--stall", action="store_true",
                    help="instead: how long an asynchronous save holds the training thread (manager through DCP "
                         "vs dcp.async_save vs store.save vs the copy floor)")
    ap.add_argument("--child-root", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    if args.child_root:
        return child(args)
    if args.warmup < 3:
        ap.error("--warmup must be at least 3 (buffers must be pooled and reused)")

    log(f"machine: {machine_note()}")
    load_before = os.getloadavg()
    scratch = Scratch("tierfs-bench-dcp-")
    try:
        if args.procs == 1:
            out = (run_stall if args.stall else run)(args, scratch.root, 0, 1)
        else:
            out = launch(args, scratch.root)
    finally:
        scratch.cleanup()
        log(f"removed {scratch.root}")
    load = (f"load average (1, 5, 15 min) at the start {' '.join(f'{x:.2f}' for x in load_before)}, at the end "
            f"{' '.join(f'{x:.2f}' for x in os.getloadavg())} (other users of this 2-CPU machine included)")
    if args.stall:
        return report_stall(args, out, load)

    total = out["nbytes"] * args.procs
    names = dict(KINDS)
    print(f"## bench_dcp: {total / GiB:.3f} GiB state, {args.procs} process(es) x {out['nbytes'] / GiB:.3f} GiB "
          f"({out['tensors']} fp32 tensors each), {args.repeats} repeats, {args.warmup} tierfs warm-up saves\n")
    print(f"{machine_note()}; {load}\n")
    if args.procs > 1:
        where = "one node, one RAM directory shared by all ranks" if args.shared_ram else \
            "a node and RAM directory per rank"
        print(f"RAM tier: {where}; times are rank 0's between barriers; GB/s of the total state\n")
    ratios, paired = {}, {}
    for op, base in (("save", "fs"), ("load", "fs")):
        rows = {k: Result(f"dcp.{op} {names[k].split(' / ')[0 if op == 'save' else 1]}", total, out[op][k])
                for k, _ in KINDS if k in out[op]}
        print(f"### dcp.{op} ({'to' if op == 'save' else 'from'} /dev/shm"
              f"{', into preallocated tensors' if op == 'load' else ''})\n")
        print(f"| {'operation':<58} | median s | GB/s  | x FileSystem | repeats (s) |")
        print("|---|---|---|---|---|")
        for k, r in rows.items():
            ratio = statistics.median(out[op][base]) / r.median if base in rows else float("nan")
            if k == "tierfs":
                ratios[op] = ratio
                if base in out[op]:
                    paired[op] = [b / t for b, t in zip(out[op][base], out[op][k])]
            print(f"| {r.name:<58} | {r.median:8.3f} | {r.gbps:5.2f} | {ratio:12.2f} | {fmt_times(r.times)} |")
        print()
    for op in paired:
        print(f"- dcp.{op}: FileSystem time / tierfs time per round: {fmt_times(paired[op])} "
              f"(median {statistics.median(paired[op]):.2f})")
    print(f"- tierfs warm-up saves (s): {fmt_times(out['warm'])}")
    print(f"- TieredReader sources (rank 0): {out.get('sources')}\n")
    if "save" in ratios and "fs" in out["save"]:
        print("### targets\n\n| target | value | goal | status |\n|---|---|---|---|")
        print(verdict("dcp.save TieredWriter vs FileSystemWriter (x faster, ratio of medians)", ratios["save"],
                      SAVE_TARGET))
        print(verdict("dcp.save, median of per-round ratios", statistics.median(paired["save"]), SAVE_TARGET))
        print(verdict("dcp.load TieredReader vs FileSystemReader (x faster, ratio of medians)", ratios["load"],
                      LOAD_TARGET))
        print(verdict("dcp.load, median of per-round ratios", statistics.median(paired["load"]), LOAD_TARGET))
        print()
    return 0


def report_stall(args, out: dict, load: str) -> int:
    total = out["nbytes"] * args.procs
    print(f"## bench_dcp --stall: {total / GiB:.3f} GiB state, {args.procs} process(es) x "
          f"{out['nbytes'] / GiB:.3f} GiB ({out['tensors']} fp32 tensors each), {args.repeats} rounds after "
          f"{args.warmup} warm-up rounds\n")
    print(f"{machine_note()}; {load}\n")
    print("Each round runs every kind once (a new step each); times are rank 0's. 'returns': the training "
          "thread is free; 'committed': the step is committed in RAM (checksums, manifest, marker).\n")
    floor = statistics.median(out["stall"]["floor"])
    print(f"| {'operation':<62} | returns (median s) | x floor | committed (median s) | returns, repeats (s) |")
    print("|---|---|---|---|---|")
    for k, name in STALL_KINDS:
        st_, co = statistics.median(out["stall"][k]), statistics.median(out["complete"][k])
        print(f"| {name:<62} | {st_:18.3f} | {st_ / floor:7.2f} | {co:20.3f} | {fmt_times(out['stall'][k])} |")
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
