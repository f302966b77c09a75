"""What the object store sees of a save: requests per rank by type, bytes per request, the key prefixes they
go to, at 2 to 64 ranks, extrapolated to 8,192 ranks and to a 20 GB shard.

    .venv/bin/python benchmarks/bench_requests.py [--sizes 2,4,8,16,32,64] [--shapes 4:16:16,4:1:16]

Each job is ``tests/children/scale_child.py requests``: N ranks forked from one zygote (each its own node),
each saving a torch.nn MLP with its AdamW state (``state`` MiB) to a RAM tier and an S3 ``ObjectTier`` on
moto, through its own port of ``_scale.CountingProxy``, in shard files of ``file`` MiB uploaded in parts of
``part`` MiB (a file under two parts goes whole, as s3fs puts it). Four saves; the fourth (retention deleting the oldest of the object tier's two kept steps)
is counted. Figures are the median over ranks; prefixes are the folders of the keys each request names (of
a listing's ``prefix``; a batch delete's is the bucket's), counted over the whole job.

Extrapolation: a save's requests per rank are ``small + files * per file`` (fitted over the shapes: the
small ones do not depend on the shard, the rest grow with its files), so a 20 GB shard in 16 MiB files
asks ``small + 1,193 * per file``; the job asks N times that. Each rank's keys go under its bucket of
prefixes (``<root>/ranks/<bucket>/``, 256 buckets: 32 ranks each at 8,192), the marker under the step's
own. The time column divides a save's requests under its busiest prefix by S3's
documented 3,500 writes (PUT, POST, DELETE) per second per prefix partition and GCS's initial 1,000 writes
per second (before any ramp-up): the floor of how long the store takes to accept one save.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import s3fs  # noqa: E402

from _common import machine_note, results_path  # noqa: E402
from _scale import BUCKET, Harness, run_job  # noqa: E402

KINDS = ("PUT", "HEAD", "GET", "LIST", "DELETE")
S3_WRITES, GCS_WRITES = 3500, 1000  # per second per prefix (S3's partition; GCS's start, before ramping up)
TARGET_RANKS, TARGET_SHARD, FILE = 8192, 20e9, 16 << 20


def job(h: Harness, n: int, shape: tuple[float, float, float], workdir: str) -> dict:
    state, file_mib, part_mib = shape
    os.environ.update(SCALE_STATE_MIB=str(state), SCALE_FILE_MIB=str(file_mib), SCALE_PART_MIB=str(part_mib))
    run = f"req-{n}-{int(time.time() * 1000) % 10**8}"
    ramroot = os.path.join(workdir, run)
    os.makedirs(ramroot, mode=0o700)
    try:
        res = run_job(n, "requests", ramroot, f"s3://{BUCKET}/{run}", h, 120.0 + 8.0 * n,
                      os.path.join(workdir, "logs"))
    finally:  # the next jobs need the memory: this one's RAM tiers, and its objects in moto
        shutil.rmtree(ramroot, ignore_errors=True)
        s3fs.S3FileSystem(skip_instance_cache=True, endpoint_url=h.endpoint, key="testing",
                          secret="testing").rm(f"{BUCKET}/{run}", recursive=True)
    per = [r["ops"]["steady_save"] for r in res]
    objs = [r["objects"]["steady_save"] for r in res]
    out: dict = {"ranks": n, "state MiB": state, "file MiB": file_mib, "part MiB": part_mib,
                 "state bytes": statistics.median(r["info"]["state_bytes"] for r in res),
                 "files": statistics.median(len(r["info"]["files"]) for r in res),
                 "file requests": statistics.median(sum(per_file(x, part_mib * (1 << 20)) for x in r["info"]["files"])
                                                    for r in res)}
    for k in KINDS:
        counts = [p.get(f"s3_{k}", 0) for p in per]
        nbytes = [o.get(f"bytes:{k}", 0) for o in objs]
        out[k] = statistics.median(counts)
        out[f"{k} bytes/request"] = sum(nbytes) / sum(counts) if sum(counts) else 0
    out["requests"] = sum(out[k] for k in KINDS)
    out["small"] = out["requests"] - out["file requests"]
    prefixes: dict[str, int] = {}
    for o in objs:
        for key, v in o.items():
            if key.startswith("prefix:"):
                prefixes[key[7:]] = prefixes.get(key[7:], 0) + v
    root = run
    out["prefixes"] = sorted(p.replace(root, "<root>", 1) if p else "(the bucket: batch deletes)" for p in prefixes)
    out["busiest prefix share"] = max(prefixes.values()) / sum(prefixes.values()) if prefixes else 0
    # what a store partitions on: each rank bucket (the same for every step) and each other folder
    families: dict[str, int] = {}
    for p, v in prefixes.items():
        fam = p.split("/ranks/", 1)[1][:2] if "/ranks/" in p else p
        families[fam] = families.get(fam, 0) + v
    buckets = {f: v for f, v in families.items() if len(f) == 2}
    others = {f: v for f, v in families.items() if len(f) != 2 and f}  # not the bucket-wide batch delete
    out["rank buckets"] = len(buckets)
    out["busiest bucket"] = max(buckets.values(), default=0)
    out["busiest other prefix"] = max(others.values(), default=0)
    return out


def per_file(file: float, part: float) -> int:
    """Requests uploading one shard file takes: one PUT below two parts (s3fs puts it whole), else a
    multipart upload's start, parts and completion."""
    part = max(part, 5 << 20)
    return 1 if file < 2 * part else math.ceil(file / part) + 2


def extrapolate(rows: list[dict]) -> dict:
    """A 20 GB shard in 16 MiB files (16 MiB parts) at 8,192 ranks: each rank's small requests as measured
    at the largest N (median over the shapes), plus one request per file. A rank's requests go under its
    bucket, 32 ranks to each of the 256; the step's own prefix (the marker) takes what the busiest other
    prefix took at the largest N, plus its growth per rank from the smallest N to the largest, times the
    ranks beyond (none, when no rank but the owner asks for the marker)."""
    top = max(r["ranks"] for r in rows)
    at_top = [r for r in rows if r["ranks"] == top]
    small = statistics.median(r["small"] for r in at_top)
    files = math.ceil(TARGET_SHARD / FILE)
    per_rank = small + files * per_file(FILE, FILE)
    job_requests = per_rank * TARGET_RANKS
    # per rank, in its bucket: the busiest bucket's requests (one rank each up to 256 ranks) less its files
    bucket_small = statistics.median(r["busiest bucket"] - r["file requests"] for r in at_top)
    per_bucket = math.ceil(TARGET_RANKS / 256) * (bucket_small + files * per_file(FILE, FILE))
    # the busiest other prefix (a step's own: the marker's), as it grows from the smallest job to the largest
    low = min(r["ranks"] for r in rows)
    other = {n: statistics.median(r["busiest other prefix"] for r in rows if r["ranks"] == n) for n in (low, top)}
    growth = (other[top] - other[low]) / (top - low) if top > low else other[top] / top
    at_step = other[top] + growth * (TARGET_RANKS - top)
    busiest = max(per_bucket, at_step)
    return {"small requests per rank (measured)": small, "files of a 20 GB shard": files,
            "requests per rank": per_rank, "requests per save (8,192 ranks)": job_requests,
            "under the busiest rank bucket (32 ranks)": per_bucket,
            "under the busiest other prefix": at_step,
            "seconds at S3's 3,500 writes per prefix": busiest / S3_WRITES,
            "seconds at GCS's 1,000 writes per prefix": busiest / GCS_WRITES}


def rev() -> str:
    import subprocess

    out = subprocess.run(["git", "-C", HERE, "log", "-1", "--format=%h %s"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", HERE, "status", "--porcelain", "--", "../tierfs"], capture_output=True,
                           text=True).stdout.strip()
    return out.stdout.strip()[:80] + (" (with uncommitted changes)" if dirty else "")


def report(rows: list[dict], ext: dict, args: argparse.Namespace) -> str:
    lines = ["# bench_requests: the object store's side of a save", "",
             f"- {time.strftime('%Y-%m-%d %H:%M:%S')}; {machine_note()}; load average at the end "
             f"{os.getloadavg()[0]:.1f}", f"- tierfs at {rev()}",
             f"- command: `.venv/bin/python benchmarks/bench_requests.py --sizes {args.sizes} --shapes {args.shapes}`",
             "", "| ranks | state MiB | file MiB | part MiB | files | " + " | ".join(KINDS) + " | requests | small | "
             "bytes per PUT | bytes per LIST | prefixes (job) | rank buckets | busiest bucket | busiest other prefix |",
             "|" + "---|" * (14 + len(KINDS))]
    for r in rows:
        lines.append(f"| {r['ranks']} | {r['state MiB']:g} | {r['file MiB']:g} | {r['part MiB']:g} | {r['files']:g} | "
                     + " | ".join(f"{r[k]:g}" for k in KINDS)
                     + f" | {r['requests']:g} | {r['small']:g} | {r['PUT bytes/request'] / 1024:.0f} KiB | "
                     f"{r['LIST bytes/request'] / 1024:.1f} KiB | {len(r['prefixes'])} | {r['rank buckets']} | "
                     f"{r['busiest bucket']:g} | {r['busiest other prefix']:g} |")
    lines += ["", "Prefixes of the largest job: " + ", ".join(f"`{p}`" for p in rows[-1]["prefixes"][:6])
              + (" ..." if len(rows[-1]["prefixes"]) > 6 else ""), ""]
    if ext:
        lines += ["## A 20 GB shard at 8,192 ranks (extrapolated)", "",
                  "| figure | value |", "|---|---|"]
        lines += [f"| {k} | {v:,.2f} |" if isinstance(v, float) else f"| {k} | {v:,} |" for k, v in ext.items()]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="2,4,8,16,32,64", help="job sizes (processes)")
    ap.add_argument("--shapes", default="4:16:16,4:1:16",
                    help="state MiB : file MiB : part MiB, comma separated")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    sizes = [int(x) for x in args.sizes.split(",")]
    shapes = [tuple(float(v) for v in s.split(":")) for s in args.shapes.split(",")]
    rows = []
    with Harness(max(sizes)) as h, tempfile.TemporaryDirectory(prefix="tierfs-req-", dir="/dev/shm") as work:
        for n in sizes:
            for shape in shapes:
                rows.append(job(h, n, shape, work))  # type: ignore[arg-type]
                print(f"[{time.strftime('%H:%M:%S')}] {n} ranks, {shape}: {rows[-1]['requests']:g} requests per rank",
                      flush=True)
    text = report(rows, extrapolate(rows), args)
    print(text)
    if not args.no_write:
        path = results_path("bench_requests")
        with open(path + ".md", "w") as f:
            f.write(text)
        with open(path + ".json", "w") as f:
            json.dump({"rows": rows}, f, indent=1)
        print(f"written: {path}.md (and .json)")


if __name__ == "__main__":
    main()
