"""What an open, idle store costs a rank per second: CPU time and wakeups of each of its threads.

    .venv/bin/python benchmarks/bench_idle.py [--revs HEAD~1,HEAD] [--world 2] [--seconds 5] [--runs 3]

Each rank (its own node, gloo on 127.0.0.1) first idles without tierfs (the job's own gloo group only), then
opens a store of a RAM tier, ``PeerTier(replicas=1)`` and an object tier (``file://``), saves three steps of
a small state, waits until the store is idle and idles again. Per thread, the CPU time it ran and its
voluntary context switches (wakeups) over each idle interval come from ``/proc/self/task/<tid>``
(``schedstat``, ``status``); the store's cost is the interval with it open less the one without. Each
revision in ``--revs`` (a git revision, exported with ``git archive``; ``.`` for the working tree) runs
once per round, interleaved, so the machine's load falls on all alike; medians over rounds and ranks.
Writes ``benchmarks/results/bench_idle-<day>-<k>.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _common import interleaved, machine_note, write_results  # noqa: E402

REPO = os.path.dirname(HERE)


def snap(names: dict[int, str]) -> dict[str, tuple[str, int, int]]:
    """Per thread id: (kind, voluntary context switches, ns on a CPU)."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            comm = open(f"/proc/self/task/{tid}/comm").read().strip()
            status = open(f"/proc/self/task/{tid}/status").read()
            ns = int(open(f"/proc/self/task/{tid}/schedstat").read().split()[0])
        except OSError:
            continue  # ended meanwhile
        vol = int(status.split("voluntary_ctxt_switches:")[1].split()[0])
        out[tid] = (kind(names.get(int(tid), comm), comm), vol, ns)
    return out


def kind(name: str, comm: str) -> str:
    if comm.startswith("gloo_tcp_loop"):
        return "gloo I/O loops"
    if comm.startswith(("pt_gloo", "gloo")):
        return "gloo workers"
    if name.startswith("tierfs"):
        return "tierfs threads"
    if name == "MainThread":
        return "main thread"
    return "other"


def idle(seconds: float) -> dict:
    """CPU ms a second and wakeups a second, by kind of thread, over ``seconds`` of doing nothing."""
    import threading

    names = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
    a = snap(names)
    time.sleep(seconds)
    b = snap(names)
    rows: dict[str, list[float]] = {}
    for tid, (k, vol, ns) in b.items():
        if tid in a:
            row = rows.setdefault(k, [0, 0.0, 0.0])
            row[0] += 1
            row[1] += (vol - a[tid][1]) / seconds
            row[2] += (ns - a[tid][2]) / seconds / 1e6
    return {"threads": len(b), "cpu_ms_per_s": sum(r[2] for r in rows.values()),
            "wakeups_per_s": sum(r[1] for r in rows.values()),
            "by": {k: {"threads": r[0], "wakeups_per_s": r[1], "cpu_ms_per_s": r[2]} for k, r in rows.items()}}


def worker(args: argparse.Namespace) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    import tierfs
    from tierfs import TieredStore
    from tierfs.tiers import MemoryTier, ObjectTier, PeerTier

    rank = dist.get_rank()
    dist.barrier()
    bare = idle(args.seconds)
    scratch = tempfile.mkdtemp(prefix="tierfs-idle-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    state = {f"t{i}": np.full(4096, i, dtype=np.float32) for i in range(20)}
    store = TieredStore([MemoryTier(os.path.join(scratch, "ram")), PeerTier(replicas=1),
                         ObjectTier("file://" + os.path.join(args.objects, "obj"))])
    for step in range(1, 4):
        store.save(step, state, blocking=False)
    store.wait_until_finished()
    dist.barrier()
    opened = idle(args.seconds)
    dist.barrier()
    store.close()
    shutil.rmtree(scratch, ignore_errors=True)
    with open(f"{args.json}.{rank}", "w") as f:
        json.dump({"rank": rank, "tierfs": os.path.dirname(tierfs.__file__), "bare": bare, "open": opened}, f)
    dist.destroy_process_group()


def describe(rev: str) -> str:
    if rev == ".":
        return "the working tree"
    out = subprocess.run(["git", "-C", REPO, "log", "-1", "--format=%h %s", rev], check=True,
                         capture_output=True, text=True).stdout.strip()
    return out[:100]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--revs", default=".", help="comma separated git revisions ('.': the working tree)")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json", default="", help=argparse.SUPPRESS)
    ap.add_argument("--objects", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return 0
    revs = [r.strip() for r in args.revs.split(",") if r.strip()]

    def jobs(rev: str, tmp: str) -> list[tuple[str, list[str]]]:
        return [(rev, ["--objects", tempfile.mkdtemp(dir=tmp), "--seconds", str(args.seconds)])]

    got = interleaved(__file__, revs, args.runs, args.world, jobs)
    lines = report(args, revs, got)
    print("\n".join(lines))
    if not args.no_write:
        write_results("bench_idle", lines, {"args": vars(args), "runs": got})
    return 0


def report(args: argparse.Namespace, revs: list[str], got: dict[str, list[dict]]) -> list[str]:
    def med(rows: list[dict], phase: str, fig: str, what: str | None = None) -> float:
        vals = [(r[phase]["by"].get(what, {}).get(fig, 0.0) if what else r[phase][fig]) for r in rows]
        return statistics.median(vals)
    kinds = ["gloo I/O loops", "gloo workers", "tierfs threads", "main thread", "other"]
    lines = ["# bench_idle: what an open, idle store costs a rank per second", "",
             f"- {time.strftime('%Y-%m-%d %H:%M:%S')}; {machine_note()}; load average at the end "
             f"{os.getloadavg()[0]:.1f} (a shared machine)",
             f"- command: `{' '.join([os.path.relpath(sys.executable, REPO), *sys.argv])}`",
             f"- {args.world} ranks, each its own node; store: RAM tier + PeerTier(replicas=1) + ObjectTier(file://), "
             f"three steps saved, then {args.seconds:g} s idle; {args.runs} rounds, revisions interleaved; "
             "medians over rounds and ranks; the store's cost: idle with it open less idle before it opened "
             "(the job's own gloo group)", ""]
    for rev in revs:
        lines.append(f"- `{rev}`: {describe(rev)}")
    lines += ["", "| revision | threads (open; before) | CPU ms/s, store's | wakeups/s, store's | "
              + " | ".join(f"{k}: CPU ms/s (threads)" for k in kinds) + " |", "|" + "---|" * (4 + len(kinds))]
    for rev in revs:
        rows = got[rev]
        cells = [f"`{rev}`", f"{med(rows, 'open', 'threads'):g}; {med(rows, 'bare', 'threads'):g}",
                 f"{statistics.median(r['open']['cpu_ms_per_s'] - r['bare']['cpu_ms_per_s'] for r in rows):.2f}",
                 f"{statistics.median(r['open']['wakeups_per_s'] - r['bare']['wakeups_per_s'] for r in rows):.0f}"]
        cells += [f"{med(rows, 'open', 'cpu_ms_per_s', k):.2f} ({med(rows, 'open', 'threads', k):g})" for k in kinds]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Per round and rank, the store's CPU ms/s: " + "; ".join(
        f"`{rev}` " + ", ".join(f"{r['open']['cpu_ms_per_s'] - r['bare']['cpu_ms_per_s']:.1f}" for r in got[rev])
        for rev in revs)]
    return lines


if __name__ == "__main__":
    raise SystemExit(main())
