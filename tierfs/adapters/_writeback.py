"""The write-back machinery behind ``tiered::``: a RAM directory, what it holds, and the drain.

One :class:`Drain` per process and (RAM directory, target) keeps the RAM accounting (sizes, budget,
eviction of durable copies), the set of files not yet durable on the target, and a few low-priority
upload threads within a bandwidth cap. A file's RAM copy becomes read-only (mode 0400) once its upload
succeeded, so after a restart the writable ones are known to still need uploading.
"""

from __future__ import annotations

import atexit
import errno
import io
import itertools
import logging
import os
import shutil
import stat
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any, Iterable

import fsspec

from .._worker import Throttle
from ..errors import BackgroundError, CapacityError
from ..tiers.memory import make_private_dir, process_alive

log = logging.getLogger("tierfs")

#: bytes/s the drain may upload by default (the same cap as the store's background copies)
DEFAULT_DRAIN_BANDWIDTH = 256e6
TMP_PREFIX = ".tierfs-tmp-"
_DURABLE_MODE = 0o400  # a RAM copy whose bytes are on the target
_DIRTY_MODE = 0o600
_PERMANENT = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, FileExistsError,
              ValueError, TypeError)
_LOCAL_PROTOCOLS = ("file", "local")


def _short(e: BaseException) -> str:
    text = str(e).strip()
    line = text.splitlines()[0] if text else ""
    return f"{type(e).__name__}: {line}"[:240]



def rel_path(path: str) -> str:
    """The RAM-relative form of a target path; refuses components that could leave the RAM directory."""
    rel = path.strip("/")
    if not rel:
        return ""
    for part in rel.split("/"):
        if part in ("", ".", "..") or "\x00" in part or part.startswith(TMP_PREFIX):
            raise ValueError(f"unsafe path {path!r} for tiered://: no empty, '.', '..' or "
                             f"'{TMP_PREFIX}*' components")
    return rel


class Drain:
    """Per process and (RAM directory, target): what RAM holds, what is not yet durable, and the uploads.

    Every change to the RAM directory's names happens under ``cond``'s lock, so the eviction of a durable
    copy never races with a rewrite of the same name.
    """

    def __init__(self, root: Path, target: fsspec.AbstractFileSystem, label: str, *, budget: int | None,
                 drain: str, bandwidth: float | None, concurrency: int, retries: int, when_full: str) -> None:
        self.root, self.target, self.label = root, target, label
        self.budget, self.mode, self.retries, self.when_full = budget, drain, retries, when_full
        self.concurrency = concurrency
        self.throttle = Throttle(bandwidth)
        self.local_target = protocol_of(target) in _LOCAL_PROTOCOLS
        self.cond = threading.Condition()
        self.sizes: dict[str, int] = {}  # every file in RAM -> bytes; insertion order = least recently written
        self.dirty: dict[str, int] = {}  # files whose newest bytes are not yet on the target -> generation
        self.failed: dict[str, tuple[int, str]] = {}  # generation that failed and why
        self.remote: set[str] = set()  # files that may have a copy on the target
        self.busy: set[str] = set()  # being uploaded
        self.queue: deque[str] = deque()
        self.queued: set[str] = set()
        self.reserved = 0
        self.gen = itertools.count(1)
        self.tmp_ids = itertools.count()
        self.threads: list[threading.Thread] = []
        self.counters = {"ram_reads": 0, "target_reads": 0, "uploads": 0, "bytes_uploaded": 0,
                         "upload_failures": 0, "evictions": 0}
        make_private_dir(root)
        self._scan()
        if self.queue and self.mode == "background":
            self._start()

    # -- names --------------------------------------------------------------------------------------
    def ram(self, rel: str) -> Path:
        return self.root / rel if rel else self.root

    def tpath(self, rel: str) -> str:
        marker = self.target.root_marker or ""
        return marker + rel if not rel.startswith(marker) else rel

    def used(self) -> int:
        return sum(self.sizes.values()) + self.reserved

    def _scan(self) -> None:
        """Adopt what an earlier process left: writable files are not yet durable, read-only ones are."""
        for dirpath, _dirs, files in os.walk(self.root):
            for name in files:
                p = Path(dirpath) / name
                if name.startswith(TMP_PREFIX):
                    pid = name[len(TMP_PREFIX):].split("-", 1)[0]
                    if pid.isdigit() and not process_alive(int(pid)):
                        p.unlink(missing_ok=True)
                    continue
                self._adopt(p)

    def _adopt(self, p: Path) -> bool:
        """Track a file found in the RAM directory; True if it still needs uploading."""
        try:
            rel = rel_path(p.relative_to(self.root).as_posix())
            st = p.stat()
        except (ValueError, OSError):
            return False
        if not stat.S_ISREG(st.st_mode) or rel in self.busy:
            return False
        self.sizes[rel] = st.st_size
        self.remote.add(rel)  # an older copy may be on the target
        if st.st_mode & stat.S_IWUSR and rel not in self.dirty:
            self.dirty[rel] = next(self.gen)
            self._enqueue(rel)
            return True
        return False

    def adopt(self, rel: str) -> int:
        """Queue every file under ``rel`` that another program wrote straight into the RAM directory."""
        n = 0
        with self.cond:
            base = self.ram(rel)
            paths = [base] if base.is_file() else [Path(d) / f for d, _, fs in os.walk(base) for f in fs
                                                   if not f.startswith(TMP_PREFIX)]
            for p in paths:
                n += self._adopt(p)
            if n and self.mode == "background":
                self._start()
            self.cond.notify_all()
        return n

    # -- space --------------------------------------------------------------------------------------
    def _room(self, rel: str, nbytes: int) -> None:
        """Make room for ``nbytes`` replacing ``rel`` (lock held): evict durable copies, oldest first,
        then wait for the drain if allowed; raise CapacityError when it cannot fit."""
        while True:
            over = 0 if self.budget is None else self.used() - self.sizes.get(rel, 0) + nbytes - self.budget
            try:
                sv = os.statvfs(self.root)
                over = max(over, nbytes - sv.f_bavail * sv.f_frsize)
            except OSError:
                pass
            if over <= 0:
                return
            for r in [r for r in self.sizes if r != rel and r not in self.dirty and r not in self.busy]:
                if over <= 0:
                    break
                over -= self.sizes[r]
                self._unlink(r, prune=True)
                self.counters["evictions"] += 1
            if over <= 0:
                return
            waiting = [r for r in self.dirty if r != rel and r not in self.failed]
            if (self.budget is not None and nbytes > self.budget) or not waiting or self.when_full != "wait":
                break
            self._start()
            for r in waiting:
                self._enqueue(r)
            self.cond.wait()
        dirty_bytes = sum(self.sizes.get(r, 0) for r in self.dirty)
        budget = "none" if self.budget is None else f"{self.budget / 1e6:.1f} MB"
        raise CapacityError(
            f"tiered RAM directory {self.root}: writing {nbytes / 1e6:.1f} MB does not fit (budget {budget}, "
            f"{dirty_bytes / 1e6:.1f} MB not yet durable on {self.label}); raise budget=, flush() more "
            f"often or write less")

    def _unlink(self, rel: str, prune: bool = False) -> None:
        """Remove a file from RAM (lock held); with ``prune`` also its empty parent directories."""
        p = self.ram(rel)
        try:
            p.unlink()
        except FileNotFoundError:
            pass
        self.sizes.pop(rel, None)
        if prune:
            self._prune(p.parent)

    def _prune(self, d: Path) -> None:
        while d != self.root and self.root in d.parents:
            try:
                d.rmdir()
            except OSError:
                return
            d = d.parent

    # -- writing ------------------------------------------------------------------------------------
    def tmpfile(self, rel: str) -> Path:
        """A fresh private temporary file next to ``rel``'s RAM path."""
        final = self.ram(rel)
        with self.cond:  # created under the lock: eviction never prunes a directory holding it
            if final.is_dir():
                raise IsADirectoryError(f"{self.tpath(rel)} is a directory")
            make_private_dir(final.parent)
            tmp = final.parent / f"{TMP_PREFIX}{os.getpid()}-{next(self.tmp_ids)}"
            os.close(os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, _DIRTY_MODE))
        return tmp

    def reserve(self, rel: str, nbytes: int) -> None:
        with self.cond:
            self._room(rel, nbytes)
            self.reserved += nbytes

    def unreserve(self, nbytes: int) -> None:
        with self.cond:
            self.reserved -= nbytes
            self.cond.notify_all()

    def write(self, rel: str, data: Any, exclusive: bool = False) -> None:
        """Write ``data`` as ``rel`` in RAM (temporary file, then rename) and queue it for the target."""
        n = memoryview(data).nbytes
        tmp = self.tmpfile(rel)
        try:
            self.reserve(rel, n)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        try:
            try:
                with open(tmp, "wb", opener=private_opener) as f:
                    f.write(data)
            except OSError as e:
                tmp.unlink(missing_ok=True)
                if e.errno == errno.ENOSPC:
                    raise CapacityError(f"tiered RAM directory {self.root} is full writing {self.tpath(rel)}; "
                                        "flush() and free space, or raise the tmpfs size") from None
                raise
            self.commit(tmp, rel, exclusive, reserved=n)
        finally:
            self.unreserve(n)

    def commit(self, tmp: Path, rel: str, exclusive: bool = False, reserved: int | None = None) -> None:
        """Rename a finished temporary file to ``rel`` and queue the upload."""
        size = tmp.stat().st_size
        remote = exclusive and rel not in self.sizes and self._remote_exists(rel)  # (no request under the lock)
        with self.cond:
            try:
                if exclusive and (rel in self.sizes or remote):
                    raise FileExistsError(f"{self.tpath(rel)} exists (mode='create')")
                if reserved is None:
                    self._room(rel, size)
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
            os.replace(tmp, self.ram(rel))
            self.sizes.pop(rel, None)
            self.sizes[rel] = size  # most recently written last
            self.mark_dirty(rel)

    def _remote_exists(self, rel: str) -> bool:
        try:
            return bool(self.target.exists(self.tpath(rel)))
        except Exception:  # noqa: BLE001 - an unreachable target cannot prove the file exists
            return False

    def mark_dirty(self, rel: str) -> None:
        """(lock held) ``rel``'s RAM copy is newer than the target's."""
        self.dirty[rel] = next(self.gen)
        self.failed.pop(rel, None)
        if self.mode == "background":
            self._enqueue(rel)
            self._start()
        self.cond.notify_all()

    def _enqueue(self, rel: str) -> None:
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
                f = open(self.ram(rel), "rb")
            except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
                return None
            self.counters["ram_reads"] += 1
            return f

    def count(self, key: str, n: int = 1) -> None:
        with self.cond:
            self.counters[key] += n

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
        with self.cond:
            p = self.ram(rel)
            if p.is_dir():
                under = [r for r in self.sizes if r.startswith(rel + "/") or not rel]
                if not recursive and (under or any(p.iterdir())):
                    raise IsADirectoryError(f"{self.tpath(rel)} is a non-empty directory; pass recursive=True")
                self._settle(under)
                remote = any(r in self.remote for r in under)
                for r in under:
                    self.sizes.pop(r, None)
                    self.remote.discard(r)
                if p == self.root:
                    for child in p.iterdir():
                        shutil.rmtree(child) if child.is_dir() else child.unlink()
                else:
                    shutil.rmtree(p, ignore_errors=True)
                self.cond.notify_all()
                return True, remote or recursive
            if rel in self.sizes:
                self._settle([rel])
                remote = rel in self.remote
                self.remote.discard(rel)
                self._unlink(rel)
                self.cond.notify_all()
                return True, remote
        return False, True

    def move(self, rel1: str, rel2: str) -> bool | None:
        """Rename a RAM file. Returns None if RAM does not hold ``rel1``, else whether the target may
        hold a copy of ``rel1`` that must be removed."""
        with self.cond:
            if rel1 not in self.sizes:
                return None
            dst = self.ram(rel2)
            if dst.is_dir():
                raise IsADirectoryError(f"{self.tpath(rel2)} is a directory")
            make_private_dir(dst.parent)
            self._settle([rel1, rel2])
            os.replace(self.ram(rel1), dst)
            os.chmod(dst, _DIRTY_MODE)  # a new name on the target: not durable yet
            size = self.sizes.pop(rel1)
            self.sizes.pop(rel2, None)
            self.sizes[rel2] = size
            remote = rel1 in self.remote
            self.remote.discard(rel1)
            self.mark_dirty(rel2)
            return remote

    # -- the drain ----------------------------------------------------------------------------------
    def _start(self) -> None:
        """(lock held) Start the upload threads, once."""
        self.threads = [t for t in self.threads if t.is_alive()]
        while len(self.threads) < self.concurrency:
            t = threading.Thread(target=self._run, name=f"tierfs-drain-{len(self.threads)}", daemon=True)
            t.start()
            self.threads.append(t)

    def _run(self) -> None:
        try:  # below the training threads (Linux: a thread's nice value is its own)
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        except (AttributeError, OSError):
            pass
        while True:
            with self.cond:
                while not self.queue:
                    self.cond.wait()
                rel = self.queue.popleft()
                self.queued.discard(rel)
                if rel not in self.dirty or rel in self.busy:
                    continue  # removed, already durable, or being uploaded (it is queued again after)
                gen = self.dirty[rel]
                try:
                    fd = os.open(self.ram(rel), os.O_RDONLY)  # the bytes of generation ``gen``
                except FileNotFoundError:  # removed behind our back: nothing left to make durable
                    self.dirty.pop(rel, None)
                    self.cond.notify_all()
                    continue
                except OSError as e:  # kept as a failure, so flush() reports it instead of waiting
                    self.failed[rel] = (gen, _short(e))
                    self.counters["upload_failures"] += 1
                    self.cond.notify_all()
                    continue
                self.busy.add(rel)
                self.remote.add(rel)
            ok, why, nbytes = False, "", 0
            try:
                nbytes = os.fstat(fd).st_size
                self.throttle.consume(nbytes)
                self._upload(fd, rel)
                ok = True
            except BaseException as e:  # noqa: BLE001 - kept, and raised by flush()
                why = _short(e)
                log.warning("tiered: upload of %s to %s failed (%s)", rel, self.label, why)
            with self.cond:
                self.busy.discard(rel)
                if ok:
                    try:
                        os.fchmod(fd, _DURABLE_MODE)  # this inode's bytes are on the target
                    except OSError as e:  # only the mark for a later process is lost: it uploads again
                        log.warning("tiered: cannot mark %s durable in RAM (%s)", rel, _short(e))
                    self.counters["uploads"] += 1
                    self.counters["bytes_uploaded"] += nbytes
                    if self.dirty.get(rel) == gen:
                        del self.dirty[rel]
                elif self.dirty.get(rel) == gen:
                    self.failed[rel] = (gen, why)
                    self.counters["upload_failures"] += 1
                if rel in self.dirty and self.dirty[rel] != gen:
                    self._enqueue(rel)  # rewritten meanwhile: upload the newer bytes
                self.cond.notify_all()
            os.close(fd)

    def _upload(self, fd: int, rel: str) -> None:
        src, dst = f"/proc/self/fd/{fd}", self.tpath(rel)
        if self.local_target:  # atomic and synced: temporary name, fsync, rename
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            tmp = f"{dst}{TMP_PREFIX}{os.getpid()}-{next(self.tmp_ids)}"
            try:
                with open(tmp, "wb") as out:
                    os.lseek(fd, 0, os.SEEK_SET)
                    with os.fdopen(os.dup(fd), "rb") as inp:
                        shutil.copyfileobj(inp, out, 8 << 20)
                    out.flush()
                    os.fsync(out.fileno())
                os.replace(tmp, dst)
                dfd = os.open(os.path.dirname(dst) or ".", os.O_RDONLY)
                try:
                    os.fsync(dfd)  # the rename itself survives a power loss
                finally:
                    os.close(dfd)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
            return
        for attempt in range(self.retries):
            try:
                self.target.put_file(src, dst)
                return
            except _PERMANENT:
                raise
            except Exception as e:  # noqa: BLE001 - transient until the retries run out
                if attempt + 1 == self.retries:
                    raise
                delay = 0.2 * 2**attempt
                log.warning("tiered: upload of %s failed (%s); retry %d/%d in %.1fs", rel, _short(e),
                            attempt + 1, self.retries - 1, delay)
                time.sleep(delay)

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every file written so far is on the target; raise if any is not."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.cond:
            want = dict(self.dirty)
            for rel in want:  # failed ones get another try; a manual drain starts here
                self.failed.pop(rel, None)
                self._enqueue(rel)
            if want:
                self._start()
                self.cond.notify_all()

            def open_() -> list[str]:
                return [r for r, g in want.items() if r in self.dirty and not
                        (r in self.failed and self.failed[r][0] >= self.dirty[r])]
            while left := open_():
                wait = None if deadline is None else deadline - time.monotonic()
                if wait is not None and wait <= 0:
                    raise TimeoutError(f"tiered flush: {len(left)} file(s) not yet durable on {self.label} "
                                       f"after {timeout}s (e.g. {self.tpath(left[0])}); call flush() again")
                self.cond.wait(wait)
            bad = [(r, self.failed[r][1]) for r in want if r in self.dirty and r in self.failed]
        if bad:
            raise BackgroundError(
                f"tiered flush: {len(bad)} of {len(want)} file(s) are NOT durable on {self.label} "
                f"(e.g. {self.tpath(bad[0][0])}: {bad[0][1]}); they are still in RAM at {self.root}; fix the "
                "target and call flush() again")

    def pending(self) -> list[str]:
        with self.cond:
            return sorted(self.tpath(r) for r in self.dirty)


def private_opener(path: str, flags: int) -> int:
    return os.open(path, flags, _DIRTY_MODE)


def protocol_of(fs: fsspec.AbstractFileSystem) -> str:
    return fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]


DRAINS: dict[tuple, Drain] = {}
DRAINS_LOCK = threading.Lock()


@atexit.register
def _warn_unflushed() -> None:
    for d in list(DRAINS.values()):
        left = d.pending()
        if left and d.root.exists():
            log.warning("tiered: %d file(s) written through tiered:// were not flushed to %s (e.g. %s); they "
                        "remain in RAM at %s and are uploaded by the next process using it", len(left),
                        d.label, left[0], d.root)


class RamWriter(io.RawIOBase):
    """A file being written into RAM: a private temporary file renamed into place on close (or on the
    transaction's commit). Leaving a ``with`` block by an exception discards it."""

    def __init__(self, drain: Drain, rel: str, *, exclusive: bool, autocommit: bool) -> None:
        super().__init__()
        self.drain, self.rel, self.exclusive, self.autocommit = drain, rel, exclusive, autocommit
        self.path = drain.tpath(rel)
        self.mode = "wb"
        self._tmp = drain.tmpfile(rel)
        self._f = open(self._tmp, "wb", opener=private_opener)
        self._state = "open"

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        try:
            return self._f.write(b)
        except OSError as e:
            if e.errno == errno.ENOSPC:
                self.discard()
                raise CapacityError(f"tiered RAM directory {self.drain.root} is full writing {self.path}; "
                                    "flush() and free space, or raise the tmpfs size") from None
            raise

    def tell(self) -> int:
        return self._f.tell()

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._f.seek(offset, whence)

    def fileno(self) -> int:
        return self._f.fileno()

    def flush(self) -> None:
        if not self._f.closed:
            self._f.flush()

    def close(self) -> None:
        if self._state == "open":
            self._f.close()
            self._state = "closed"
            if self.autocommit:
                self.commit()
        super().close()

    def commit(self) -> None:
        """Rename into place and queue for the target."""
        if self._state == "committed":
            return
        if not self._f.closed:
            self._f.close()
        self._state = "committed"
        self.drain.commit(self._tmp, self.rel, self.exclusive)

    def discard(self) -> None:
        """Drop what was written."""
        if not self._f.closed:
            self._f.close()
        self._state = "committed"
        self._tmp.unlink(missing_ok=True)
        super().close()

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.discard()
        else:
            self.close()

    def __del__(self) -> None:
        if getattr(self, "_state", "committed") == "open":
            self.discard()  # never closed: nothing half-written becomes a file
