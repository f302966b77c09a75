"""DCP benchmark: ``dcp.save`` / ``dcp.load`` through tierfs's TieredWriter/TieredReader vs DCP's own
FileSystemWriter/Reader and FsspecWriter/Reader, all on /dev/shm.

    .venv/bin/python benchmarks/bench_dcp.py [--size-gib 2] [--repeats 5] [--procs 1]

* state: a fp32 "transformer" (_common.transformer_state, fixed seed). With ``--procs N`` (gloo on
  localhost) every rank holds ``size/N`` of distinct tensors (fqns prefixed ``r<rank>.``, so DCP does not
  deduplicate them) and saves/loads its own part; a timing is rank 0's, between barriers.
* tierfs: ``dcp.save(state, storage_writer=TieredWriter(store, step))`` with
  ``store = TieredStore([MemoryTier(/dev/shm/..., keep=LatestN(2))])`` (each rank its own node and RAM
  directory, as in the tests; ``--shared-ram``: one node, every rank shares one RAM directory), in
  steady state: 3 warm-up saves to new steps first, then every timed save to a new step (crc32c
  included). ``dcp.load(target, storage_reader=TieredReader(store))`` (newest step, every block verified).
* DCP: ``FileSystemWriter(dir, thread_count=2)`` and ``FsspecWriter("file://" + dir, thread_count=2)``,
  each timed save into a fresh directory; ``FileSystemReader(dir)`` / ``FsspecReader("file://" + dir)``.
* loads go into preallocated tensors (zeroed, untimed, before each repeat); the first load of each kind
  is checked bit-exact. Medians of ``--repeats``; ratios are by time vs FileSystemWriter/Reader.

Progress goes to stderr, the result tables (markdown) to stdout. Scratch dirs are removed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
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

    # ---------------------------------------------------------------- tierfs
    ram = os.path.join(root, "ram") if args.shared_ram else os.path.join(root, "ram", f"node{rank}")
    store = TieredStore([MemoryTier(ram, keep=LatestN(2))],
                        threads=args.threads)
    try:
        step = 0
        for _ in range(args.warmup):
            step += 1
            t, _ = clock(lambda: dcp.save(state, storage_writer=TieredWriter(store, step)))
            out["warm"].append(t)
            if rank == 0:
                log(f"tierfs warm-up save step {step}: {t:.3f}s")
        ts = out["save"]["tierfs"] = []
        for i in range(R):
            step += 1
            t, _ = clock(lambda: dcp.save(state, storage_writer=TieredWriter(store, step)))
            ts.append(t)
            if rank == 0:
                log(f"tierfs save {i + 1}/{R}: {t:.3f}s ({nbytes * world / t / GB:.2f} GB/s)")
        tl = out["load"]["tierfs"] = []
        for i in range(R):
            for v in target.values():
                v.zero_()
            reader = TieredReader(store)
            t, _ = clock(lambda: dcp.load(target, storage_reader=reader))
            tl.append(t)
            if i == 0:
                check("tierfs")
                out["sources"] = {str(k): v for k, v in reader.sources.items()}
            if rank == 0:
                log(f"tierfs load {i + 1}/{R}: {t:.3f}s ({nbytes * world / t / GB:.2f} GB/s) from step "
                    f"{reader._resolved_step}")
    finally:
        store.close()
    barrier()
    if rank == 0:
        import shutil
        shutil.rmtree(os.path.join(root, "ram"), ignore_errors=True)
    barrier()

    # ---------------------------------------------------------------- DCP's own writers
    makers = {"fs": (lambda d: FileSystemWriter(d, thread_count=2), lambda d: FileSystemReader(d)),
              "fsspec": (lambda d: FsspecWriter("file://" + d, thread_count=2), lambda d: FsspecReader("file://" + d))}
    for kind, (writer, reader) in makers.items():
        if kind in args.skip:
            continue
        import shutil
        ts = out["save"][kind] = []
        last = None
        for i in range(R):
            d = os.path.join(root, f"{kind}{i}")
            if rank == 0:
                if last is not None:
                    shutil.rmtree(last, ignore_errors=True)
                os.makedirs(d)
            barrier()
            last = d
            t, _ = clock(lambda: dcp.save(state, storage_writer=writer(d)))
            ts.append(t)
            if rank == 0:
                log(f"{kind} save {i + 1}/{R}: {t:.3f}s ({nbytes * world / t / GB:.2f} GB/s)")
        tl = out["load"][kind] = []
        for i in range(R):
            for v in target.values():
                v.zero_()
            t, _ = clock(lambda: dcp.load(target, storage_reader=reader(last)))
            tl.append(t)
            if i == 0:
                check(kind)
            if rank == 0:
                log(f"{kind} load {i + 1}/{R}: {t:.3f}s ({nbytes * world / t / GB:.2f} GB/s)")
        barrier()
        if rank == 0:
            shutil.rmtree(last, ignore_errors=True)
    return out


def child(args) -> int:
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        out = run(args, args.child_root, rank, world)
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
    ap.add_argument("--child-root", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    if args.child_root:
        return child(args)
    if args.warmup < 3:
        ap.error("--warmup must be at least 3 (buffers must be pooled and reused)")

    log(f"machine: {machine_note()}")
    scratch = Scratch("tierfs-bench-dcp-")
    try:
        out = run(args, scratch.root, 0, 1) if args.procs == 1 else launch(args, scratch.root)
    finally:
        scratch.cleanup()
        log(f"removed {scratch.root}")

    total = out["nbytes"] * args.procs
    names = dict(KINDS)
    print(f"## bench_dcp: {total / GiB:.3f} GiB state, {args.procs} process(es) x {out['nbytes'] / GiB:.3f} GiB "
          f"({out['tensors']} fp32 tensors each), {args.repeats} repeats, {args.warmup} tierfs warm-up saves\n")
    print(f"{machine_note()}\n")
    if args.procs > 1:
        where = "one node, one RAM directory shared by all ranks" if args.shared_ram else \
            "a node and RAM directory per rank"
        print(f"RAM tier: {where}; times are rank 0's between barriers; GB/s of the total state\n")
    ratios = {}
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
            print(f"| {r.name:<58} | {r.median:8.3f} | {r.gbps:5.2f} | {ratio:12.2f} | {fmt_times(r.times)} |")
        print()
    print(f"- tierfs warm-up saves (s): {fmt_times(out['warm'])}")
    print(f"- TieredReader sources (rank 0): {out.get('sources')}\n")
    if "save" in ratios and "fs" in out["save"]:
        print("### targets\n\n| target | value | goal | status |\n|---|---|---|---|")
        print(verdict("dcp.save TieredWriter vs FileSystemWriter (x faster)", ratios["save"], SAVE_TARGET))
        print(verdict("dcp.load TieredReader vs FileSystemReader (x faster)", ratios["load"], LOAD_TARGET))
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
