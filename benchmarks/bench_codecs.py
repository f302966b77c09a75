"""Erasure-code libraries: why tierfs's parity >= 2 goes through pyeclib (ISA-L).

    .venv/bin/python benchmarks/bench_codecs.py [--sizes-mib 64,256] [--codes 4+2,8+2] [--runs 5]

One core (the process is pinned to one CPU where the OS allows). A stripe of ``--sizes-mib`` of data is
split into ``d`` pieces; each row encodes its ``p`` parity pieces, then rebuilds ``p`` lost data pieces
(the worst case) from the ``d`` pieces left. GB/s are the stripe's data bytes (d pieces) per second
either way, medians of ``--runs`` runs. Rows:

- ``zfec whole``: zfec's Encoder / Decoder on the whole pieces (it returns new bytes objects; its
  Reed-Solomon matrix is its own, so its parity differs from ISA-L's);
- ``zfec 64K``: the same, 64 KiB of each piece per call, results copied into preallocated arrays;
- ``pyeclib whole``: pyeclib (ISA-L, Cauchy) on the whole stripe: the pieces joined into one bytes, the
  fragments (a header and a piece each) handed back for the rebuild;
- ``tierfs B``: ``tierfs.tiers._erasure`` (pyeclib in blocks of B bytes of each piece, into
  preallocated arrays); its default block is :data:`tierfs.tiers._erasure.RS_BLOCK`;
- ``isa-l direct`` (encode only): ISA-L's ``ec_encode_data`` called through ctypes in the copy of
  libisal that pyeclib's wheel bundles, on the whole pieces, into preallocated arrays: what ISA-L itself
  does without pyeclib's copies and allocations (not something tierfs does);
- ``tierfs xor`` (p = 1 only): the XOR parity, whole pieces and in blocks.

A library that is not installed is skipped. Every result is checked against the data. The table goes to
stdout, progress to stderr.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from typing import Any, Callable

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tierfs.tiers import _erasure  # noqa: E402

MiB = 1 << 20


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def median_s(fn: Callable[[], Any], runs: int) -> float:
    fn()  # warm: caches, drivers, headers
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def zfec_paths(zfec: Any, d: int, p: int, block: int | None) -> tuple[Callable[..., Any], Callable[..., Any]]:
    enc, dec = zfec.Encoder(d, d + p), zfec.Decoder(d, d + p)

    def encode(data: list[np.ndarray], outs: list[np.ndarray]) -> list[Any]:
        if block is None:
            return list(enc.encode(data, list(range(d, d + p))))
        for s in range(0, data[0].size, block):
            for o, b in zip(outs, enc.encode([a[s:s + block] for a in data], list(range(d, d + p)))):
                o[s:s + block] = np.frombuffer(b, np.uint8)
        return outs

    def decode(have: dict[int, Any], lost: list[int], outs: list[np.ndarray]) -> list[Any]:
        use = sorted(have)[:d]
        if block is None:
            got = dec.decode([have[i] for i in use], use)
            return [got[i] for i in lost]
        for s in range(0, outs[0].size, block):
            got = dec.decode([have[i][s:s + block] for i in use], use)
            for o, i in zip(outs, lost):
                o[s:s + block] = np.frombuffer(got[i], np.uint8)
        return outs
    return encode, decode


def pyeclib_whole(d: int, p: int) -> tuple[Callable[..., Any], Callable[..., Any]]:
    from pyeclib.ec_iface import ECDriver

    drv = ECDriver(k=d, m=p, ec_type=_erasure.EC_TYPE)
    frags: list[bytes] = []

    def encode(data: list[np.ndarray], outs: list[np.ndarray]) -> list[Any]:
        frags[:] = drv.encode(b"".join([a.data for a in data]))
        return [memoryview(f)[len(f) - data[0].size:] for f in frags[d:]]

    def decode(have: dict[int, Any], lost: list[int], outs: list[np.ndarray]) -> list[Any]:
        n = outs[0].size
        use = sorted(have)[:d]
        got = drv.reconstruct([frags[i][:len(frags[i]) - n] + have[i].data for i in use], list(lost))
        return [memoryview(f)[len(f) - n:] for f in got]
    return encode, decode


def isal_direct(d: int, p: int) -> tuple[Callable[..., Any], Callable[..., Any]] | None:
    import ctypes
    import glob

    import pyeclib
    libs = os.path.join(os.path.dirname(list(pyeclib.__path__)[0]), "pyeclib.libs")
    found = glob.glob(os.path.join(libs, "libisal*.so*"))
    if not found:
        return None
    lib = ctypes.CDLL(found[0])
    matrix = (ctypes.c_ubyte * ((d + p) * d))()
    lib.gf_gen_cauchy1_matrix(matrix, d + p, d)
    tables = (ctypes.c_ubyte * (32 * d * p))()
    lib.ec_init_tables(d, p, ctypes.byref(matrix, d * d), tables)

    def encode(data: list[np.ndarray], outs: list[np.ndarray]) -> list[Any]:
        src = (ctypes.c_void_p * d)(*[a.ctypes.data for a in data])
        dst = (ctypes.c_void_p * p)(*[o.ctypes.data for o in outs])
        lib.ec_encode_data(data[0].size, d, p, tables, src, dst)
        return outs
    return encode, lambda *a: None


def tierfs_paths(d: int, p: int, block: int) -> tuple[Callable[..., Any], Callable[..., Any]]:
    def encode(data: list[np.ndarray], outs: list[np.ndarray]) -> list[Any]:
        _erasure.RS_BLOCK = _erasure.XOR_BLOCK = block
        return _erasure.encode(data, p, out=outs)

    def decode(have: dict[int, Any], lost: list[int], outs: list[np.ndarray]) -> list[Any]:
        _erasure.RS_BLOCK = _erasure.XOR_BLOCK = block
        got = _erasure.decode(have, d, p, lost, out=dict(zip(lost, outs)))
        return [got[i] for i in lost]
    return encode, decode


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mib", default="64,256")
    ap.add_argument("--codes", default="4+1,4+2,8+2")
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    libs: dict[str, Any] = {}
    for name in ("zfec", "pyeclib"):
        try:
            libs[name] = __import__(name)
        except ImportError:
            log(f"{name}: not installed, skipped")
    import importlib.metadata as md
    versions = ", ".join(f"{n} {md.version(n)}" for n in libs)
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")),
               platform.processor()) if os.path.exists("/proc/cpuinfo") else platform.processor()
    print(f"# bench_codecs: {time.strftime('%Y-%m-%d')}, {cpu}, {platform.machine()}, one core, Python "
          f"{platform.python_version()}, numpy {np.__version__}, {versions}, {args.runs} runs, medians")
    print(f"# command: python benchmarks/bench_codecs.py --sizes-mib {args.sizes_mib} --codes {args.codes} "
          f"--runs {args.runs}")
    print("# GB/s = the stripe's data bytes per second; decode rebuilds p lost data pieces from d left")
    print(f"{'code':>5} {'MiB':>5} {'path':<16} {'encode GB/s':>12} {'decode GB/s':>12}")
    rng = np.random.default_rng(0)
    defaults = _erasure.RS_BLOCK, _erasure.XOR_BLOCK
    for code in args.codes.split(","):
        d, p = (int(x) for x in code.split("+"))
        for size in (int(x) for x in args.sizes_mib.split(",")):
            n = size * MiB // d
            data = [rng.integers(0, 256, n, dtype=np.uint8) for _ in range(d)]
            parity = _erasure.encode(data, p)
            lost = list(range(p))
            outs = [np.zeros(n, np.uint8) for _ in range(p)]
            louts = [np.zeros(n, np.uint8) for _ in range(p)]
            paths: list[tuple[str, tuple[Callable[..., Any], Callable[..., Any]]]] = []
            if p == 1:
                paths += [("tierfs xor whole", tierfs_paths(d, p, n)),
                          ("tierfs xor 1M", tierfs_paths(d, p, 1 << 20))]
            else:
                if "zfec" in libs:
                    paths += [("zfec whole", zfec_paths(libs["zfec"], d, p, None)),
                              ("zfec 64K", zfec_paths(libs["zfec"], d, p, 64 << 10))]
                if "pyeclib" in libs:
                    paths += [("pyeclib whole", pyeclib_whole(d, p))]
                    if (direct := isal_direct(d, p)) is not None:
                        paths += [("isa-l direct", direct)]
                    paths += [(f"tierfs {b >> 10}K", tierfs_paths(d, p, b))
                              for b in (64 << 10, 256 << 10, 1 << 20)]
            for name, (enc, dec) in paths:
                log(f"{code} {size} MiB {name}")
                got = [np.frombuffer(g, np.uint8).copy() for g in enc(data, outs)]
                if not name.startswith("zfec") and not all(np.array_equal(g, q) for g, q in zip(got, parity)):
                    raise SystemExit(f"{name}: wrong parity")
                te = median_s(lambda: enc(data, outs), args.runs)
                if name == "isa-l direct":
                    print(f"{code:>5} {size:>5} {name:<16} {d * n / te / 1e9:>12.2f} {'-':>12}", flush=True)
                    continue
                have = {i: a for i, a in enumerate(data + got) if i not in lost}  # zfec's code is its own
                got = dec(have, lost, louts)
                if not all(np.array_equal(np.frombuffer(g, np.uint8), data[i]) for g, i in zip(got, lost)):
                    raise SystemExit(f"{name}: wrong rebuilt data")
                td = median_s(lambda: dec(have, lost, louts), args.runs)
                print(f"{code:>5} {size:>5} {name:<16} {d * n / te / 1e9:>12.2f} {d * n / td / 1e9:>12.2f}",
                      flush=True)
            _erasure.RS_BLOCK, _erasure.XOR_BLOCK = defaults
    return 0


if __name__ == "__main__":
    sys.exit(main())
