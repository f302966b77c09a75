"""The drain's upload threads: one file at a time each, below the training threads, within the throttle.

Each thread takes a file from the drain's queue, uploads the bytes of the generation it opened (a rewrite
meanwhile is uploaded after), and marks the RAM copy read-only once the target has them. Uploads are
made the way the store moves bytes: paced by the shared :class:`tierfs._worker.Throttle`, at the
background priority (:func:`tierfs._worker.lower_priority`), retried with backoff on transient errors
(:func:`tierfs._retry.retry`), and written to a local target by :func:`tierfs._fileio.atomic_write`
(temporary name, fsync, rename, fsync of the directory).
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from typing import IO, TYPE_CHECKING

from .. import _units
from .._fileio import atomic_write
from .._retry import retry, short
from .._worker import lower_priority

if TYPE_CHECKING:
    from ._writeback import Drain

log = logging.getLogger("tierfs")

_DURABLE_MODE = 0o400  # a RAM copy whose bytes are on the target


def run(d: "Drain") -> None:
    """An upload thread's loop (runs for the life of the process)."""
    lower_priority()
    while True:
        with d.cond:
            while not d.queue:
                d.cond.wait()
            rel = d.queue.popleft()
            d.queued.discard(rel)
            if rel not in d.dirty or rel in d.busy:
                continue  # removed, already durable, or being uploaded (it is queued again after)
            gen = d.dirty[rel]
            try:
                fd = os.open(d.ramdir.path(rel), os.O_RDONLY)  # the bytes of generation ``gen``
            except FileNotFoundError:  # removed behind our back: nothing left to make durable
                d.dirty.pop(rel, None)
                d.cond.notify_all()
                continue
            except OSError as e:  # kept as a failure, so flush() reports it instead of waiting
                d.failed[rel] = (gen, short(e, with_type=True))
                d.counters["upload_failures"] += 1
                d.cond.notify_all()
                continue
            d.busy.add(rel)
            d.remote.add(rel)
        ok, why, nbytes = False, "", 0
        try:
            nbytes = os.fstat(fd).st_size
            d.throttle.consume(nbytes)
            upload(d, fd, rel)
            ok = True
        except BaseException as e:  # noqa: BLE001 - kept, and raised by flush()
            why = short(e, with_type=True)
            log.warning("tiered: upload of %s to %s failed (%s)", rel, d.label, why)
        with d.cond:
            d.busy.discard(rel)
            if ok:
                try:
                    os.fchmod(fd, _DURABLE_MODE)  # this inode's bytes are on the target
                except OSError as e:  # only the mark for a later process is lost: it uploads again
                    log.warning("tiered: cannot mark %s durable in RAM (%s)", rel, short(e, with_type=True))
                d.counters["uploads"] += 1
                d.counters["bytes_uploaded"] += nbytes
                if d.dirty.get(rel) == gen:
                    del d.dirty[rel]
            elif d.dirty.get(rel) == gen:
                d.failed[rel] = (gen, why)
                d.counters["upload_failures"] += 1
            if rel in d.dirty and d.dirty[rel] != gen:
                d.enqueue(rel)  # rewritten meanwhile: upload the newer bytes
            d.cond.notify_all()
        os.close(fd)


def upload(d: "Drain", fd: int, rel: str) -> None:
    """Copy the open RAM file ``fd`` to ``rel`` on the target."""
    dst = d.tpath(rel)
    if d.local_target:  # whole or not at all, and synced, like every local write of tierfs
        os.makedirs(os.path.dirname(dst), exist_ok=True)

        def copy(out: IO[bytes]) -> None:
            os.lseek(fd, 0, os.SEEK_SET)
            with os.fdopen(os.dup(fd), "rb") as inp:
                shutil.copyfileobj(inp, out, 8 << 20)
        atomic_write(dst, copy)
        return
    src = f"/proc/self/fd/{fd}"
    retry(lambda: d.target.put_file(src, dst), attempts=d.retries, what=f"upload of {rel}", label="tiered")


class ExitWork:
    """What a drain has left to upload when the interpreter exits (see :mod:`tierfs._exit`).

    Made once per exit pass. Its first wait queues every file not yet durable (a manual drain's too; one
    whose upload failed gets one more try) and waits until each is uploaded or has failed again.
    """

    def __init__(self, d: "Drain") -> None:
        self.d = d
        self._queued = False

    def _queue(self) -> None:
        """(lock held) Queue every file not yet durable, once, and start the upload threads."""
        d = self.d
        if self._queued:
            return
        self._queued = True
        for rel in d.dirty:
            d.failed.pop(rel, None)
            d.enqueue(rel)
        if d.dirty:
            d._start()
            d.cond.notify_all()

    def _left(self) -> list[str]:
        """(lock held) Files still to upload: not durable, and not failed since their last write."""
        d = self.d
        return [r for r, g in d.dirty.items() if not (r in d.failed and d.failed[r][0] >= g)]

    def _what(self, rels: list[str]) -> str:
        nbytes = sum(self.d.ramdir.sizes.get(r, 0) for r in rels)
        return f"{len(rels)} file(s) ({_units.size(nbytes)}) written through tiered://"

    def pending(self) -> str | None:
        with self.d.cond:  # a file whose upload failed before the exit counts: it gets one more try
            left = self._left() if self._queued else sorted(self.d.dirty)
            return f"{self._what(left)} not yet on {self.d.label}" if left else None

    def wait(self, timeout: float) -> bool:
        d = self.d
        deadline = time.monotonic() + timeout
        with d.cond:
            self._queue()
            while self._left():
                wait = deadline - time.monotonic()
                if wait <= 0:
                    return False
                d.cond.wait(wait)
            bad = sorted((r, f) for r, f in d.failed.items() if r in d.dirty)
        if bad:
            rel, (_, why) = bad[0]
            raise OSError(f"{len(bad)} upload(s) to {d.label} failed (e.g. {d.tpath(rel)}: {why})")
        return True

    def lost(self, reason: str) -> str:
        d = self.d
        with d.cond:
            rels = sorted(d.dirty)
        if not rels:
            return f"tierfs: at exit, {reason}; every file written through tiered:// is on {d.label}"
        return (f"tierfs: at exit, {reason}: {self._what(rels)} are NOT durable on {d.label} (e.g. "
                f"{d.tpath(rels[0])}); they remain in RAM at {d.root}, and the next process using that RAM "
                "directory and target uploads them")

    def close(self) -> None:
        """Nothing to release: the drain lives as long as the process."""


def exit_work(d: "Drain") -> ExitWork | None:
    """The drain's work at exit; None when its RAM directory is gone (nothing is left to upload)."""
    if not d.root.exists():
        return None
    return ExitWork(d)
