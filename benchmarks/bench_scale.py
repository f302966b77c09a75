"""Coordination per rank from 2 to 64 processes, extrapolated to 1,024 and 8,192 ranks.

    .venv/bin/python benchmarks/bench_scale.py [--sizes 2,4,8,16,32,64] [--ops ...] [--tierfs-rev REV]

For each N, a gloo job of N processes on this machine, each its own node (``TIERFS_NODE_RANK`` = rank, its
own RAM directory under /dev/shm), with tiers ``MemoryTier`` + ``PeerTier(replicas=1)`` + an S3
``ObjectTier`` (moto, in a process of its own), a tiny state per rank (a few small numpy arrays), every tier
keeping 2 steps. Three jobs per N (``benchmarks/_scale.py``, each rank ``tests/children/scale_child.py``):
open, first save, steady save (the 3rd), the training thread's part of a ``blocking=False`` save, close;
then new processes restore the newest step; then new processes restore after the last rank's RAM directory
was removed (a node lost: its shard comes from its peer).

Counted per rank and operation: calls into torch.distributed (every module function and ProcessGroup
method wrapped in the child; a call inside another counted once) and the tensor bytes they moved, process
groups created, TCPStore operations (the parent hosts the store, as torchrun's agent does; each rank
reaches it through a counting proxy port of its own, so gloo's rendezvous from C++ is seen), sockets, TCP
connections and threads held after the operation, object-store requests by kind and keys listed (each rank
talks to S3 through its own port of a counting HTTP proxy), and wall seconds (indicative only: 2 shared
cores run every process). A save's background replication and upload are counted (``wait_until_finished``
inside the window); ``save_nonblocking`` counts only what the training thread does before ``save``
returns.

Printed per operation (and written to ``benchmarks/results/bench_scale-YYYYMMDD-<run>.md``, the per-rank
counts beside it as ``.json``): each figure per rank, the median over ranks and rank 0, for each N; its
growth from N=4 to N=64 (figures growing more than 1.2x are marked GROWS); the least-squares fit
``a + b*N`` of the median over N >= 4 and its values at 1,024 and 8,192 ranks; rank 0 against the other
ranks at the largest N; the calls by function and by tierfs call site at the largest N.

Last, DCP's first-save planning on the coordinator at ``--dcp-worlds`` ranks (default 1,024 and 8,192), on
synthesized per-rank plans (no processes; this checkout's code; ``bench_dcp_plan.py`` has more layouts and
the earlier code beside it). ``--replicated`` adds an array every rank holds alike, declared replicated.

``--tierfs-rev REV`` measures tierfs as committed at REV (``git archive`` into a scratch directory) instead
of this checkout's working tree. Progress and per-N timings go to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import export_tierfs, log, machine_note  # noqa: E402
from _scale import OPS, REPO, Harness, JobError, aggregate_details, compare, measure, report  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def next_result(out_dir: str, stem: str) -> str:
    day = time.strftime("%Y%m%d")
    n = 1
    while os.path.exists(os.path.join(out_dir, f"{stem}-{day}-{n}.md")):
        n += 1
    return os.path.join(out_dir, f"{stem}-{day}-{n}.md")


def describe_tierfs(rev: str | None) -> str:
    def git(*a: str) -> str:
        return subprocess.run(["git", "-C", REPO, *a], capture_output=True, text=True).stdout.strip()

    if rev:
        return f"tierfs as committed at {git('rev-parse', '--short', rev)} ({git('log', '-1', '--format=%s', rev)[:100]})"
    dirty = git("status", "--porcelain", "--", "tierfs")
    return (f"tierfs from this checkout's working tree, HEAD {git('rev-parse', '--short', 'HEAD')}"
            + (" with uncommitted changes under tierfs/" if dirty else ""))


def compact(by_n: dict) -> dict:
    """{N: {op: {figure: [value of rank 0, rank 1, ...]}}}"""
    out: dict = {}
    for n, counts in by_n.items():
        for r in sorted(counts):
            for op, figs in counts[r].items():
                for fig, v in figs.items():
                    out.setdefault(n, {}).setdefault(op, {}).setdefault(fig, [None] * len(counts))[r] = v
    return out


def expand(per_rank: dict) -> dict:
    """:func:`compact` undone: {N: {rank: {op: {figure: value}}}} (N and ranks as ints)."""
    out: dict = {}
    for n, ops in per_rank.items():
        counts = out.setdefault(int(n), {})
        for op, figs in ops.items():
            for fig, vals in figs.items():
                for r, v in enumerate(vals):
                    if v is not None:
                        counts.setdefault(r, {}).setdefault(op, {})[fig] = v
    return out


def load(path: str) -> dict:
    """A run's .json (or the .json beside its .md): by_n, details, and what it measured."""
    if path.endswith(".md"):
        path = path[:-3] + ".json"
    with open(path) as f:
        raw = json.load(f)
    return {"by_n": expand(raw["per_rank"]), "details": {int(n): d for n, d in raw.get("details", {}).items()},
            "raw": raw, "path": path}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="2,4,8,16,32,64", help="job sizes (processes), comma separated")
    ap.add_argument("--ops", default=",".join(OPS), help=f"operations, comma separated, of {', '.join(OPS)}")
    ap.add_argument("--tierfs-rev", default=None, help="measure tierfs as committed at this git revision")
    ap.add_argument("--timeout", type=float, default=None, help="seconds per job (default 120 + 8 per rank)")
    ap.add_argument("--spawn", action="store_true",
                    help="start every rank as a process of its own (default: forked from a zygote that imported "
                         "torch, the S3 client and tierfs once)")
    ap.add_argument("--compare", default=None, metavar="RESULT",
                    help="a earlier run's results (.md or .json): each figure before -> now")
    ap.add_argument("--report", default=None, metavar="RESULT",
                    help="print the report of an earlier run's .json (with --compare: against that one); no run")
    ap.add_argument("--out-dir", default=RESULTS, help="where the results go")
    ap.add_argument("--no-write", action="store_true", help="print only")
    ap.add_argument("--note", default="", help="a line of text for the results")
    ap.add_argument("--dcp-worlds", default="1024,8192",
                    help="ranks at which to time DCP's first-save planning on synthesized plans (this checkout's "
                         "code, benchmarks/bench_dcp_plan.py); empty: none")
    ap.add_argument("--dcp-layouts", default="dp", help="their layouts, of dp, hsdp, fsdp")
    ap.add_argument("--replicated", action="store_true",
                    help="add an array every rank holds alike, declared replicated (data parallelism)")
    args = ap.parse_args()
    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    base = load(args.compare) if args.compare else None
    if args.report:
        run = load(args.report)
        text = report(run["by_n"], [o for o in ops if o in run["raw"].get("ops", ops)], run["details"])
        if base:
            text += "\n" + compare(base["by_n"], run["by_n"], ops)
        print(text)
        return 0
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    scratch = tempfile.mkdtemp(dir="/dev/shm" if os.access("/dev/shm", os.W_OK) else None, prefix="bench-scale-")
    root = export_tierfs(args.tierfs_rev, os.path.join(scratch, "tierfs-src")) if args.tierfs_rev else None
    which = describe_tierfs(args.tierfs_rev)
    out = None if args.no_write else next_result(args.out_dir, "bench_scale")
    by_n: dict[int, dict] = {}
    details: dict[int, dict] = {}
    timings: dict[int, dict] = {}
    failures: dict[int, str] = {}
    log(f"{which}; sizes {sizes}; results {out or '(not written)'}")

    def write() -> str:
        lines = ["# bench_scale: coordination per rank from 2 to 64 processes", "",
                 f"- {time.strftime('%Y-%m-%d %H:%M:%S')}; {machine_note()}; load average at the end "
                 f"{os.getloadavg()[0]:.1f} (other jobs shared the machine)",
                 f"- {which}", f"- command: `{' '.join([os.path.basename(sys.executable)] + sys.argv)}`"]
        if args.note:
            lines.append(f"- note: {args.note}")
        lines += ["- every process its own node; tiers: RAM (LatestN(2)) + PeerTier(replicas=1) + S3 ObjectTier "
                  "(moto behind a counting proxy, LatestN(2)); state per rank: 3 small numpy arrays, a dict of 2 "
                  "and a number (about 18 KB)" + ("; and an 8 KB array every rank holds alike, declared replicated "
                                                "(data parallelism)" if args.replicated else "") +
                  "; the TCPStore hosted by the parent (as torchrun's agent does)",
                  "- cells: the figure per rank, the median over ranks; rank 0 (node_loss adds the rank whose RAM "
                  "was removed: lost). Counts are of what the operation did; socket, connection and thread figures "
                  "are what the process holds after it. Bytes are tensor bytes through torch.distributed (a "
                  "collective's as its caller sees them). Keys listed vary a little from run to run (listings "
                  "made while other ranks upload).",
                  "- growth: the figure at N=64 over N=4 (median; rank 0); GROWS: more than 1.2x. Fit: least "
                  "squares a + b*N of the median over N >= 4, and its values at 1,024 and 8,192 ranks (median; "
                  "rank 0's own fit).", "",
                  "| N | seconds per job (save; restore; node_loss) | outcome |", "|---|---|---|"]
        for n in sizes:
            t = timings.get(n, {})
            cell = "; ".join(f"{t[j]:.1f}" for j in ("save", "restore", "node_loss") if j in t)
            lines.append(f"| {n} | {cell} | {failures.get(n, 'ok' if n in by_n else 'not run')} |")
        lines.append("")
        lines.append(report(by_n, ops, details) if by_n else "(no size completed)")
        if base and by_n:
            lines += ["", f"Baseline: `{os.path.basename(base['path'])}` ({base['raw'].get('tierfs', '?')})", "",
                      compare(base["by_n"], by_n, ops)]
        lines += dcp_lines
        return "\n".join(lines) + "\n"

    dcp_lines: list[str] = []

    try:
        with Harness(max(sizes)) as h:
            for n in sizes:
                log(f"N={n}: starting")
                t0 = time.perf_counter()
                tm: dict[str, float] = {}
                det: dict = {}
                try:
                    by_n[n] = measure(n, ops, scratch, harness=h, timeout=args.timeout, timings=tm, detail=det,
                                      tierfs_root=root, fork=not args.spawn, replicated=args.replicated)
                    details[n] = aggregate_details(det)
                except JobError as e:
                    failures[n] = f"failed: {str(e).splitlines()[0]}"
                    log(f"N={n}: {e}")
                timings[n] = tm
                log(f"N={n}: {time.perf_counter() - t0:.1f} s ({', '.join(f'{j} {s:.1f} s' for j, s in tm.items())})"
                    f"{'; ' + failures[n] if n in failures else ''}")
                if out:
                    os.makedirs(os.path.dirname(out), exist_ok=True)
                    with open(out, "w") as f:
                        f.write(write())
                    with open(out[:-3] + ".json", "w") as f:
                        json.dump({"tierfs": which, "sizes": sizes, "ops": ops, "timings": timings,
                                   "failures": failures, "per_rank": compact(by_n), "details": details}, f)
                if n in failures and n != sizes[-1]:
                    log("the next sizes are larger: stopping here")
                    break
        dcp_lines[:] = dcp_planning([int(w) for w in args.dcp_worlds.split(",") if w.strip()],
                                    [x for x in args.dcp_layouts.split(",") if x.strip()])
        if out and dcp_lines:
            with open(out, "w") as f:
                f.write(write())
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(write())
    if out:
        log(f"written: {out} (and .json)")
    return 1 if failures else 0


def dcp_planning(worlds: list[int], layouts: list[str]) -> list[str]:
    """The report's section on DCP's first-save planning at ``worlds`` ranks (no processes: synthesized
    per-rank plans of a GPT-like state, :func:`bench_dcp_plan.planning`)."""
    if not worlds:
        return []
    import statistics

    from bench_dcp_plan import kib, planning, secs

    rows = ["", "## DCP: the coordinator's planning of a first save (synthesized plans, this checkout's code)", "",
            "A GPT-like state of 292 tensors per rank; the planning is `plan_sharing` on the coordinator (median "
            "of 3), the plan sent is each rank's final plan as DCP scatters it (`benchmarks/bench_dcp_plan.py` "
            "compares it with the earlier code).", "",
            "| layout | ranks | planning | plan sent per rank KiB (median / max) |", "|---|---|---|---|"]
    for layout in layouts:
        for world in worlds:
            log(f"DCP planning: {layout} at {world} ranks")
            ts, sent = planning(layout, world)
            rows.append(f"| {layout} | {world:,} | {secs(ts)} | {kib(sent)} |")
            log(f"DCP planning: {layout} at {world} ranks: {statistics.median(ts) * 1e3:.1f} ms")
    return rows


if __name__ == "__main__":
    sys.exit(main())
