"""The drain's upload threads: one file at a time each, below the training threads, within the throttle.

Each thread takes a file from the drain's queue, uploads the bytes of the generation it opened (a rewrite
meanwhile is uploaded after), and marks the RAM copy read-only once the target has them. Uploads are
made the way the store moves bytes: paced by the shared :class:`tierfs.util.worker.Throttle`, at the
background priority (:func:`tierfs.util.worker.lower_priority`), retried with backoff on transient errors
(:func:`tierfs.util.retry.retry`), and written to a local target by :func:`tierfs.util.fileio.atomic_write`
(temporary name, fsync, rename, fsync of the directory).
"""

from __future__ import annotations

import logging
import os
import posixpath
import shutil
import time
from typing import IO, TYPE_CHECKING, Iterable, NamedTuple, Protocol

from ..util import readable as _readable
from ..util.fileio import atomic_write
from ..util.retry import PERMANENT, retry, short
from ..util.worker import lower_priority
from .ramdir import rel_path

if TYPE_CHECKING:
    import threading
    from collections import deque
    from pathlib import Path

    import fsspec

    from ..util.worker import Throttle
    from .ramdir import RamDir

log = logging.getLogger("tierfs")

_DURABLE_MODE = 0o400  # a RAM copy whose bytes are on the target


class Failure(NamedTuple):
    """A file's failed upload: the generation tried, why (one line), and whether retrying cannot fix it
    (:data:`tierfs.util.retry.PERMANENT`: a missing bucket, no permission)."""

    gen: int
    why: str
    permanent: bool


class Drain(Protocol):
    """What the upload threads and the work at exit use of a drain (``writeback.Drain``, which starts
    the threads on :func:`run`): its state, read and changed under ``cond``'s lock, and its names for
    places on the target."""

    cond: threading.Condition
    ramdir: RamDir
    target: fsspec.AbstractFileSystem
    throttle: Throttle
    local_target: bool
    mode: str
    retries: int
    dirty: dict[str, int]  # files whose newest bytes are not yet on the target -> generation
    failed: dict[str, Failure]
    remote: set[str]
    busy: set[str]
    queue: deque[str]
    queued: set[str]
    counters: dict[str, int]

    @property
    def root(self) -> Path: ...

    def tpath(self, rel: str) -> str: ...

    def where(self, rel: str) -> str: ...

    def place(self, rels: Iterable[str]) -> str: ...

    def enqueue(self, rel: str) -> None: ...

    def _start(self) -> None: ...

    def _adopt(self, p: Path) -> bool: ...


def run(d: Drain) -> None:
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
                d.failed[rel] = Failure(gen, short(e, with_type=True), False)
                d.counters["upload_failures"] += 1
                d.cond.notify_all()
                continue
            d.busy.add(rel)
            d.remote.add(rel)
        ok, why, permanent, nbytes = False, "", False, 0
        try:
            nbytes = os.fstat(fd).st_size
            d.throttle.consume(nbytes)
            upload(d, fd, rel)
            ok = True
        except BaseException as e:  # noqa: BLE001 - kept, and raised by flush()
            why, permanent = short(e, with_type=True), isinstance(e, PERMANENT)
            log.warning("tiered: upload to %s failed (%s)", d.where(rel), why)
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
                d.failed[rel] = Failure(gen, why, permanent)
                d.counters["upload_failures"] += 1
            if rel in d.dirty and d.dirty[rel] != gen:
                d.enqueue(rel)  # rewritten meanwhile: upload the newer bytes
            d.cond.notify_all()
        os.close(fd)


def upload(d: Drain, fd: int, rel: str) -> None:
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
    """What a drain has left to upload when the interpreter exits (see :mod:`tierfs.util.exitwork`).

    Made once per exit pass. Its first wait queues every file not yet durable (a manual drain's too; one
    whose upload failed gets one more try) and waits until each is uploaded or has failed again.

    A file whose upload then fails for good (a missing bucket, no permission: ``tierfs.util.retry.PERMANENT``)
    is moved to the RAM directory's ``.tierfs-failed/`` (same relative path), which no listing shows and
    no later process uploads: it is not retried by every process that uses the RAM directory, and it is
    not lost. Once the target is fixed, ``TieredFileSystem.retry_failed()`` (or moving it back below the RAM
    directory, where the next process using that directory and target adopts it) uploads it. A file whose
    upload failed otherwise (the store down, a timeout) stays in place, and the next process retries it.
    Either way the process exits with status 1 (:mod:`tierfs.util.exitwork`).
    """

    def __init__(self, d: Drain) -> None:
        self.d = d
        self._queued = False
        self.set_aside: dict[str, int] = {}  # files moved to the failed uploads -> bytes

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
        return [r for r, g in d.dirty.items() if not (r in d.failed and d.failed[r].gen >= g)]

    def _what(self, rels: list[str]) -> str:
        nbytes = sum(self.d.ramdir.sizes.get(r, self.set_aside.get(r, 0)) for r in rels)
        return f"{len(rels)} file(s) ({_readable.size(nbytes)}) written through tiered::"

    def _on(self, rels: list[str]) -> str:
        """``on <where they go> (e.g. <one of them>)``, the example left out when it says nothing more."""
        place, one = self.d.place(rels), self.d.where(rels[0])
        return f"on {place}" + (f" (e.g. {one})" if one != place else "")

    def pending(self) -> str | None:
        with self.d.cond:  # a file whose upload failed before the exit counts: it gets one more try
            left = self._left() if self._queued else sorted(self.d.dirty)
            return f"{self._what(left)} not yet on {self.d.place(left)}" if left else None

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
            bad: list[tuple[str, Failure]] = sorted((r, f) for r, f in d.failed.items() if r in d.dirty)
            for rel, f in bad:
                if f.permanent:
                    self._set_aside(rel)
        if bad:
            rel, f = bad[0]
            raise OSError(f"{len(bad)} upload(s) to {d.place(r for r, _ in bad)} failed (e.g. {d.where(rel)}: "
                          f"{f.why})")
        return True

    def _set_aside(self, rel: str) -> None:
        """(lock held) Move ``rel`` to the failed uploads: no later process retries it."""
        d = self.d
        size = d.ramdir.sizes.get(rel, 0)
        try:
            d.ramdir.set_aside(rel)
        except OSError as e:  # it stays where it is: the next process tries it again
            log.warning("tiered: cannot move %s to %s (%s)", rel, d.ramdir.failed_dir, short(e, with_type=True))
            return
        self.set_aside[rel] = size
        for table in (d.dirty, d.failed):
            table.pop(rel, None)
        d.remote.discard(rel)

    def lost(self, reason: str) -> str:
        d = self.d
        with d.cond:
            rels = sorted(d.dirty)
        moved = sorted(self.set_aside)
        said = []
        if moved:
            said.append(
                f"{self._what(moved)} are NOT durable {self._on(moved)} and will not be retried; they remain in "
                f"RAM at {d.ramdir.failed_dir} (fix the target, then call retry_failed() on a tiered:: filesystem with "
                "that RAM directory and target, or move them back below it)")
        if rels:
            said.append(
                f"{self._what(rels)} are NOT durable {self._on(rels)}; they remain in RAM at {d.root}, and the next "
                "process using that RAM directory and target uploads them")
        if not said:
            return f"tierfs: at exit, {reason}; every file written through tiered:: is on {d.place([])}"
        return f"tierfs: at exit, {reason}: " + "; ".join(said)

    def close(self) -> None:
        """Nothing to release: the drain lives as long as the process."""


def retry_failed(d: Drain) -> int:
    """Move the files whose upload failed for good at an earlier exit (``ramdir.FAILED``, see
    :class:`ExitWork`) back into place in ``d``'s RAM directory and queue them; returns how many. A file
    written again since stays as written (its failed copy, older, is dropped)."""
    with d.cond:
        moved = 0
        for p in d.ramdir.failed_files():
            rel = rel_path(p.relative_to(d.ramdir.failed_dir).as_posix())
            if rel in d.ramdir.sizes or rel in d.busy:
                p.unlink(missing_ok=True)
                continue
            d.ramdir.make_dir(posixpath.dirname(rel))
            os.replace(p, d.ramdir.path(rel))
            moved += d._adopt(d.ramdir.path(rel))
        d.ramdir.prune_failed()
        if moved and d.mode == "background":
            d._start()
        d.cond.notify_all()
    return moved


def exit_work(d: Drain) -> ExitWork | None:
    """The drain's work at exit; None when its RAM directory is gone (nothing is left to upload)."""
    if not d.root.exists():
        return None
    return ExitWork(d)
