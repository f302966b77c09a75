"""Object-tier benchmark: tierfs persist and restore over S3 (a moto server) against raw s3fs and DCP.

    .venv/bin/python benchmarks/bench_object.py [--size-mib 256] [--tensors 16] [--repeats 3]

One run, one process. moto's S3 server runs in a thread of this process on 127.0.0.1 (as in
tests/conftest.py) behind a small WSGI byte counter, so "bytes moved" is what crossed the wire, whatever
the client did (ranged reads, read-ahead, retries). moto is reset (POST /moto-api/reset) between configs.

* raw s3fs: ``fs.pipe({path: bytes, ...})`` of 8 x 32 MiB objects (the best configuration measured in the
  brief), 16 x 16 MiB, and ``fs.pipe_file`` of one 256 MiB object (multipart) for reference.
* DCP: ``dcp.save`` with ``FsspecWriter("s3://...", endpoint_url=..., key=..., secret=...)`` and no
  ``checkpoint_id`` (a checkpoint_id makes the writer rebuild its filesystem from the URL alone and drop
  ``endpoint_url``); then ``dcp.load`` in place with ``FsspecReader``; bytes read counted.
* tierfs: ``TieredStore([MemoryTier(shm), ObjectTier("s3://bucket/run", storage_options)])``, time from the
  ``save`` call to ``wait_until_finished()`` returning (the RAM commit plus the background upload),
  after ``--warmup`` persists so the RAM tier is in steady state. Each timed persist is paired with an
  upload of the best raw config right before it (the machine is noisy; pairs see the same conditions);
  then ``store.restore(tiers=["s3"])`` with bytes read counted. The previous step is deleted from S3
  (untimed) before each timed save so moto's memory stays bounded.

Progress goes to stderr, result tables (markdown) to stdout.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import (GB, MiB, MotoS3, Result, Scratch, flat_state, like, log, machine_note,  # noqa: E402
                     same, state_bytes, table, timed, verdict)

PERSIST_TARGET = 0.9  # tierfs persist GB/s / best raw s3fs GB/s
READ_TARGET = 1.05  # bytes read per restore / step bytes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mib", type=int, default=256, help="state size in MiB (default 256)")
    ap.add_argument("--tensors", type=int, default=16, help="number of fp32 tensors (default 16)")
    ap.add_argument("--repeats", type=int, default=3, help="timed repeats per operation (default 3)")
    ap.add_argument("--bucket", default="tierfs-bench")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup", type=int, default=3,
                    help="tierfs persists before timing (default 3: with LatestN(2) the RAM tier reuses "
                         "pooled buffers from the 4th save on)")
    ap.add_argument("--skip-dcp", action="store_true")
    args = ap.parse_args(argv)

    import s3fs
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    from tierfs import TieredStore
    from tierfs.format import DEFAULT_FILE_SIZE
    from tierfs.policies import LatestN
    from tierfs.tiers import MemoryTier, ObjectTier

    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
    warnings.filterwarnings("ignore", category=FutureWarning)

    R, bucket = args.repeats, args.bucket
    log(f"machine: {machine_note()}")
    state = flat_state(args.tensors, args.size_mib * MiB // args.tensors, seed=args.seed)
    nbytes = state_bytes(state)
    log(f"state: {len(state)} fp32 tensors, {nbytes / MiB:.0f} MiB ({nbytes / GB:.3f} GB)")
    blob = torch.cat([t.view(torch.uint8) for t in state.values()]).numpy().tobytes()  # incompressible bytes

    moto = MotoS3()
    log(f"moto S3 server at {moto.endpoint} (in-process thread)")
    opts = dict(moto.options)
    scratch = Scratch("tierfs-bench-object-")
    res: dict[str, Result] = {}
    wire: dict[str, dict] = {}  # per config: the byte counter's snapshot of the last repeat
    store = None
    stores: dict = {}

    def r(key: str, name: str, n: int = nbytes) -> Result:
        res[key] = Result(name, n)
        return res[key]

    try:
        # ---------------------------------------------------------------- raw s3fs uploads
        def raw(key: str, name: str, n_obj: int) -> None:
            res_ = r(key, name)
            size = nbytes // n_obj
            for i in range(R):
                moto.reset(bucket)
                fs = s3fs.S3FileSystem(**opts)
                if n_obj == 1:
                    fn = lambda: fs.pipe_file(f"{bucket}/raw/one.bin", blob)  # noqa: E731
                else:
                    files = {f"{bucket}/raw/part{j:02d}.bin": blob[j * size:(j + 1) * size] for j in range(n_obj)}
                    fn = lambda: fs.pipe(files)  # noqa: E731
                t, _ = timed(fn)
                res_.times.append(t)
                wire[key] = moto.counter.snapshot()
                del fn
                log(f"{name} repeat {i + 1}/{R}: {t:.2f}s ({nbytes / t / GB:.3f} GB/s)")

        raw("pipe8", f"s3fs pipe 8 x {nbytes // 8 // MiB} MiB", 8)
        raw("pipe16", f"s3fs pipe 16 x {nbytes // 16 // MiB} MiB", 16)
        raw("pipe1", f"s3fs pipe_file 1 x {nbytes // MiB} MiB", 1)
        best_raw = max((res[k] for k in ("pipe8", "pipe16", "pipe1")), key=lambda x: x.gbps)
        log(f"best raw s3fs config: {best_raw.name}, {best_raw.gbps:.3f} GB/s")

        # ---------------------------------------------------------------- DCP FsspecWriter / FsspecReader
        dcp_read_bytes: dict[int, int] = {}
        if not args.skip_dcp:
            target = like(state)
            for tc in (1, 8):
                key = f"dcp_save_tc{tc}"
                res_ = r(key, f"dcp.save FsspecWriter(thread_count={tc})")
                for i in range(R):
                    moto.reset(bucket)
                    url = f"s3://{bucket}/dcp/tc{tc}-r{i}"
                    # endpoint_url etc. go to the writer; no checkpoint_id, or dcp.save's reset(checkpoint_id)
                    # rebuilds the filesystem from the URL alone and the endpoint is lost.
                    t, _ = timed(lambda: dcp.save(state, storage_writer=FsspecWriter(url, thread_count=tc, **opts)))
                    res_.times.append(t)
                    wire[key] = moto.counter.snapshot()
                    log(f"dcp.save FsspecWriter tc={tc} repeat {i + 1}/{R}: {t:.2f}s ({nbytes / t / GB:.3f} GB/s)")
                key = f"dcp_load_tc{tc}"
                res_ = r(key, f"dcp.load FsspecReader, saved with thread_count={tc}")
                reads = []
                for i in range(R):
                    for v in target.values():
                        v.zero_()
                    moto.counter.reset()
                    t, _ = timed(lambda: dcp.load(target, storage_reader=FsspecReader(url, **opts)))
                    snap = moto.counter.snapshot()
                    res_.times.append(t)
                    reads.append(snap)
                    if i == 0 and not same(target, state):
                        raise AssertionError("dcp.load from S3 produced different bytes")
                    log(f"dcp.load FsspecReader (tc={tc} checkpoint) repeat {i + 1}/{R}: {t:.2f}s "
                        f"({nbytes / t / GB:.3f} GB/s); GET bytes {snap['sent'].get('GET', 0) / nbytes:.3f}x state "
                        f"in {snap['requests'].get('GET', 0)} GETs")
                wire[key] = reads[-1]
                dcp_read_bytes[tc] = sorted(s["sent"].get("GET", 0) for s in reads)[len(reads) // 2]
            del target
            gc.collect()

        # ---------------------------------------------------------------- tierfs persist
        # Paired repeats: each round uploads the best raw config and persists with tierfs, in alternating
        # order, so both see the same (noisy) conditions. A second store whose shard files have the size of
        # the best raw config's objects shows how much of any gap is object size rather than tierfs.
        moto.reset(bucket)
        n_best = {"pipe8": 8, "pipe16": 16, "pipe1": 1}[next(k for k, v in res.items() if v is best_raw)]
        size = nbytes // n_best
        variants = {"persist": None}
        if size != DEFAULT_FILE_SIZE and size >= MiB:
            variants["persist_fs"] = size
        for key, fsize in variants.items():
            # uncapped: this measures what the tier can move (the default background cap is 256 MB/s)
            kw = {"background_bandwidth": None} | ({} if fsize is None else {"file_size": fsize})
            stores[key] = TieredStore([MemoryTier(scratch.path(f"ram-{key}"), keep=LatestN(2)),
                                       ObjectTier(f"s3://{bucket}/{key}", storage_options=opts)], **kw)
        store = stores["persist"]
        obj_name = store.tiers[1].name
        r("persist", f"tierfs save -> wait_until_finished ({DEFAULT_FILE_SIZE // MiB} MiB files)")
        r("persist_ret", "tierfs save returns")
        r("persist_bg", "tierfs background upload (wait - return)")
        if "persist_fs" in variants:
            r("persist_fs", f"tierfs, TieredStore(file_size={size // MiB} MiB)")
        paired = r("paired", f"{best_raw.name}, paired with tierfs")
        fs = s3fs.S3FileSystem(**opts)
        raw_files = {f"{bucket}/paired/part{j:02d}.bin": blob[j * size:(j + 1) * size] for j in range(n_best)}
        steps = {k: -1 for k in stores}

        def persist(key: str) -> tuple[float, float]:
            st_ = stores[key]
            if steps[key] >= 0:
                st_.delete(steps[key], tiers=[obj_name])  # untimed; keeps moto's memory bounded
            steps[key] += 1
            gc.collect()
            moto.counter.reset()
            t0 = time.perf_counter()
            st_.save(steps[key], state)
            t1 = time.perf_counter()
            st_.wait_until_finished()
            t2 = time.perf_counter()
            wire[key] = moto.counter.snapshot()
            return t2 - t0, t1 - t0

        def raw_paired() -> float:
            gc.collect()
            t, _ = timed(lambda: fs.pipe(raw_files) if n_best > 1 else fs.pipe_file(*next(iter(raw_files.items()))))
            fs.rm(f"{bucket}/paired", recursive=True)
            return t

        for i in range(args.warmup):
            for key in stores:
                t, _ = persist(key)
                log(f"tierfs warm-up persist {key} step {steps[key]}: {t:.2f}s ({nbytes / t / GB:.3f} GB/s)")
        for i in range(R):
            order = ["raw", *stores] if i % 2 == 0 else [*reversed(stores), "raw"]
            got = {}
            for key in order:
                if key == "raw":
                    got[key] = raw_paired()
                    paired.times.append(got[key])
                    continue
                total, ret = persist(key)
                got[key] = total
                res[key].times.append(total)
                if key == "persist":
                    res["persist_ret"].times.append(ret)
                    res["persist_bg"].times.append(total - ret)
            log(f"persist round {i + 1}/{R} ({' then '.join(order)}): raw {got['raw']:.2f}s, " + ", ".join(
                f"{k} {got[k]:.2f}s ({got['raw'] / got[k]:.2f}x raw)" for k in stores) +
                f"; save returned after {res['persist_ret'].times[-1]:.3f}s; PUT bytes "
                f"{wire['persist']['received'].get('PUT', 0) / nbytes:.3f}x state")
        for key, st_ in stores.items():
            if key != "persist":
                st_.close()
        log(f"steps on tiers: {store.steps()}")
        obj = store.tiers[1]

        # ---------------------------------------------------------------- tierfs restore from S3 only
        rest = r("restore", "tierfs restore(tiers=['s3'])")
        reads = []
        for i in range(R):
            moto.counter.reset()
            t, (got, info) = timed(lambda: store.restore(tiers=[obj.name]))
            snap = moto.counter.snapshot()
            reads.append(snap)
            rest.times.append(t)
            if info.tier != obj.name:
                raise AssertionError(f"restore came from {info.tier}, not {obj.name}")
            if i == 0 and not same(got, state):
                raise AssertionError("tierfs restore from S3 produced different bytes")
            del got
            gc.collect()
            log(f"tierfs restore from {info.tier} step {info.step} repeat {i + 1}/{R}: {t:.2f}s "
                f"({nbytes / t / GB:.3f} GB/s); GET bytes {snap['sent'].get('GET', 0) / nbytes:.3f}x state in "
                f"{snap['requests'].get('GET', 0)} GETs")
        wire["restore"] = reads[-1]
        tier_read_bytes = sorted(s["sent"].get("GET", 0) for s in reads)[len(reads) // 2]
        store.close()
        store = None
    finally:
        for st_ in [*stores.values(), *([store] if store is not None else [])]:
            try:
                st_.close()
            except Exception as e:  # noqa: BLE001
                log(f"closing a store failed: {e}")
        scratch.cleanup()
        moto.stop()
        log(f"removed {scratch.root}; moto stopped")

    # -------------------------------------------------------------------- report
    print(f"## bench_object: {nbytes / MiB:.0f} MiB state ({len(state)} fp32 tensors) over S3 "
          f"(moto {moto_version()}, in-process server), {R} repeats\n\n{machine_note()}\n")
    rows = [res[k] for k in ("pipe8", "pipe16", "pipe1", "dcp_save_tc1", "dcp_save_tc8", "paired", "persist",
                             "persist_ret", "persist_bg", "persist_fs") if k in res]
    print(table("upload (ratio = GB/s / best raw s3fs config)", rows, best_raw, ratio_label="x raw"))
    rows = [res[k] for k in ("dcp_load_tc1", "dcp_load_tc8", "restore") if k in res]
    print(table("restore from S3 (ratio = GB/s / best raw s3fs upload, for scale only)", rows, best_raw,
                ratio_label="x raw"))

    def wire_row(label: str, key: str) -> str:
        s = wire.get(key)
        if s is None:
            return ""
        req = ", ".join(f"{m} {n}" for m, n in sorted(s["requests"].items()))
        return (f"| {label} | {s['sent'].get('GET', 0) / nbytes:.3f} | {s['received'].get('PUT', 0) / nbytes:.3f} | "
                f"{req} | {s['ranged_gets']} |")

    print("### bytes on the wire (last repeat; x state bytes)\n")
    print("| operation | GET body bytes | PUT body bytes | requests | ranged GETs |\n|---|---|---|---|---|")
    for label, key in ((res["pipe8"].name, "pipe8"), (res["pipe16"].name, "pipe16"), (res["pipe1"].name, "pipe1"),
                       ("dcp.save FsspecWriter tc=1", "dcp_save_tc1"), ("dcp.save FsspecWriter tc=8", "dcp_save_tc8"),
                       ("dcp.load FsspecReader (tc=1 checkpoint)", "dcp_load_tc1"),
                       ("dcp.load FsspecReader (tc=8 checkpoint)", "dcp_load_tc8"), ("tierfs persist (save + upload)", "persist"),
                       ("tierfs persist, matched file_size", "persist_fs"),
                       ("tierfs restore(tiers=['s3'])", "restore")):
        line = wire_row(label, key)
        if line:
            print(line)
    print()
    print("### targets\n\n| target | value | goal | status |\n|---|---|---|---|")
    pair_ratios = sorted(a / b for a, b in zip(res["paired"].times, res["persist"].times))
    print(verdict(f"tierfs persist GB/s / paired raw s3fs ({best_raw.name}), median of per-round ratios "
                  f"[{' '.join(f'{x:.2f}' for x in pair_ratios)}]", statistics.median(pair_ratios), PERSIST_TARGET))
    print(verdict(f"tierfs persist GB/s / best raw s3fs ({best_raw.name}, raw phase)",
                  res["persist"].gbps / best_raw.gbps, PERSIST_TARGET))
    if "persist_fs" in res:
        fs_ratios = [a / b for a, b in zip(res["paired"].times, res["persist_fs"].times)]
        print(f"| (diagnostic) {res['persist_fs'].name} / paired raw, median of per-round ratios | "
              f"{statistics.median(fs_ratios):.3f} | - | - |")
        print(f"| (diagnostic) {res['persist_fs'].name} / best raw (raw phase) | "
              f"{res['persist_fs'].gbps / best_raw.gbps:.3f} | - | - |")
    print(verdict("tierfs restore bytes read / step bytes", tier_read_bytes / nbytes, READ_TARGET,
                  higher_is_better=False))
    for tc, b in dcp_read_bytes.items():
        print(f"| (reference) DCP FsspecReader bytes read / step bytes, thread_count={tc} checkpoint | "
              f"{b / nbytes:.3f} | - | - |")
    print()
    return 0


def moto_version() -> str:
    import moto

    return moto.__version__


if __name__ == "__main__":
    sys.exit(main())
