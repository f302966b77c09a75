"""What a save costs a rank in CPU, thread by thread, with revisions interleaved.

    .venv/bin/python benchmarks/bench_save_cpu.py [--revs HEAD~1,HEAD] [--tiers peer,erasure] [--world 5]
        [--saves 40] [--runs 3]

Each rank (its own node, gloo on 127.0.0.1, one torch thread) holds the state of the GPT that
``bench_every_step.py`` trains (``model.state_dict()`` and AdamW's, 212 tensors, 29.7 MiB at the
defaults) and opens a store of a RAM tier and, after it, each of ``--tiers`` in turn: ``peer``,
``PeerTier(replicas=1)``; ``erasure``, ``ErasureCodedTier(data=4, parity=1)`` (``--code``; a job of fewer
nodes than ``data + parity`` is one group of them all); ``ram``, none. After five saves to warm it up,
the store idles for ``--saves`` x ``--gap`` seconds, then saves ``--saves`` steps (``blocking=False``)
``--gap`` seconds apart and waits until it is idle. Per thread, the CPU time it ran comes from
``/proc/self/task/<tid>/schedstat``; a save's cost is the interval with saves less the idle one, over
the saves. No training runs beside it, so the figures are the store's own work, not what it takes from a
loop that keeps the cores busy (``bench_every_step.py`` measures that).

This machine's speed moves by tens of percent between hours (other jobs share it), so figures from
different runs of this benchmark do not compare; the revisions of one run do: each revision in ``--revs``
(a git revision, exported with ``git archive``; ``.`` for the working tree) runs once per round,
interleaved, and each of ``--tiers`` in each. Medians over rounds and ranks. Writes ``benchmarks/results/bench_save_cpu-<day>-<k>.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _common import interleaved, machine_note, write_results  # noqa: E402
from bench_idle import describe  # noqa: E402


def delta(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    """Each thread role's CPU ms between two readings of :func:`_training.cpu_by_thread` (seconds)."""
    return {k: 1000 * (b[k] - a.get(k, 0.0)) for k in b}


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    import tierfs
    from _training import Trainer, cpu_by_thread, nbytes_of
    from _common import tensors
    from tierfs import TieredStore
    from tierfs.policies import LatestN
    from tierfs.tiers import ErasureCodedTier, MemoryTier, PeerTier

    rank = dist.get_rank()
    trainer = Trainer(dist, args.vocab, args.d_model, args.layers, args.seq, seed=rank)
    for _ in range(2):
        trainer.step()
    state = trainer.state()
    scratch = tempfile.mkdtemp(prefix="tierfs-savecpu-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    try:
        data, parity = (int(x) for x in args.code.split(":"))
        second = {"ram": [], "peer": [PeerTier(replicas=1)], "erasure": [ErasureCodedTier(data, parity)]}[args.tier]
        with TieredStore([MemoryTier(os.path.join(scratch, "ram"), keep=LatestN(2)), *second]) as store:
            for step in range(5):
                store.save(step, state, blocking=False)
            store.wait_until_finished()
            dist.barrier()
            a = cpu_by_thread(precise=True)
            time.sleep(args.saves * args.gap)
            b = cpu_by_thread(precise=True)
            for step in range(5, 5 + args.saves):
                store.save(step, state, blocking=False)
                time.sleep(args.gap)
            store.wait_until_finished()
            c = cpu_by_thread(precise=True)
        idle, busy = delta(a, b), delta(b, c)
        per_save = {k: (busy[k] - idle.get(k, 0.0)) / args.saves for k in busy}
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    with open(f"{args.json}.{rank}", "w") as f:
        json.dump({"rank": rank, "tierfs": os.path.dirname(tierfs.__file__), "per_save": per_save,
                   "nbytes": nbytes_of(state), "tensors": sum(1 for _ in tensors(state))}, f)
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--revs", default=".", help="comma separated git revisions ('.': the working tree)")
    ap.add_argument("--tiers", default="peer", help="comma separated: peer, erasure, ram (the tier after the RAM tier)")
    ap.add_argument("--tier", default="peer", help=argparse.SUPPRESS)
    ap.add_argument("--code", default="4:1", help="the erasure-coded tier's data:parity")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--saves", type=int, default=40)
    ap.add_argument("--gap", type=float, default=0.1, help="seconds between saves")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--d-model", type=int, default=192)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return 0
    revs = [r.strip() for r in args.revs.split(",") if r.strip()]
    tiers = [t.strip() for t in args.tiers.split(",") if t.strip()]
    if not set(tiers) <= {"ram", "peer", "erasure"}:
        raise SystemExit(f"--tiers: peer, erasure or ram, got {args.tiers}")
    passed = [f"--{k.replace('_', '-')}={getattr(args, k)}"
              for k in ("saves", "gap", "d_model", "layers", "vocab", "seq", "code")]
    got = interleaved(__file__, revs, args.runs, args.world,
                      lambda rev, tmp: [(f"{rev} {t}", ["--tier", t, *passed]) for t in tiers])
    lines = report(args, revs, got)
    print("\n".join(lines))
    if not args.no_write:
        write_results("bench_save_cpu", lines, {"args": vars(args), "runs": got})
    return 0


def report(args: argparse.Namespace, revs: list[str], got: dict[str, list[dict]]) -> list[str]:
    keys = list(got)
    first = got[keys[0]][0]
    roles = sorted({k for key in keys for r in got[key] for k, v in r["per_save"].items() if abs(v) >= 0.05},
                   key=lambda k: -statistics.median(r["per_save"].get(k, 0.0) for r in got[keys[-1]]))
    lines = ["# bench_save_cpu: what a save costs a rank in CPU, by thread", "",
             f"- {time.strftime('%Y-%m-%d %H:%M:%S')}; {machine_note()}; load average at the end "
             f"{os.getloadavg()[0]:.1f} (a shared machine)",
             f"- command: `{' '.join([os.path.relpath(sys.executable, os.path.dirname(HERE)), *sys.argv])}`",
             f"- {args.world} ranks, each its own node; a GPT's state with AdamW's, {first['tensors']} tensors, "
             f"{first['nbytes'] / 2**20:.1f} MiB per rank; a RAM tier and after it: {args.tiers} (erasure: "
             f"{args.code.replace(':', '+')}); {args.saves} saves "
             f"{args.gap:g} s apart, less the same time idle; {args.runs} rounds, revisions interleaved; medians over "
             "rounds and ranks, ms of CPU per save", ""]
    for rev in revs:
        lines.append(f"- `{rev}`: {describe(rev)}")
    lines += ["", "| revision | tier | every thread | " + " | ".join(roles) + " |", "|" + "---|" * (3 + len(roles))]
    for key in keys:
        rows = got[key]
        rev, tier = key.rsplit(" ", 1)
        cells = [f"`{rev}`", tier, f"{statistics.median(sum(r['per_save'].values()) for r in rows):.1f}"]
        cells += [f"{statistics.median(r['per_save'].get(k, 0.0) for r in rows):.1f}" for k in roles]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Per round and rank, every thread's ms per save: " + "; ".join(
        f"`{key}` " + ", ".join(f"{sum(r['per_save'].values()):.1f}" for r in got[key]) for key in keys)]
    return lines


if __name__ == "__main__":
    raise SystemExit(main())
