"""What a save's manifest costs on the background's threads, which hold the GIL for it: encoding and parsing
it with orjson (as tierfs does, :mod:`tierfs.format.jsonio`) and with Python's ``json`` alone, and writing
it into a RAM tier with and without an fsync.

    .venv/bin/python benchmarks/bench_manifest.py [--rounds 7] [--calls 300] [--no-write]

The manifest is that of ``bench_every_step.py``'s GPT (``model.state_dict()`` and AdamW's, 212 tensors),
saved once into a RAM tier on ``/dev/shm``. Each figure is the median over ``--rounds`` rounds of the mean
of ``--calls`` calls; the cases take turns within each round, the garbage collector off while they run (a
save pauses it too, and a collection would land on whichever call it falls in). Writes
``benchmarks/results/bench_manifest-<day>-<k>.md``.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any, Callable

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _common import machine_note, write_results  # noqa: E402


def timed(cases: dict[str, Callable[[], Any]], rounds: int, calls: int) -> dict[str, float]:
    """Per case, the median over rounds of the mean microseconds per call; the cases take turns within
    each round, so that a change in the machine's speed falls on all of them alike."""
    for fn in cases.values():
        fn()
    out: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(rounds):
        for k, fn in cases.items():
            gc.collect()
            gc.disable()
            try:
                t0 = time.perf_counter()
                for _ in range(calls):
                    fn()
                out[k].append((time.perf_counter() - t0) / calls * 1e6)
            finally:
                gc.enable()
    return {k: statistics.median(v) for k, v in out.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--no-write", action="store_true", help="print only; write no results")
    args = ap.parse_args()

    import torch

    from _training import Trainer
    from tierfs import TieredStore
    from tierfs.format import Manifest, jsonio, manifest_filename
    from tierfs.tiers import MemoryTier

    torch.set_num_threads(1)
    trainer = Trainer(None, 2048, 192, 4, 128, seed=0)  # bench_every_step.py's GPT at its defaults
    trainer.step()  # (AdamW's moments exist after a step)
    state = trainer.state()
    root = tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None, prefix="bench-manifest-")
    try:
        with TieredStore([MemoryTier(os.path.join(root, "ram"))]) as store:
            store.save(1, state)
        tier = MemoryTier(os.path.join(root, "ram"))
        tier.open()
        raw = bytes(tier.read_file(1, manifest_filename(0)))
        manifest = Manifest.from_bytes(raw)
        fast = jsonio.orjson

        def using(module: Any, fn: Callable[[], Any]) -> Callable[[], Any]:
            def call() -> Any:
                jsonio.orjson = module
                try:
                    return fn()
                finally:
                    jsonio.orjson = fast
            return call

        def write(sync: bool) -> Callable[[], None]:
            def call() -> None:
                tier._fsync = sync
                tier.write_file(2, manifest_filename(0), raw)
            return call

        got = timed({"encode orjson": using(fast, manifest.to_bytes), "encode json": using(None, manifest.to_bytes),
                     "parse orjson": using(fast, lambda: Manifest.from_bytes(raw)),
                     "parse json": using(None, lambda: Manifest.from_bytes(raw)),
                     "write": write(False), "write fsync": write(True)}, args.rounds, args.calls)
        rows = {"orjson (tierfs)": {"encode": got["encode orjson"], "parse": got["parse orjson"]},
                "json alone": {"encode": got["encode json"], "parse": got["parse json"]}}
        writes = {"without fsync (tmpfs, tierfs)": got["write"], "with fsync": got["write fsync"]}
        tier.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)

    lines = ["# bench_manifest: a save's manifest on the background's threads", "",
             f"- {time.strftime('%Y-%m-%d %H:%M:%S')}; {machine_note()}; load average "
             f"{os.getloadavg()[0]:.1f}",
             f"- a GPT's manifest: {len(manifest.entries)} entries, {len(raw)} bytes; medians of {args.rounds} "
             f"rounds of {args.calls} calls, the garbage collector off", "",
             "| JSON | encode (`to_bytes`), us | parse (`from_bytes`), us |", "|---|---|---|"]
    lines += [f"| {k} | {v['encode']:.0f} | {v['parse']:.0f} |" for k, v in rows.items()]
    lines += ["", "| RAM tier `write_file` of the manifest | us |", "|---|---|"]
    lines += [f"| {k} | {v:.0f} |" for k, v in writes.items()]
    print("\n".join(lines))
    if not args.no_write:
        write_results("bench_manifest", lines, {"args": vars(args), "json": rows, "write_file": writes,
                                                "entries": len(manifest.entries), "bytes": len(raw)})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
