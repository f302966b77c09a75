"""The write-back machinery behind ``tiered::``: what the RAM directory holds that the target does not.

One :class:`Drain` per process and (RAM directory, target) keeps the RAM directory (``ramdir.RamDir``:
sizes, temporary files, listings), the set of files not yet durable on the target, eviction of durable
copies when room is short, and the upload threads (``upload.run``, which sees the drain through the
``upload.Drain`` protocol, so that imports go one way). A file's RAM copy becomes read-only (mode 0400)
once its upload succeeded, so after a restart the writable ones are known to still need uploading. The
filesystem (``filesystem.py``) uses the drain's named operations only. At interpreter exit the uploads
still pending are finished within the drain's ``exit_timeout`` (:mod:`tierfs.util.exitwork`,
:class:`upload.ExitWork`, which also moves aside the files whose upload failed for good, so that no
later process retries them).
"""

from __future__ import annotations

import errno
import io
import itertools
import os
import posixpath
import shutil
import stat
import threading
import time
from collections import deque
from pathlib import Path
from typing import IO, Any, Callable, Iterable, Union

import fsspec

from ..util import exitwork as _exit
from ..util import readable as _readable
from ..util.fileio import FILE_MODE, private_opener
from ..util.worker import Throttle
from ..errors import BackgroundError, CapacityError
from . import upload
from .ramdir import RamDir, rel_path
from .upload import Failure

_DIRTY_MODE = FILE_MODE  # a RAM copy whose newest bytes are not yet on the target (0600)
_LOCAL_PROTOCOLS = ("file", "local")
#: what a write puts in RAM: bytes-like, or a function that writes into the open file
Source = Union[bytes, bytearray, memoryview, Any, Callable[[IO[bytes]], None]]


def protocol_of(fs: fsspec.AbstractFileSystem) -> str:
    return fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]


class Drain:
    """Per process and (RAM directory, target): what RAM holds, what is not yet durable, and the uploads.

    Every change to the RAM directory's names happens under ``cond``'s lock, so the eviction of a durable
    copy never races with a rewrite of the same name.
    """

    def __init__(self, root: Path, target: fsspec.AbstractFileSystem, *, budget: int | None,
                 drain: str, bandwidth: float | None, concurrency: int, retries: int, when_full: str,
                 exit_timeout: float = _exit.DEFAULT_EXIT_TIMEOUT) -> None:
        self.target, self.protocol, self.exit_timeout = target, protocol_of(target), exit_timeout
        self.budget, self.mode, self.retries, self.when_full = budget, drain, retries, when_full
        self.concurrency, self.throttle = concurrency, Throttle(bandwidth)
        self.local_target = self.protocol in _LOCAL_PROTOCOLS
        self.ramdir = RamDir(root)
        self.cond = threading.Condition()
        self.dirty: dict[str, int] = {}  # files whose newest bytes are not yet on the target -> generation
        self.failed: dict[str, Failure] = {}  # the generation whose upload failed, why, and for good or not
        self.remote: set[str] = set()  # files that may have a copy on the target
        self.busy: set[str] = set()  # being uploaded
        self.queue: deque[str] = deque()  # to upload, each once (``queued``)
        self.queued: set[str] = set()
        self.gen = itertools.count(1)
        self.threads: list[threading.Thread] = []
        self.counters = {"ram_reads": 0, "target_reads": 0, "uploads": 0, "bytes_uploaded": 0,
                         "upload_failures": 0, "evictions": 0}
        for p in self.ramdir.leftovers():  # what an earlier process left
            self._adopt(p)
        if self.queue and self.mode == "background":
            self._start()

    @property
    def root(self) -> Path:
        return self.ramdir.root

    def same_options(self, budget: int | None, drain: str, bandwidth: float | None, when_full: str,
                     exit_timeout: float) -> bool:
        return ((self.budget, self.mode, self.throttle.rate, self.when_full, self.exit_timeout) ==
                (budget, drain, bandwidth, when_full, exit_timeout))

    def tpath(self, rel: str) -> str:
        marker = self.target.root_marker or ""
        return marker + rel if not rel.startswith(marker) else rel

    def where(self, rel: str) -> str:
        """``rel`` on the target as messages name it: a URL (``s3://bucket/run/a.bin``), a local target's
        file as its path."""
        return self.tpath(rel) if self.local_target else f"{self.protocol}://{self.tpath(rel)}"

    def place(self, rels: Iterable[str]) -> str:
        """Where on the target ``rels`` go, as a URL: their common directory (``s3://bucket/run``)."""
        paths = [self.tpath(r) for r in rels]
        try:
            common = posixpath.commonpath(paths) if paths else ""
        except ValueError:  # absolute and relative paths mixed
            common = ""
        return f"{self.protocol}://{common}"

    def _adopt(self, p: Path) -> bool:
        """(lock held) Track a file found in the RAM directory; True if it still needs uploading.
        Writable files are not yet durable, read-only ones are."""
        try:
            rel = rel_path(p.relative_to(self.root).as_posix())
            st = p.stat()
        except (ValueError, OSError):
            return False
        if not stat.S_ISREG(st.st_mode) or rel in self.busy:
            return False
        self.ramdir.sizes[rel] = st.st_size
        self.remote.add(rel)  # an older copy may be on the target
        if st.st_mode & stat.S_IWUSR and rel not in self.dirty:
            self.dirty[rel] = next(self.gen)
            self.enqueue(rel)
            return True
        return False

    def adopt(self, rel: str) -> int:
        """Queue every file under ``rel`` that another program wrote straight into the RAM directory."""
        with self.cond:
            n = sum(self._adopt(p) for p in self.ramdir.files_under(rel))
            if n and self.mode == "background":
                self._start()
            self.cond.notify_all()
        return n

    # -- space --------------------------------------------------------------------------------------
    def _room(self, rel: str, nbytes: int) -> None:
        """Make room for ``nbytes`` replacing ``rel`` (lock held): evict durable copies, oldest first,
        then wait for the drain if allowed; raise CapacityError when it cannot fit."""
        sizes = self.ramdir.sizes
        while True:
            available = self.ramdir.capacity(self.budget, replacing=rel).available
            over = 0 if available is None else nbytes - available
            if over <= 0:
                return
            for r in [r for r in sizes if r != rel and r not in self.dirty and r not in self.busy]:
                if over <= 0:
                    break
                over -= sizes[r]
                self.ramdir.unlink(r, prune=True)
                self.counters["evictions"] += 1
            if over <= 0:
                return
            waiting = [r for r in self.dirty if r != rel and r not in self.failed]
            if (self.budget is not None and nbytes > self.budget) or not waiting or self.when_full != "wait":
                break
            self._start()
            for r in waiting:
                self.enqueue(r)
            self.cond.wait()
        dirty_bytes = sum(sizes.get(r, 0) for r in self.dirty)
        budget = "none" if self.budget is None else _readable.size(self.budget)
        raise CapacityError(
            f"tiered RAM directory {self.root}: writing {_readable.size(nbytes)} does not fit (budget {budget}, "
            f"{_readable.size(dirty_bytes)} not yet durable on {self.place(self.dirty)}); raise budget=, flush() more "
            f"often or write less")

    def full_error(self, rel: str) -> CapacityError:
        return CapacityError(f"tiered RAM directory {self.root} is full writing {self.tpath(rel)}; "
                             "flush() and free space, or raise the tmpfs size")

    # -- writing ------------------------------------------------------------------------------------
    def tmpfile(self, rel: str) -> Path:
        """A fresh private temporary file next to ``rel``'s RAM path."""
        with self.cond:  # created under the lock: eviction never prunes a directory holding it
            return self.ramdir.tmpfile(rel, self.tpath(rel))

    def write(self, rel: str, data: Source, exclusive: bool = False, size: int | None = None) -> None:
        """Write ``data`` (bytes-like, or a function writing ``size`` bytes into the open file) as ``rel``
        in RAM: room first, then a temporary file renamed into place, then queued for the target."""
        if size is None:
            if callable(data):
                raise TypeError("Drain.write: a writer function needs size=")
            size = memoryview(data).nbytes
        n = size
        tmp = self.tmpfile(rel)
        try:
            with self.cond:
                self._room(rel, n)
                self.ramdir.reserved += n
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        try:
            try:
                with open(tmp, "wb", opener=private_opener) as f:
                    data(f) if callable(data) else f.write(data)
            except BaseException as e:
                tmp.unlink(missing_ok=True)
                if isinstance(e, OSError) and e.errno == errno.ENOSPC:
                    raise self.full_error(rel) from None
                raise
            self.commit(tmp, rel, exclusive, reserved=True)
        finally:
            with self.cond:
                self.ramdir.reserved -= n
                self.cond.notify_all()

    def commit(self, tmp: Path, rel: str, exclusive: bool = False, reserved: bool = False) -> None:
        """Rename a finished temporary file to ``rel`` and queue the upload."""
        size = tmp.stat().st_size
        sizes = self.ramdir.sizes
        remote = exclusive and rel not in sizes and self._remote_exists(rel)  # (no request under the lock)
        with self.cond:
            try:
                if exclusive and (rel in sizes or remote):
                    raise FileExistsError(f"{self.tpath(rel)} exists (mode='create')")
                if not reserved:
                    self._room(rel, size)
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
            os.replace(tmp, self.ramdir.path(rel))
            sizes.pop(rel, None)
            sizes[rel] = size  # most recently written last
            self._mark_dirty(rel)

    def _remote_exists(self, rel: str) -> bool:
        try:
            return bool(self.target.exists(self.tpath(rel)))
        except Exception:  # noqa: BLE001 - an unreachable target cannot prove the file exists
            return False

    def _mark_dirty(self, rel: str) -> None:
        """(lock held) ``rel``'s RAM copy is newer than the target's."""
        self.dirty[rel] = next(self.gen)
        self.failed.pop(rel, None)
        if self.mode == "background":
            self.enqueue(rel)
            self._start()
        self.cond.notify_all()

    def enqueue(self, rel: str) -> None:
        """(lock held) Queue ``rel`` for an upload thread, once."""
        if rel not in self.queued:
            self.queued.add(rel)
            self.queue.append(rel)

    # -- reading ------------------------------------------------------------------------------------
    def open_ram(self, rel: str) -> io.BufferedReader | None:
        """The RAM copy of ``rel`` open for reading, or None when RAM does not hold it."""
        if not rel:
            return None
        with self.cond:  # (eviction unlinks under this lock: an open file stays readable)
            try:
                f = open(self.ramdir.path(rel), "rb")
            except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
                return None
            self.counters["ram_reads"] += 1
            return f

    def count_target_read(self) -> None:
        with self.cond:
            self.counters["target_reads"] += 1

    def stats(self) -> dict[str, int]:
        with self.cond:
            return dict(self.counters)

    # -- removing and renaming ----------------------------------------------------------------------
    def _settle(self, rels: Iterable[str]) -> None:
        """(lock held) Forget pending uploads of ``rels`` and wait for the running ones to end."""
        rels = set(rels)
        for r in rels:
            self.dirty.pop(r, None)
            self.failed.pop(r, None)
        while rels & self.busy:
            self.cond.wait()

    def remove(self, rel: str, recursive: bool) -> tuple[bool, bool]:
        """Remove ``rel`` from RAM. Returns (RAM held it, the target may hold a copy)."""
        sizes = self.ramdir.sizes
        with self.cond:
            p = self.ramdir.path(rel)
            if p.is_dir():
                under = [r for r in sizes if r.startswith(rel + "/") or not rel]
                if not recursive and (under or any(c != self.ramdir.failed_dir for c in p.iterdir())):
                    raise IsADirectoryError(f"{self.tpath(rel)} is a non-empty directory; pass recursive=True")
                self._settle(under)
                remote = any(r in self.remote for r in under)
                for r in under:
                    sizes.pop(r, None)
                    self.remote.discard(r)
                if p == self.root:  # (failed uploads stay: they are nowhere else)
                    for child in p.iterdir():
                        if child != self.ramdir.failed_dir:
                            shutil.rmtree(child) if child.is_dir() else child.unlink()
                else:
                    shutil.rmtree(p, ignore_errors=True)
                self.cond.notify_all()
                return True, remote or recursive
            if rel in sizes:
                self._settle([rel])
                remote = rel in self.remote
                self.remote.discard(rel)
                self.ramdir.unlink(rel)
                self.cond.notify_all()
                return True, remote
        return False, True

    def forget(self, rel: str) -> None:
        """Drop RAM's copy of a file about to be replaced on the target alone."""
        if self.ramdir.holds(rel):
            self.remove(rel, False)

    def move(self, rel1: str, rel2: str) -> bool | None:
        """Rename a RAM file. Returns None if RAM does not hold ``rel1``, else whether the target may
        hold a copy of ``rel1`` that must be removed."""
        sizes = self.ramdir.sizes
        with self.cond:
            if rel1 not in sizes:
                return None
            dst = self.ramdir.path(rel2)
            if dst.is_dir():
                raise IsADirectoryError(f"{self.tpath(rel2)} is a directory")
            self.ramdir.make_dir(posixpath.dirname(rel2))
            self._settle([rel1, rel2])
            os.replace(self.ramdir.path(rel1), dst)
            os.chmod(dst, _DIRTY_MODE)  # a new name on the target: not durable yet
            size = sizes.pop(rel1)
            sizes.pop(rel2, None)
            sizes[rel2] = size
            remote = rel1 in self.remote
            self.remote.discard(rel1)
            self._mark_dirty(rel2)
            return remote

    # -- the drain ----------------------------------------------------------------------------------
    def _start(self) -> None:
        """(lock held) Start the upload threads, once."""
        self.threads = [t for t in self.threads if t.is_alive()]
        while len(self.threads) < self.concurrency:
            t = threading.Thread(target=upload.run, args=(self,), name=f"tierfs-drain-{len(self.threads)}",
                                 daemon=True)
            t.start()
            self.threads.append(t)

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every file written so far is on the target; raise if any is not."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.cond:
            want = dict(self.dirty)
            for rel in want:  # failed ones get another try; a manual drain starts here
                self.failed.pop(rel, None)
                self.enqueue(rel)
            if want:
                self._start()
                self.cond.notify_all()

            def open_() -> list[str]:
                return [r for r, g in want.items() if r in self.dirty and not
                        (r in self.failed and self.failed[r].gen >= self.dirty[r])]
            while left := open_():
                wait = None if deadline is None else deadline - time.monotonic()
                if wait is not None and wait <= 0:
                    raise TimeoutError(f"tiered flush: {len(left)} file(s) not yet durable on {self.place(left)} "
                                       f"after {timeout}s (e.g. {self.where(left[0])}); call flush() again")
                self.cond.wait(wait)
            bad = [(r, self.failed[r].why) for r in want if r in self.dirty and r in self.failed]
        if bad:
            raise BackgroundError(
                f"tiered flush: {len(bad)} of {len(want)} file(s) are NOT durable on {self.place(r for r, _ in bad)} "
                f"(e.g. {self.where(bad[0][0])}: {bad[0][1]}); they are still in RAM at {self.root}; fix the "
                "target and call flush() again")

    def pending(self) -> list[str]:
        with self.cond:
            return sorted(self.tpath(r) for r in self.dirty)

