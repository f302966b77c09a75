"""The RAM tier's locks: one job per directory, and leases on the steps zero-copy views map.

**The job lock.** Every process of a job that writes to a RAM directory holds a shared ``flock`` on a lock
file in its own directory there (``.pool.<pid>/.lock``, beside its buffer pool), naming the job
(:func:`job_token`) and the process. A process that finds such a file held under another job's name gets one
:class:`~tierfs.errors.TierUnavailableError` naming the directory and the holders' pids, instead of deleting
the first job's step in flight. The ranks of one job on a node (they may share its directory) have the same
name, so they never lock each other out. The kernel drops a ``flock`` when its process ends, however it ends
(SIGKILL included): a job started after it finds the directory free. Looking at the others' files and taking
one's own happen under an exclusive ``flock`` of the directory itself (held for microseconds), so two jobs
starting at once never both go on. The directory's top level gets no file of its own.

**Step leases.** A process that hands out zero-copy views of a step's files holds a shared ``flock`` on the
step's directory (:class:`Lease`) for as long as any of those views lives. A process deleting its files of
the step (retention, in any process of the job) recycles them into its pool of buffers only while it holds
the directory exclusively (:func:`unleased`), which it cannot while a lease is held: then it unlinks them,
so a file a view maps is never written again (its pages live until the last view goes). A reader takes its
lease, then checks that the marker is still there and that each file it maps is the one it verified (its
inode): a file recycled before is gone from its place, and one recycled after cannot be.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import shutil
import sys
import threading
import time
import uuid
import weakref
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from ..util.fileio import process_alive
from .rootdir import mapping_processes
from ..errors import TierUnavailableError
from ..format import MARKER
from ._mapped import map_private, no_space
from ._room import full

__all__ = ["Exports", "JobLock", "Lease", "LOCK_FILE", "holders", "job_token", "remove_dead_pools", "unleased", "users"]

#: a process's part of the job lock, in its own directory of a RAM tier's (``.pool.<pid>``)
LOCK_FILE = ".lock"
log = logging.getLogger("tierfs")
#: errors of a file system without ``flock``: there nothing is locked (as before tierfs locked), with a warning
_NO_FLOCK = frozenset({errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL, errno.ENOSYS})
_warned: set[int] = set()
#: the key under which the ranks of a job started without MASTER_ADDR/MASTER_PORT agree on its name
_C10D_KEY = "tierfs/ram-job"


def job_token() -> str:
    """A name the processes of one running job share and a process of another job does not have.

    A torch.distributed job of several ranks: its rendezvous address (``MASTER_ADDR:MASTER_PORT``, bound by
    the running job, so never the same for two jobs at once), else a name its ranks agree on in the job's
    c10d store. Anything else is a job of one process: its pid.
    """
    addr, port, world = (os.environ.get(k, "") for k in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE"))
    if addr and port and world.isdigit() and int(world) > 1:
        return f"torch.distributed {addr}:{port}"
    name = _c10d_name()
    return name if name is not None else f"process {os.getpid()}"


def _c10d_name() -> str | None:
    """The name the ranks of an initialised torch.distributed job (world size above 1) agree on in its
    c10d store (the first to ask sets it), or None."""
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is None or not dist.is_initialized() or dist.get_world_size() < 2:
            return None
        store = dist.distributed_c10d._get_default_store()
        got = store.compare_set(_C10D_KEY, "", f"torch.distributed {uuid.uuid4().hex}")
    except Exception:  # noqa: BLE001 - no usable store: the job is named as a process of its own
        return None
    return got.decode() if isinstance(got, bytes) else str(got)


def _flock(fd: int, op: int) -> bool:
    """``flock(fd, op)``; False when a non-blocking lock is held by another. On a file system without
    ``flock`` nothing is locked (True), with one warning."""
    try:
        fcntl.flock(fd, op)
    except BlockingIOError:
        return False
    except OSError as e:
        if e.errno not in _NO_FLOCK:
            raise
        if e.errno not in _warned:
            _warned.add(e.errno)
            log.warning("the RAM tier's file system cannot lock files (%s): a second job on one directory is not "
                        "refused, and files zero-copy views map may be reused; use tmpfs", os.strerror(e.errno))
    return True


@contextmanager
def _guard(root: Path) -> Iterator[None]:
    """An exclusive ``flock`` of the directory ``root`` itself: every open of its lock file happens under it."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        _flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # drops the flock


def _try_exclusive(fd: int) -> bool:
    return _flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)


def _read(fd: int) -> tuple[str, int | None]:
    """The job's name and the pid noted in a process's lock file."""
    os.lseek(fd, 0, os.SEEK_SET)
    name, _, pid = os.read(fd, 4096).decode(errors="replace").partition("\n")
    return name, int(pid) if pid.strip().isdigit() else None


def _held_by_others(root: Path) -> list[tuple[str, int | None]]:
    """``(job, pid)`` of every other process's lock file below ``root`` that its process holds (under the
    guard); the files of processes gone are not held (the kernel dropped their locks)."""
    mine = root / f".pool.{os.getpid()}"
    out = []
    for path in sorted(root.glob(f".pool.*/{LOCK_FILE}")):
        if path.parent == mine:
            continue
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:  # its pool went with its process
            continue
        try:
            if not _try_exclusive(fd):
                out.append(_read(fd))
        finally:
            os.close(fd)
    return out


class JobLock:
    """This process's part of the job lock of one RAM directory (see the module docstring).

    Parameters
    ----------
    root : Path
        The tier's directory.
    own : Path
        This process's directory in it (its buffer pool, ``.pool.<pid>``): the lock file is ``own / LOCK_FILE``.
    """

    _held: "weakref.WeakSet[JobLock]" = weakref.WeakSet()

    def __init__(self, root: Path, own: Path) -> None:
        self.root, self.own = root, own
        self.path = own / LOCK_FILE
        self.fd: int | None = None
        self._mutex = threading.Lock()

    @property
    def held(self) -> bool:
        return self.fd is not None

    def create(self) -> None:
        """Create the lock file now, without taking the lock (when the tier opens: a write taking the lock
        later needs no inode of a tmpfs that may be full by then). Where it cannot be created (a directory
        this process may only read), the first write tries again and says why."""
        try:
            with _guard(self.root):
                self.own.mkdir(mode=0o700, exist_ok=True)
                os.close(os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600))
        except OSError:
            pass

    def claim(self) -> None:
        """Before a write: hold the lock (a cheap look once held).

        Raises
        ------
        TierUnavailableError
            Another job holds it.
        CapacityError
            The tmpfs has no inode left for the lock file.
        """
        if self.fd is None:
            try:
                self.acquire("RAM tier")
            except OSError as e:
                if no_space(e):
                    raise full(self.root, "locking it for this job") from None
                raise

    def acquire(self, what: str) -> None:
        """Hold the lock for this process's job (nothing if held already).

        Raises
        ------
        TierUnavailableError
            Processes of another job hold it; the message names ``what`` (the tier), the directory and their
            pids.
        """
        with self._mutex:
            if self.fd is not None:
                return
            name = job_token()
            with _guard(self.root):
                others = [pid for job, pid in _held_by_others(self.root) if job != name]
                if others:
                    raise _in_use(what, self.root, others)
                self.own.mkdir(mode=0o700, exist_ok=True)
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
                try:
                    os.ftruncate(fd, 0)
                    os.pwrite(fd, f"{name}\n{os.getpid()}\n".encode(), 0)
                    _flock(fd, fcntl.LOCK_SH)  # shared: another tier of this process on the directory may hold it
                except BaseException:
                    os.close(fd)
                    raise
            self.fd = fd
            JobLock._held.add(self)

    def release(self) -> None:
        """Let go of the lock (if held); the lock file is removed once no tier of this process holds it."""
        with self._mutex:
            fd, self.fd = self.fd, None
            JobLock._held.discard(self)
            try:
                with _guard(self.root):
                    if fd is None:
                        fd = os.open(self.path, os.O_RDONLY)
                    if _try_exclusive(fd):  # no other holder
                        os.unlink(self.path)
            except OSError:  # the directory or the file is gone: nothing to tidy
                pass
            finally:
                if fd is not None:
                    os.close(fd)

    def _forget(self) -> None:
        """In a child forked from the holder: drop this process's reference to the lock (the parent keeps it)."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def holders(root: Path) -> list[int]:
    """The live pids, other than this one, that hold their part of ``root``'s job lock."""
    try:
        with _guard(root):
            pids = [pid for _job, pid in _held_by_others(root) if pid is not None]
    except OSError:
        return []
    return sorted({p for p in pids if process_alive(p)})


def users(root: Path) -> list[int]:
    """Live processes, other than this one, using the RAM directory ``root``: they hold its job lock, own a
    buffer pool there (``.pool.<pid>``) or map a file in it (Linux ``/proc/<pid>/maps``)."""
    me = os.getpid()
    pids = set(holders(root))
    for d in root.glob(".pool.*"):
        owner = d.name.rsplit(".", 1)[-1]
        if owner.isdigit() and int(owner) != me and process_alive(int(owner)):
            pids.add(int(owner))
    return sorted(pids | mapping_processes(root, pids | {me}))


def remove_dead_pools(root: Path) -> None:
    """Remove the buffer pools (``.pool.<pid>``) of processes that are gone."""
    for d in root.glob(".pool.*"):
        pid = d.name.rsplit(".", 1)[-1]
        if pid.isdigit() and int(pid) != os.getpid() and not process_alive(int(pid)):
            shutil.rmtree(d, ignore_errors=True)


def _in_use(what: str, root: Path, pids: list[int | None]) -> TierUnavailableError:
    live = sorted({p for p in pids if p is not None})
    who = f"pid {live[0]}" if len(live) == 1 else f"pids {', '.join(map(str, live))}" if live else "pid unknown"
    return TierUnavailableError(
        f"{what} {root} is in use by another job ({who}): one job per RAM directory; stop that job first, or give "
        "this one a directory of its own (MemoryTier(path) or TIERFS_JOB_ID)")


def _after_fork() -> None:
    for lock in list(JobLock._held):
        lock._forget()
    JobLock._held = weakref.WeakSet()


os.register_at_fork(after_in_child=_after_fork)


class Lease:
    """A shared ``flock`` on a step's directory, held while this object lives (see the module docstring).

    Parameters
    ----------
    step_dir : Path
        The step's directory.

    Raises
    ------
    FileNotFoundError
        The directory is gone.
    """

    __slots__ = ("ino", "__weakref__")

    def __init__(self, step_dir: Path) -> None:
        fd = os.open(step_dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            _flock(fd, fcntl.LOCK_SH)  # waits only while a deleting process looks (microseconds)
            self.ino = os.fstat(fd).st_ino
        except BaseException:
            os.close(fd)
            raise
        weakref.finalize(self, os.close, fd)


@contextmanager
def unleased(step_dir: Path) -> Iterator[bool]:
    """Hold ``step_dir`` exclusively while the block runs, if no process (this one included) holds a
    :class:`Lease` on it: yields True then (the step's files may be recycled: a reader arriving meanwhile
    waits, then finds them gone), False while a lease is held (they may not)."""
    try:
        fd = os.open(step_dir, os.O_RDONLY | os.O_DIRECTORY)
    except FileNotFoundError:
        yield True
        return
    try:
        yield _exclusive_soon(fd)
    finally:
        os.close(fd)


#: seconds a deletion tries for a step directory held by another process: ranks sharing a node's directory
#: each hold it for the few renames of their own files; a zero-copy view's lease holds it far longer
_CONTENDED = 0.25


def _exclusive_soon(fd: int) -> bool:
    """An exclusive ``flock`` of ``fd`` now or within :data:`_CONTENDED` seconds (another rank's deletion of its
    files ends); False when it stays held (a lease)."""
    deadline, pause = time.monotonic() + _CONTENDED, 0.0005
    while not _try_exclusive(fd):
        if time.monotonic() >= deadline:
            return False
        time.sleep(pause)
        pause = min(2 * pause, 0.01)
    return True


class Exports:
    """The copy-on-write mappings of a tier's files that zero-copy views handed to the user are made of,
    one per file, each holding a :class:`Lease` on its step until the last view of it is gone."""

    def __init__(self) -> None:
        self._maps: "weakref.WeakValueDictionary[tuple[Path, int], Any]" = weakref.WeakValueDictionary()
        self._leases: "weakref.WeakValueDictionary[Path, Lease]" = weakref.WeakValueDictionary()
        self._mutex = threading.Lock()

    def view(self, path: Path, ino: int, size: int) -> np.ndarray:
        """A writable (copy-on-write) 1-D uint8 view of the committed file ``path`` (inode ``ino``, ``size``
        bytes) in its step's directory; its step stays leased while any view made of it lives.

        Raises
        ------
        FileNotFoundError
            The step's marker or the file is gone, or another file took its place (the step was deleted
            while it was being read): the view could not be handed out safely.
        """
        if size == 0:
            return np.empty(0, dtype=np.uint8)
        with self._mutex:
            mm = self._maps.get((path, ino))
            if mm is None:
                step_dir = path.parent
                lease = self._leases.get(step_dir)
                if lease is None or lease.ino != os.stat(step_dir).st_ino:
                    lease = self._leases[step_dir] = Lease(step_dir)
                if not (step_dir / MARKER).exists():  # after the lease: deleted, or about to be unlinked
                    raise FileNotFoundError(f"{step_dir} was deleted while it was being read")
                mm = self._maps[(path, ino)] = map_private(path, ino, size)
                weakref.finalize(mm, _keep, lease)  # the lease lives as long as the mapping
        return np.frombuffer(mm, dtype=np.uint8)


def _keep(lease: Lease) -> None:
    """A finalizer's way of holding ``lease`` (through its arguments) until a mapping is gone."""
