"""RAM-tier benchmark: tierfs save/restore on /dev/shm against the memcpy floor, torch.save and DCP.

    .venv/bin/python benchmarks/bench_ram.py [--size-gib 2] [--repeats 5]

One run, one process. The state is a ~2 GiB fp32 "transformer" (tensors of 16-64 MiB plus small
biases/norms, fixed seed). Timings are medians over ``--repeats``; GB/s is 1e9 bytes/s of state bytes.

* floor: ``copy_`` of every tensor into preallocated tensors of the same shapes (pages already faulted).
* tierfs save: ``TieredStore([MemoryTier(dir, keep=LatestN(2))]).save(step, state)`` in steady state,
  i.e. after warm-up saves so the tier reuses its pooled, mapped buffers; crc32c checksums included.
  The first (cold) save is reported on its own.
* torch.save to a file on /dev/shm; DCP ``FileSystemWriter(thread_count=2)`` via ``dcp.save`` (single
  process, no process group), each repeat into a fresh directory.
* restore: floor again, ``store.restore_into(state_like)`` (every checksum verified), ``torch.load``
  (default and ``mmap=True`` + ``copy_``), ``dcp.load`` in place with ``FileSystemReader``.

Progress goes to stderr, the result tables (markdown) to stdout. Scratch dirs are removed at the end.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import (GB, GiB, Result, Scratch, copy_into, like, log, machine_note, mem_available,  # noqa: E402
                     fmt_times, prefault, rss_gib, same, state_bytes, table, timed, transformer_state, verdict)

SAVE_TARGET = 0.45
RESTORE_TARGET = 0.45


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gib", type=float, default=2.0, help="state size in GiB (default 2)")
    ap.add_argument("--repeats", type=int, default=5, help="timed repeats per operation (default 5)")
    ap.add_argument("--warmup", type=int, default=3,
                    help="tierfs warm-up saves after the cold one, before timing (default 3, at least 3)")
    ap.add_argument("--threads", type=int, default=None, help="TieredStore(threads=...) (default: tierfs's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prefault-gib", type=float, default=-1,
                    help="touch and free this much fresh memory first so the VM backs it (default: about 6x the "
                         "state, capped by free memory; 0 = off); see _common.prefault")
    ap.add_argument("--skip-baselines", action="store_true", help="only floor and tierfs (quick checks)")
    args = ap.parse_args(argv)
    if args.warmup < 3:
        ap.error("--warmup must be at least 3 (buffers must be pooled and reused)")

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

    from tierfs import TieredStore
    from tierfs.policies import LatestN
    from tierfs.tiers import MemoryTier

    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
    warnings.filterwarnings("ignore", category=FutureWarning)

    log(f"machine: {machine_note()}")
    log(f"building a {args.size_gib} GiB fp32 state (seed {args.seed})")
    state = transformer_state(int(args.size_gib * GiB), seed=args.seed)
    nbytes = state_bytes(state)
    sizes = sorted(t.nbytes for t in state.values())
    big = [s for s in sizes if s >= (1 << 20)]
    log(f"state: {len(state)} tensors, {nbytes / GiB:.3f} GiB ({nbytes / GB:.3f} GB); {len(big)} of "
        f"{big[0] >> 20}-{big[-1] >> 20} MiB, {len(sizes) - len(big)} small ({sizes[0]}-{max(s for s in sizes if s < 1 << 20)} B)")

    pf = int(args.prefault_gib * GiB) if args.prefault_gib >= 0 else min(6 * nbytes, mem_available() - 4 * GiB)
    prefault_note = "off"
    if pf >= GiB:
        log(f"pre-faulting {pf / GiB:.1f} GiB of fresh memory (VM first touch)")
        rate = prefault(pf)
        prefault_note = f"{pf // GiB} GiB touched and freed first at {rate:.2f} GB/s"
        log(prefault_note)

    scratch = Scratch("tierfs-bench-ram-")
    R = args.repeats
    res: dict[str, Result] = {}

    def r(key: str, name: str) -> Result:
        res[key] = Result(name, nbytes)
        return res[key]

    store = None
    try:
        # ---------------------------------------------------------------- save: floor and tierfs
        dst = like(state)
        store = TieredStore([MemoryTier(scratch.path("ram"), keep=LatestN(2))], threads=args.threads)
        step = 0
        t, _ = timed(lambda: store.save(step, state))
        r("cold", "tierfs save, first (cold) save").times.append(t)
        log(f"tierfs cold save: {t:.3f}s ({nbytes / t / GB:.2f} GB/s)")
        warm = []
        for _ in range(args.warmup):
            step += 1
            t, _ = timed(lambda: store.save(step, state))
            warm.append(t)
            log(f"tierfs warm-up save step {step}: {t:.3f}s ({nbytes / t / GB:.2f} GB/s)")
        for _ in range(2):  # untimed: the floor's first copies into fresh tensors are not representative
            copy_into(dst, state)
        floor_s, tier_s = r("floor_save", "floor: copy_ into preallocated"), r("tier_save", "tierfs save (steady)")
        for i in range(R):
            t, _ = timed(lambda: copy_into(dst, state))
            floor_s.times.append(t)
            step += 1
            t2, _ = timed(lambda: store.save(step, state))
            tier_s.times.append(t2)
            log(f"save repeat {i + 1}/{R}: floor {t:.3f}s, tierfs step {step} {t2:.3f}s "
                f"({nbytes / t2 / GB:.2f} GB/s, {t / t2:.2f}x floor)")
        del dst
        gc.collect()

        # ---------------------------------------------------------------- restore: floor and tierfs
        target = like(state)
        for _ in range(2):
            copy_into(target, state)
        floor_r, tier_r = r("floor_restore", "floor: copy_ from preallocated"), r("tier_restore",
                                                                                 "tierfs restore_into")
        for i in range(R):
            t, _ = timed(lambda: copy_into(target, state))
            floor_r.times.append(t)
            for v in target.values():  # not timed: make sure restore really writes every byte
                v.zero_()
            t2, info = timed(lambda: store.restore_into(target))
            tier_r.times.append(t2)
            if i == 0 and not same(target, state):
                raise AssertionError("tierfs restore_into produced different bytes")
            log(f"restore repeat {i + 1}/{R}: floor {t:.3f}s, tierfs {t2:.3f}s from {info.tier} step {info.step} "
                f"({nbytes / t2 / GB:.2f} GB/s, {t / t2:.2f}x floor)")
        log(f"RSS {rss_gib():.1f} GiB; closing the tierfs store")
        store.close()
        store = None
        scratch.remove("ram")
        gc.collect()

        if not args.skip_baselines:
            # ------------------------------------------------------------ torch.save / torch.load
            ts, tl, tm = (r("torch_save", "torch.save to /dev/shm"), r("torch_load", "torch.load"),
                          r("torch_mmap", "torch.load(mmap=True) + copy_"))
            path = scratch.path("state.pt")
            for i in range(R):
                scratch.remove("state.pt")
                t, _ = timed(lambda: torch.save(state, path))
                ts.times.append(t)
                log(f"torch.save repeat {i + 1}/{R}: {t:.3f}s ({nbytes / t / GB:.2f} GB/s)")
            for i in range(R):
                t, loaded = timed(lambda: torch.load(path))
                tl.times.append(t)
                if i == 0 and not same(loaded, state):
                    raise AssertionError("torch.load produced different bytes")
                del loaded
                gc.collect()
                log(f"torch.load repeat {i + 1}/{R}: {t:.3f}s ({nbytes / t / GB:.2f} GB/s)")

            def mmap_load():
                m = torch.load(path, mmap=True)
                copy_into(target, m)
                del m

            for i in range(R):
                for v in target.values():
                    v.zero_()
                t, _ = timed(mmap_load)
                tm.times.append(t)
                if i == 0 and not same(target, state):
                    raise AssertionError("torch.load(mmap=True) + copy_ produced different bytes")
                log(f"torch.load(mmap) + copy_ repeat {i + 1}/{R}: {t:.3f}s ({nbytes / t / GB:.2f} GB/s)")
            scratch.remove("state.pt")
            gc.collect()

            # ------------------------------------------------------------ DCP FileSystemWriter / Reader
            ds, dl = r("dcp_save", "dcp.save FileSystemWriter(thread_count=2)"), r("dcp_load",
                                                                                  "dcp.load FileSystemReader")
            last = None
            for i in range(R):
                if last is not None:
                    scratch.remove(last)
                last = f"dcp{i}"
                d = scratch.fresh(last)
                t, _ = timed(lambda: dcp.save(state, storage_writer=FileSystemWriter(d, thread_count=2)))
                ds.times.append(t)
                log(f"dcp.save repeat {i + 1}/{R}: {t:.3f}s ({nbytes / t / GB:.2f} GB/s)")
            d = scratch.path(last)
            for i in range(R):
                for v in target.values():
                    v.zero_()
                t, _ = timed(lambda: dcp.load(target, storage_reader=FileSystemReader(d)))
                dl.times.append(t)
                if i == 0 and not same(target, state):
                    raise AssertionError("dcp.load produced different bytes")
                log(f"dcp.load repeat {i + 1}/{R}: {t:.3f}s ({nbytes / t / GB:.2f} GB/s)")
            scratch.remove(last)
    finally:
        if store is not None:
            try:
                store.close()
            except Exception as e:  # noqa: BLE001
                log(f"closing the store failed: {e}")
        scratch.cleanup()
        log(f"removed {scratch.root}")

    # -------------------------------------------------------------------- report
    save_rows = [res[k] for k in ("floor_save", "cold", "tier_save", "torch_save", "dcp_save") if k in res]
    restore_rows = [res[k] for k in ("floor_restore", "tier_restore", "torch_load", "torch_mmap", "dcp_load")
                    if k in res]
    head = (f"## bench_ram: {nbytes / GiB:.3f} GiB state ({len(state)} fp32 tensors), {R} repeats, "
            f"{args.warmup} warm-up saves after the cold one\n\n{machine_note()}\n")
    print(head)
    print(table("save (to /dev/shm)", save_rows, res["floor_save"], extra={
        "tierfs warm-up saves after the cold one (s)": fmt_times(warm) + "  (with LatestN(2) the first 3 saves "
        "allocate new tmpfs files; reuse of pooled buffers starts with the 4th)",
        "pre-fault": prefault_note}))
    print(table("restore (from /dev/shm, into existing tensors unless noted)", restore_rows, res["floor_restore"]))
    save_ratio = res["tier_save"].gbps / res["floor_save"].gbps
    restore_ratio = res["tier_restore"].gbps / res["floor_restore"].gbps
    print("### targets\n\n| target | value | goal | status |\n|---|---|---|---|")
    print(verdict("tierfs save (steady) / floor", save_ratio, SAVE_TARGET))
    print(verdict("tierfs restore_into / floor", restore_ratio, RESTORE_TARGET))
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
