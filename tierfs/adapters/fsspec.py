"""``tiered::`` — an fsspec filesystem that puts a RAM tier in front of any other filesystem.

Any pipeline that writes through fsspec (zarr, DCP's ``FsspecWriter``, pandas, a plain ``fsspec.open``
loop) gains a RAM tier by changing only its URL::

    fs, root = fsspec.url_to_fs("tiered::s3://bucket/run", tiered={"path": "/dev/shm/tierfs/run"},
                                s3={"endpoint_url": ...})
    fs.pipe(f"{root}/a.bin", data)     # lands in RAM; copied to s3://bucket/run/a.bin in the background
    fs.flush()                         # returns once everything written is durable on the target

Paths are the target's paths (``bucket/run/a.bin`` here); the RAM directory mirrors them
(``/dev/shm/tierfs/run/bucket/run/a.bin``). A write goes to a temporary file in RAM that is renamed into
place, so a reader never sees half a file, and is then queued for the *drain*: a few low-priority
threads that upload within a bandwidth cap. A file's RAM copy is marked read-only (mode 0400) once its
upload succeeded, so the drain knows after a restart which files still need uploading.

The drain is shared by every instance of this class in the process that has the same RAM directory
and target (fsspec makes separate instances per thread and for async use, and zarr makes its own), so
``flush()`` on any of them waits for writes made through all of them.
"""

from __future__ import annotations

import asyncio
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
from glob import has_magic
from collections import deque
from pathlib import Path
from typing import Any, Iterable

import fsspec
from fsspec.asyn import AsyncFileSystem, sync
from fsspec.transaction import Transaction
from fsspec.utils import stringify_path, tokenize

from .._worker import Throttle
from ..errors import BackgroundError, CapacityError, TierfsError
from ..tiers.memory import default_path, make_private_dir

try:  # fsspec >= 2025.9: url_to_fs hands a chained filesystem the target's path
    from fsspec.implementations.chained import ChainedFileSystem

    _BASES: tuple[type, ...] = (AsyncFileSystem, ChainedFileSystem)
except ImportError:  # pragma: no cover - older fsspec
    _BASES = (AsyncFileSystem,)

log = logging.getLogger("tierfs")

#: bytes/s the drain may upload by default (the same cap as the store's background copies)
DEFAULT_DRAIN_BANDWIDTH = 256e6
_TMP_PREFIX = ".tierfs-tmp-"
_DURABLE_MODE = 0o400  # a RAM copy whose bytes are on the target
_DIRTY_MODE = 0o600
_PERMANENT = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, FileExistsError,
              ValueError, TypeError)
_LOCAL_PROTOCOLS = ("file", "local")


def _short(e: BaseException) -> str:
    text = str(e).strip()
    line = text.splitlines()[0] if text else ""
    return f"{type(e).__name__}: {line}"[:240]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _rel(path: str) -> str:
    """The RAM-relative form of a target path; refuses components that could leave the RAM directory."""
    rel = path.strip("/")
    if not rel:
        return ""
    for part in rel.split("/"):
        if part in ("", ".", "..") or "\x00" in part or part.startswith(_TMP_PREFIX):
            raise ValueError(f"unsafe path {path!r} for tiered://: no empty, '.', '..' or "
                             f"'{_TMP_PREFIX}*' components")
    return rel


class _Drain:
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
        self.local_target = _protocol(target) in _LOCAL_PROTOCOLS
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
                if name.startswith(_TMP_PREFIX):
                    pid = name[len(_TMP_PREFIX):].split("-", 1)[0]
                    if pid.isdigit() and not _alive(int(pid)):
                        p.unlink(missing_ok=True)
                    continue
                self._adopt(p)

    def _adopt(self, p: Path) -> bool:
        """Track a file found in the RAM directory; True if it still needs uploading."""
        try:
            rel = _rel(p.relative_to(self.root).as_posix())
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
                                                   if not f.startswith(_TMP_PREFIX)]
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
            tmp = final.parent / f"{_TMP_PREFIX}{os.getpid()}-{next(self.tmp_ids)}"
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
                with open(tmp, "wb", opener=_private_opener) as f:
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
        with self.cond:
            try:
                if reserved is None:
                    self._room(rel, size)
                if exclusive and (rel in self.sizes or self._remote_exists(rel)):
                    raise FileExistsError(f"{self.tpath(rel)} exists (mode='create')")
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
        with self.cond:
            if rel not in self.sizes:
                return None
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
                except FileNotFoundError:
                    self.dirty.pop(rel, None)
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
                    os.fchmod(fd, _DURABLE_MODE)  # this inode's bytes are on the target
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
            tmp = f"{dst}{_TMP_PREFIX}{os.getpid()}-{next(self.tmp_ids)}"
            try:
                with open(tmp, "wb") as out:
                    os.lseek(fd, 0, os.SEEK_SET)
                    with os.fdopen(os.dup(fd), "rb") as inp:
                        shutil.copyfileobj(inp, out, 8 << 20)
                    out.flush()
                    os.fsync(out.fileno())
                os.replace(tmp, dst)
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


def _private_opener(path: str, flags: int) -> int:
    return os.open(path, flags, _DIRTY_MODE)


def _protocol(fs: fsspec.AbstractFileSystem) -> str:
    return fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]


_DRAINS: dict[tuple, _Drain] = {}
_DRAINS_LOCK = threading.Lock()


@atexit.register
def _warn_unflushed() -> None:
    for d in list(_DRAINS.values()):
        left = d.pending()
        if left and d.root.exists():
            log.warning("tiered: %d file(s) written through tiered:// were not flushed to %s (e.g. %s); they "
                        "remain in RAM at %s and are uploaded by the next process using it", len(left),
                        d.label, left[0], d.root)


class _FlushingTransaction(Transaction):
    """``with fs.transaction:`` commits the files written inside, then flushes them to the target."""

    def complete(self, commit: bool = True) -> None:
        fs = self.fs
        super().complete(commit)
        if commit and fs is not None:
            fs.flush()


class TieredFileSystem(*_BASES):  # type: ignore[misc]
    """A write-back RAM tier in front of any fsspec filesystem (``tiered::s3://bucket/run``).

    Parameters
    ----------
    path:
        RAM directory (created 0700), on tmpfs such as ``/dev/shm``. Default
        ``/dev/shm/tierfs/<job id>-fsspec``. Target paths are mirrored below it.
    target_protocol, target_options:
        The filesystem behind the RAM tier and its options (what ``tiered::s3://...`` sets).
    fo:
        The target URL or path (``s3://bucket/run``); with no ``target_protocol`` the protocol comes from it.
    fs:
        A target filesystem instance instead of ``target_protocol``/``target_options``.
    budget:
        Most bytes the RAM directory may hold. Files already durable on the target are evicted oldest
        first to make room; then a write waits for the drain (``when_full="wait"``) or raises
        ``CapacityError`` (``"raise"``), as it does when the data cannot fit at all. Default: the free
        space of the filesystem holding ``path``.
    drain:
        ``"background"`` (default): upload each file as soon as it is written. ``"manual"``: upload only
        in ``flush()`` (nothing competes with training until then).
    drain_bandwidth:
        Bytes per second the uploads may move (default 256 MB/s; None: no cap).
    drain_concurrency:
        Files uploaded at once (default 4).
    retries:
        Attempts per upload on transient errors, with backoff.
    when_full:
        ``"wait"`` or ``"raise"``, see ``budget``.

    Notes
    -----
    The drain (queue, threads, RAM accounting) is shared by every instance with the same RAM directory
    and target in the process; the first instance's drain options apply. Reads come from RAM while it
    holds a file, else from the target. This filesystem assumes it is the only writer of its target
    paths (a job-scoped prefix), as any write-back cache does.
    """

    protocol = "tiered"
    root_marker = ""
    transaction_type = _FlushingTransaction

    def __init__(self, path: str | None = None, target_protocol: str | None = None,
                 target_options: dict[str, Any] | None = None, fo: str | None = None,
                 fs: fsspec.AbstractFileSystem | None = None, *, budget: int | None = None,
                 drain: str = "background", drain_bandwidth: float | None = DEFAULT_DRAIN_BANDWIDTH,
                 drain_concurrency: int = 4, retries: int = 4, when_full: str = "wait",
                 asynchronous: bool = False, loop: Any = None, batch_size: int | None = None) -> None:
        super().__init__(asynchronous=asynchronous, loop=loop, batch_size=batch_size)
        if drain not in ("background", "manual"):
            raise ValueError(f"drain must be 'background' or 'manual', got {drain!r}")
        if when_full not in ("wait", "raise"):
            raise ValueError(f"when_full must be 'wait' or 'raise', got {when_full!r}")
        if budget is not None and int(budget) <= 0:
            raise ValueError(f"budget must be a positive number of bytes or None, got {budget!r}")
        opts = {k: v for k, v in (target_options or {}).items() if k not in ("asynchronous", "loop")}
        if fs is None:
            if target_protocol is None:
                if not fo or "://" not in str(fo):
                    raise ValueError("tiered:// needs a target: use a URL such as tiered::s3://bucket/run, "
                                     "or pass target_protocol= (or fs=)")
                target_protocol = str(fo).split("://", 1)[0]
            fs = fsspec.filesystem(target_protocol, **opts)
            key: Any = (target_protocol, tokenize(opts))
        else:
            key = (type(fs).__name__, getattr(fs, "_fs_token", id(fs)))
        self.target = fs
        self.fo = fo
        root = Path(path if path is not None else default_path() + "-fsspec")
        make_private_dir(root)
        root = root.resolve()
        label = f"{_protocol(fs)}://{self._strip_protocol(fo) if fo else ''}"
        dkey = (os.getpid(), str(root), key)
        with _DRAINS_LOCK:
            d = _DRAINS.get(dkey)
            if d is None:
                d = _DRAINS[dkey] = _Drain(root, fs, label, budget=budget, drain=drain,
                                           bandwidth=drain_bandwidth, concurrency=max(1, int(drain_concurrency)),
                                           retries=max(1, int(retries)), when_full=when_full)
            elif (d.budget, d.mode, d.throttle.rate, d.when_full) != (budget, drain, drain_bandwidth, when_full):
                log.warning("tiered: %s already has a drain with other options; keeping the first ones", root)
        self._drain = d

    # -- paths --------------------------------------------------------------------------------------
    @classmethod
    def _strip_protocol(cls, path: Any) -> Any:
        if isinstance(path, (list, tuple)):
            return [cls._strip_protocol(p) for p in path]
        path = stringify_path(path)
        for prefix in ("tiered::", "tiered://"):
            if path.startswith(prefix):
                path = path[len(prefix):]
        if "::" in path:
            path = path.rsplit("::", 1)[-1]
        if "://" in path:
            path = path.split("://", 1)[1]
        return path.rstrip("/") or ("/" if path.startswith("/") else "")

    def _norm(self, path: Any) -> tuple[str, str]:
        """``(target path, RAM-relative path)`` of a user path."""
        tp = self.target._strip_protocol(self._strip_protocol(path))
        tp = tp.rstrip("/") or tp
        return tp, _rel(tp)

    def ram_path(self, path: str) -> str:
        """The local directory or file that mirrors ``path`` in RAM; directories are created (0700).

        For tools that cannot call fsspec (tensorstore's ``file`` kvstore): write below it, then call
        :meth:`adopt` so the drain uploads what was written.
        """
        _, rel = self._norm(path)
        p = self._drain.ram(rel)
        if not p.exists():
            make_private_dir(p)
        return str(p)

    def adopt(self, path: str) -> int:
        """Queue the files another program wrote below ``ram_path(path)``; returns how many were new."""
        _, rel = self._norm(path)
        return self._drain.adopt(rel)

    # -- durability ---------------------------------------------------------------------------------
    def flush(self, timeout: float | None = None) -> None:
        """Wait until every file written through any instance for this RAM directory and target is
        durable on the target. Raises ``BackgroundError`` (one line) naming a file that is not."""
        self._drain.flush(timeout)

    async def _flush(self, timeout: float | None = None) -> None:
        await asyncio.to_thread(self._drain.flush, timeout)

    def pending(self) -> list[str]:
        """Target paths written but not (yet) durable on the target."""
        return self._drain.pending()

    def stats(self) -> dict[str, int]:
        """Counters shared by the instances of this drain: ``ram_reads``, ``target_reads``, ``uploads``,
        ``bytes_uploaded``, ``upload_failures``, ``evictions``."""
        with self._drain.cond:
            return dict(self._drain.counters)

    def __enter__(self) -> "TieredFileSystem":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.flush()

    # -- reading ------------------------------------------------------------------------------------
    def _read_ram(self, rel: str, start: int | None, end: int | None) -> bytes | None:
        f = self._drain.open_ram(rel)
        if f is None:
            return None
        with f:
            size = os.fstat(f.fileno()).st_size
            s = 0 if start is None else (max(0, size + start) if start < 0 else min(start, size))
            e = size if end is None else (max(0, size + end) if end < 0 else min(end, size))
            if e <= s:
                return b""
            f.seek(s)
            return f.read(e - s)

    async def _cat_file(self, path: str, start: int | None = None, end: int | None = None, **kwargs) -> bytes:
        tp, rel = self._norm(path)
        data = await asyncio.to_thread(self._read_ram, rel, start, end)
        if data is not None:
            return data
        self._drain.count("target_reads")
        return await asyncio.to_thread(self.target.cat_file, tp, start=start, end=end, **kwargs)

    async def _get_file(self, rpath: str, lpath: str, **kwargs) -> None:
        tp, rel = self._norm(rpath)
        f = self._drain.open_ram(rel)
        if f is None:
            if rel and self._drain.ram(rel).is_dir():
                os.makedirs(lpath, exist_ok=True)
                return
            self._drain.count("target_reads")
            await asyncio.to_thread(self.target.get_file, tp, lpath, **kwargs)
            return

        def copy() -> None:
            with f, open(lpath, "wb") as out:
                shutil.copyfileobj(f, out, 8 << 20)
        await asyncio.to_thread(copy)

    def _open(self, path: str, mode: str = "rb", block_size: Any = None, autocommit: bool = True,
              cache_options: dict | None = None, **kwargs):
        tp, rel = self._norm(path)
        if "r" in mode and "+" not in mode:
            f = self._drain.open_ram(rel)
            if f is not None:
                return f
            self._drain.count("target_reads")
            return self.target.open(tp, mode, block_size=block_size, cache_options=cache_options, **kwargs)
        if mode in ("wb", "xb", "ab"):
            if not rel:
                raise IsADirectoryError(f"{path} is the root")
            if mode == "xb" and self.exists(tp):
                raise FileExistsError(f"{tp} exists (mode='xb')")
            w = _RamWriter(self._drain, rel, exclusive=mode == "xb", autocommit=autocommit)
            if mode == "ab" and self.exists(tp):
                w.write(self.cat_file(tp))
            return w
        raise ValueError(f"tiered:// opens files with rb, wb, xb or ab, not {mode!r}")

    # -- writing ------------------------------------------------------------------------------------
    async def _pipe_file(self, path: str, value: Any, mode: str = "overwrite", **kwargs) -> None:
        _, rel = self._norm(path)
        if not rel:
            raise IsADirectoryError(f"{path} is the root")
        await asyncio.to_thread(self._drain.write, rel, value, mode == "create")

    async def _put_file(self, lpath: str, rpath: str, mode: str = "overwrite", **kwargs) -> None:
        if os.path.isdir(lpath):
            await self._makedirs(rpath, exist_ok=True)
            return
        _, rel = self._norm(rpath)
        d = self._drain

        def put() -> None:
            size = os.path.getsize(lpath)
            tmp = d.tmpfile(rel)
            try:
                d.reserve(rel, size)
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
            try:
                try:
                    with open(lpath, "rb") as src, open(tmp, "wb", opener=_private_opener) as dst:
                        shutil.copyfileobj(src, dst, 8 << 20)
                except BaseException:
                    tmp.unlink(missing_ok=True)
                    raise
                d.commit(tmp, rel, mode == "create", reserved=size)
            finally:
                d.unreserve(size)
        await asyncio.to_thread(put)

    async def _cp_file(self, path1: str, path2: str, **kwargs) -> None:
        tp1, rel1 = self._norm(path1)
        tp2, rel2 = self._norm(path2)
        f = self._drain.open_ram(rel1)
        if f is None:  # only the target holds it: copy there, and drop an older RAM copy of the destination
            await self._forget(rel2)
            self._drain.count("target_reads")
            await asyncio.to_thread(self.target.cp_file, tp1, tp2, **kwargs)
            return

        def copy() -> None:
            with f:
                size = os.fstat(f.fileno()).st_size
                tmp = self._drain.tmpfile(rel2)
                try:
                    self._drain.reserve(rel2, size)
                except BaseException:
                    tmp.unlink(missing_ok=True)
                    raise
                try:
                    with open(tmp, "wb", opener=_private_opener) as out:
                        shutil.copyfileobj(f, out, 8 << 20)
                    self._drain.commit(tmp, rel2, reserved=size)
                except BaseException:
                    tmp.unlink(missing_ok=True)
                    raise
                finally:
                    self._drain.unreserve(size)
        await asyncio.to_thread(copy)

    async def _forget(self, rel: str) -> None:
        """Drop RAM's copy of a file about to be replaced on the target alone."""
        if rel in self._drain.sizes:
            await asyncio.to_thread(self._drain.remove, rel, False)

    async def _mv_file(self, path1: str, path2: str) -> None:
        tp1, rel1 = self._norm(path1)
        tp2, rel2 = self._norm(path2)
        if tp1 == tp2:
            return
        remote = await asyncio.to_thread(self._drain.move, rel1, rel2)
        if remote is None:  # not in RAM
            await self._forget(rel2)
            await asyncio.to_thread(self.target.mv, tp1, tp2)
        elif remote:
            await asyncio.to_thread(_rm_quiet, self.target, tp1, False)

    def mv(self, path1: Any, path2: Any, recursive: bool = False, maxdepth: int | None = None, **kwargs) -> None:
        """Move a file; a file held in RAM is renamed there (no copy) and its new name queued."""
        if isinstance(path1, str) and isinstance(path2, str) and not recursive and self.isfile(path1):
            return sync(self.loop, self._mv_file, path1, path2)
        return super().mv(path1, path2, recursive=recursive, maxdepth=maxdepth, **kwargs)

    async def _makedirs(self, path: str, exist_ok: bool = False) -> None:
        tp, rel = self._norm(path)
        p = self._drain.ram(rel)
        if not exist_ok and (p.is_dir() or await self._isdir(tp)):
            raise FileExistsError(tp)
        if p.is_file():
            raise FileExistsError(f"{tp} is a file")
        await asyncio.to_thread(make_private_dir, p)

    async def _mkdir(self, path: str, create_parents: bool = True, **kwargs) -> None:
        tp, rel = self._norm(path)
        if not create_parents and not await self._isdir(self._parent(tp)):
            raise FileNotFoundError(f"parent of {tp} does not exist")
        await self._makedirs(path, exist_ok=True)

    # -- removing -----------------------------------------------------------------------------------
    async def _rm_file(self, path: str, **kwargs) -> None:
        await self._rm_one(path, False)

    async def _rm(self, path: Any, recursive: bool = False, maxdepth: int | None = None, **kwargs) -> None:
        paths = [path] if isinstance(path, str) else list(path)
        if maxdepth is not None or any(has_magic(p) for p in paths):
            paths = await self._expand_path(paths, recursive=recursive, maxdepth=maxdepth)
            for p in sorted(paths, reverse=True):  # files before their directories
                await self._rm_one(p, False, missing_ok=True)
            return
        for p in paths:
            await self._rm_one(p, recursive)

    async def _rm_one(self, path: str, recursive: bool, missing_ok: bool = False) -> None:
        tp, rel = self._norm(path)
        in_ram, remote = await asyncio.to_thread(self._drain.remove, rel, recursive)
        if not remote:
            return
        try:
            await asyncio.to_thread(self.target.rm, tp, recursive=recursive)
        except FileNotFoundError:
            if not in_ram and not missing_ok:
                raise FileNotFoundError(tp) from None

    # -- listing ------------------------------------------------------------------------------------
    def _ram_info(self, rel: str, tp: str) -> dict[str, Any] | None:
        try:
            st = self._drain.ram(rel).stat()
        except (FileNotFoundError, NotADirectoryError):
            return None
        kind = "directory" if stat.S_ISDIR(st.st_mode) else "file"
        return {"name": tp, "size": st.st_size if kind == "file" else 0, "type": kind, "mtime": st.st_mtime,
                "tier": "ram"}

    def _ram_ls(self, rel: str, tp: str) -> list[dict[str, Any]] | None:
        p = self._drain.ram(rel)
        if p.is_file():
            return [self._ram_info(rel, tp)]  # type: ignore[list-item]
        if not p.is_dir():
            return None
        out = []
        for entry in os.scandir(p):
            if entry.name.startswith(_TMP_PREFIX):
                continue
            child = f"{rel}/{entry.name}" if rel else entry.name
            info = self._ram_info(child, self._drain.tpath(child))
            if info is not None:
                out.append(info)
        return out

    async def _info(self, path: str, **kwargs) -> dict[str, Any]:
        tp, rel = self._norm(path)
        info = self._ram_info(rel, tp) if rel else None
        if info is not None:
            return info
        out = await asyncio.to_thread(self.target.info, tp, **kwargs)
        return {**out, "name": out["name"].rstrip("/") or out["name"], "tier": "target"}

    async def _ls(self, path: str, detail: bool = True, **kwargs) -> list:
        tp, rel = self._norm(path)
        ram = await asyncio.to_thread(self._ram_ls, rel, tp)
        try:
            remote = await asyncio.to_thread(self.target.ls, tp, detail=True, **kwargs)
        except FileNotFoundError:
            remote = None
        if ram is None and remote is None:
            raise FileNotFoundError(tp)
        merged = {i["name"].rstrip("/"): {**i, "name": i["name"].rstrip("/"), "tier": "target"}
                  for i in remote or []}
        merged.update({i["name"]: i for i in ram or []})
        infos = [merged[k] for k in sorted(merged)]
        return infos if detail else [i["name"] for i in infos]

    def _ram_find(self, rel: str, tp: str, maxdepth: int | None, withdirs: bool) -> dict[str, dict]:
        base = self._drain.ram(rel)
        out: dict[str, dict] = {}
        if base.is_file():
            return {tp: self._ram_info(rel, tp)}  # type: ignore[dict-item]
        if not base.is_dir():
            return out
        if withdirs and rel:
            out[tp] = self._ram_info(rel, tp)  # type: ignore[assignment]
        depth0 = len(base.parts)
        for dirpath, dirs, files in os.walk(base):
            depth = len(Path(dirpath).parts) - depth0 + 1  # entries directly below ``base`` are at depth 1
            names = files + dirs if withdirs else list(files)
            if maxdepth is not None and depth >= maxdepth:
                dirs[:] = []
            for name in names:
                if name.startswith(_TMP_PREFIX):
                    continue
                child = Path(dirpath, name).relative_to(self._drain.root).as_posix()
                ctp = self._drain.tpath(child)
                info = self._ram_info(child, ctp)
                if info is not None:
                    out[ctp] = info
        return out

    async def _find(self, path: str, maxdepth: int | None = None, withdirs: bool = False, **kwargs):
        detail = kwargs.pop("detail", False)
        tp, rel = self._norm(path)
        ram = await asyncio.to_thread(self._ram_find, rel, tp, maxdepth, withdirs)
        try:
            remote = await asyncio.to_thread(self.target.find, tp, maxdepth=maxdepth, withdirs=withdirs,
                                             detail=True, **kwargs)
        except FileNotFoundError:
            remote = {}
        merged = {k.rstrip("/"): {**v, "name": k.rstrip("/"), "tier": "target"} for k, v in remote.items()}
        merged.update(ram)
        names = sorted(merged)
        return {n: merged[n] for n in names} if detail else names


def _rm_quiet(fs: fsspec.AbstractFileSystem, path: str, recursive: bool) -> None:
    try:
        fs.rm(path, recursive=recursive)
    except FileNotFoundError:
        pass


class _RamWriter(io.RawIOBase):
    """A file being written into RAM: a private temporary file renamed into place on close (or on the
    transaction's commit). Leaving a ``with`` block by an exception discards it."""

    def __init__(self, drain: _Drain, rel: str, *, exclusive: bool, autocommit: bool) -> None:
        super().__init__()
        self.drain, self.rel, self.exclusive, self.autocommit = drain, rel, exclusive, autocommit
        self.path = drain.tpath(rel)
        self.mode = "wb"
        self._tmp = drain.tmpfile(rel)
        self._f = open(self._tmp, "wb", opener=_private_opener)
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
