"""Copy bytes and compute or check crc32c block by block, on a few threads.

numpy's copy and fastcrc's crc32c both release the GIL, so two threads use both cores. Each block is
checksummed right after it is copied, while it is still in cache.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Mapping

import numpy as np

from ..util import hooks as _hooks
from ..errors import ChecksumError, FormatError
from . import Entry, Manifest, crc32c

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def default_threads() -> int:
    return max(1, min(4, os.cpu_count() or 1))


def _executor(n: int) -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None or _pool._max_workers < n:  # noqa: SLF001 - sizing only
            _pool = ThreadPoolExecutor(max_workers=n, thread_name_prefix="tierfs-copy")
        return _pool


@dataclass
class Job:
    """One entry: copy ``src`` into ``dst`` (if given), checksumming per block.

    With ``expected`` set, each block of ``src`` is verified *before* it is copied. ``label`` names the
    entry in messages, as its user knows it (default: ``name``, quoted; see :meth:`Manifest.key`).
    """

    name: str
    src: np.ndarray
    dst: np.ndarray | None
    block_size: int
    expected: list[int] | None = None
    label: str | Callable[[], str] | None = None
    #: waits until ``src`` holds the entry's bytes (its copy from a device is done); called before each block
    ready: Callable[[], None] | None = None
    #: called with ``(start, end)`` once that block of ``src`` is verified (a restore's copy to a device)
    then: Callable[[int, int], None] | None = None

    def shown(self) -> str:
        """The entry as messages name it."""
        label = self.label() if callable(self.label) else self.label
        return label or repr(self.name)


def run(jobs: list[Job], threads: int | None = None, pace: Callable[[int], None] | None = None,
        checksum: bool = True) -> list[list[int]]:
    """Run the jobs; return each job's block checksums. Raises ChecksumError on a mismatch.

    ``pace(nbytes)`` is called before each block (a bandwidth throttle for background work). With
    ``checksum=False`` jobs only copy (their checksums come back as 0, to be computed later).
    """
    if checksum and pace is None and (threads or default_threads()) <= 1 and not _hooks.active("block") \
            and all(j.dst is None and j.expected is None and j.then is None and j.ready is None for j in jobs):
        return _sums(jobs)
    units = []  # (job, block, start, end): as names.blocks cuts them, without a generator per job
    out = []
    for j, job in enumerate(jobs):
        size, bs = job.src.size, job.block_size
        starts = range(0, size, bs) if size else range(1)
        units += [(j, b, s, min(size, s + bs)) for b, s in enumerate(starts)]
        out.append([0] * len(starts))
    n = min(threads or default_threads(), len(units))
    failed: list[BaseException] = []

    def work(stripe: int) -> None:
        for j, b, s, e in units[stripe::n]:
            if failed:
                return
            job = jobs[j]
            _hooks.at("block", name=job.name, nbytes=e - s)
            if pace is not None:
                pace(e - s)
            src = job.src[s:e]
            try:
                if job.ready is not None:
                    job.ready()
                if job.expected is not None:
                    c = crc32c(src)
                    if c != job.expected[b]:
                        raise ChecksumError(
                            f"checksum mismatch in {job.shown()} (its bytes {s}-{e}): stored "
                            f"{job.expected[b]:#010x}, read {c:#010x}")
                    if job.dst is not None:
                        np.copyto(job.dst[s:e], src)
                    elif job.then is not None:
                        job.then(s, e)
                elif job.then is not None:  # checked already: only copy
                    job.then(s, e)
                    c = 0
                elif not checksum:
                    assert job.dst is not None, "a copy without checksums needs a destination"
                    np.copyto(job.dst[s:e], src)
                    c = 0
                elif job.dst is not None:
                    np.copyto(job.dst[s:e], src)
                    c = crc32c(job.dst[s:e])
                else:
                    c = crc32c(src)
                out[j][b] = c
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
                failed.append(exc)
                return

    if n <= 1:
        work(0) if n == 1 else None
    else:
        futs = [_executor(n).submit(work, i) for i in range(n)]
        for f in futs:
            f.result()
    if failed:
        raise failed[0]
    return out



def _sums(jobs: list[Job]) -> list[list[int]]:
    """:func:`run` of jobs that only checksum, on this thread with no hook or pacing: a save's commit of
    thousands of small entries, where :func:`run`'s bookkeeping per block would cost as much as the crc32c."""
    out = []
    for job in jobs:
        src, bs = job.src, job.block_size
        n = src.size
        out.append([crc32c(src)] if n <= bs else [crc32c(src[s:s + bs]) for s in range(0, n, bs)])
    return out


def verify_small(items: "list[Job] | list[tuple[Entry, np.ndarray]]", manifest: Manifest) -> None:
    """Verify entries of one block each (``(entry, bytes)``; no copy) on this thread: thousands of small
    entries cost less so than spread over threads. With a test hook on ``"block"`` give :class:`Job` s
    (run as :func:`run` does). Raises ChecksumError on a mismatch."""
    if items and isinstance(items[0], Job):
        run(items, 1)
        return
    for e, src in items:  # type: ignore[misc]
        c = crc32c(src)
        if c != e.crc32c[0]:
            raise ChecksumError(f"checksum mismatch in {manifest.key(e.name)} (its bytes 0-{src.size}): stored "
                                f"{e.crc32c[0]:#010x}, read {c:#010x}")


def as_u8(data) -> np.ndarray:
    if isinstance(data, np.ndarray):
        return data.reshape(-1).view(np.uint8)
    return np.frombuffer(data, dtype=np.uint8)


def shard_views(manifest: Manifest, files) -> dict[str, np.ndarray]:
    """Shard files (arrays or bytes) as uint8 arrays, each checked against its length in the manifest."""
    raw = {f: as_u8(data) for f, data in files.items()}
    for f, data in raw.items():
        if f not in manifest.files:
            raise FormatError(f"{f} is not a file of the manifest of rank {manifest.rank}")
        if data.size != manifest.files[f]:
            raise FormatError(f"{f} holds {data.size} bytes, manifest says {manifest.files[f]} (truncated copy)")
    return raw


def verify(manifest: Manifest, files, threads: int | None = None,
           pace: Callable[[int], None] | None = None, landed: Mapping[str, np.ndarray] | None = None) -> None:
    """Check every block of the array entries that live in ``files`` (a subset of the shard's files); those
    ``landed`` names (``{entry name: uint8 array}``) where they landed instead."""
    raw, landed = shard_views(manifest, files), landed or {}
    run([Job(e.name, landed[e.name] if e.name in landed else raw[e.file][e.offset:e.offset + e.length], None,
             manifest.block_size, e.crc32c, manifest.key(e.name))
         for e in manifest.entries if e.kind == "array" and e.file in raw], threads, pace)
