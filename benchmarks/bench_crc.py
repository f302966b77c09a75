"""Checksum libraries: why tierfs computes crc32c with fastcrc.

    .venv/bin/python benchmarks/bench_crc.py [--size-gib 1] [--repeats 7]

Every block tierfs saves, restores, uploads or receives from a peer goes through one crc32c, so its
speed shows in every path. For each library installed among the crc32c package (tierfs's earlier
choice), google-crc32c, awscrt and fastcrc (``pip install crc32c awscrt`` to compare them all):

- one core, a 4 MiB block in cache (a block checksummed right after it is copied, as saves do);
- one core, a 512 MiB buffer in 8 MiB pieces (memory-bound: a restore's or upload's checks);
- tierfs itself with that library swapped in (``tierfs.format._crc32``, not an API): a steady-state RAM
  tier save of ``--size-gib`` and a ``restore_into`` of it (every block verified), both on 2 threads.

All libraries take turns in every repeat; medians. Results go to stdout (markdown), progress to stderr.
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import sys
import time
import types

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import GiB, MiB, Scratch, flat_state, like, log, machine_note, same, state_bytes  # noqa: E402


def libraries() -> dict[str, types.SimpleNamespace]:
    """``name -> namespace with iscsi(data, value)``, like the fastcrc.crc32 module tierfs uses."""
    known = [  # name, module, its crc32c as f(data, value)
        ("crc32c package", "crc32c", lambda m: m.crc32c),
        ("google-crc32c", "google_crc32c", lambda m: (lambda data, value=0: m.extend(value, data))),
        ("awscrt", "awscrt.checksums", lambda m: m.crc32c),
        ("fastcrc (tierfs)", "fastcrc.crc32", lambda m: m.iscsi),
    ]
    out = {}
    for name, mod, crc_of in known:
        try:
            fn = crc_of(importlib.import_module(mod))
        except ImportError:
            log(f"{name}: not installed, skipped")
            continue
        if fn(b"123456789", 0) != 0xE3069283:
            raise SystemExit(f"{name} does not compute crc32c")
        out[name] = types.SimpleNamespace(iscsi=fn)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-gib", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()

    import numpy as np

    import tierfs.format as fmt
    from tierfs import TieredStore
    from tierfs.policies import LatestN
    from tierfs.tiers import MemoryTier

    libs = libraries()
    buf = np.random.default_rng(0).integers(0, 256, 512 * MiB, dtype=np.uint8)
    hot = buf[: 4 * MiB]
    state = flat_state(max(1, int(args.size_gib * GiB) // (64 * MiB)), 64 * MiB)
    back = like(state)
    nbytes = state_bytes(state)
    times: dict[tuple[str, str], list[float]] = {}
    original = fmt._crc32
    scratch = Scratch("bench-crc-")
    try:
        with TieredStore([MemoryTier(scratch.fresh("ram"), keep=LatestN(2))]) as store:
            for step in range(3):  # warm-up: the tier's buffers mapped, then reused
                store.save(step, state)
            step = 3
            for r in range(args.repeats):
                log(f"repeat {r + 1}/{args.repeats}")
                for name, lib in libs.items():
                    fn = lib.iscsi
                    t0 = time.perf_counter()
                    for _ in range(64):
                        fn(hot, 0)
                    times.setdefault((name, "hot"), []).append((time.perf_counter() - t0) / 64)
                    t0 = time.perf_counter()
                    c = 0
                    for i in range(0, buf.size, 8 * MiB):
                        c = fn(buf[i:i + 8 * MiB], c)
                    times.setdefault((name, "stream"), []).append(time.perf_counter() - t0)
                    fmt._crc32 = lib
                    try:
                        t0 = time.perf_counter()
                        store.save(step, state)
                        times.setdefault((name, "save"), []).append(time.perf_counter() - t0)
                        t0 = time.perf_counter()
                        store.restore_into(back, step=step)
                        times.setdefault((name, "restore"), []).append(time.perf_counter() - t0)
                    finally:
                        fmt._crc32 = original
                    if not same(state, back):
                        raise SystemExit(f"restore with {name} is not bit-exact")
                    step += 1
    finally:
        scratch.cleanup()

    med = {k: statistics.median(v) for k, v in times.items()}
    base = next(iter(libs))
    print(f"## Checksum libraries (crc32c), {args.size_gib:g} GiB state, {args.repeats} repeats\n")
    print(f"- machine: {machine_note()}")
    print(f"- command: `.venv/bin/python benchmarks/bench_crc.py --size-gib {args.size_gib:g} "
          f"--repeats {args.repeats}`\n")
    print("| library | 4 MiB in cache GiB/s | 512 MiB stream GiB/s | tierfs save ms | tierfs restore ms | "
          f"save / restore x {base} |")
    print("|---|---|---|---|---|---|")
    for name in libs:
        print(f"| {name} | {4 * MiB / GiB / med[name, 'hot']:.1f} | {0.5 / med[name, 'stream']:.1f} | "
              f"{med[name, 'save'] * 1e3:.0f} | {med[name, 'restore'] * 1e3:.0f} | "
              f"{med[base, 'save'] / med[name, 'save']:.2f} / {med[base, 'restore'] / med[name, 'restore']:.2f} |")
    print(f"\n- save/restore: {nbytes / GiB:.2f} GiB of fp32 tensors, RAM tier on /dev/shm, steady state; "
          "x = speed-up over the first library listed")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
