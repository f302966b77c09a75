"""The RAM tier: a private directory on tmpfs whose files stay mapped and are reused.

Saving into fresh tmpfs pages costs 3-7x a plain memory copy (page set-up). So this tier keeps every
file it wrote mapped, and when retention deletes a step its shard files move to a per-process pool
instead of being unlinked; the next save renames pooled files into the new step (a mapping follows its
file) and copies straight into pages that are already there. New files are reserved with
``posix_fallocate`` (a full tmpfs becomes a clean CapacityError, never a SIGBUS) and pre-faulted with
``MADV_POPULATE_WRITE``.
"""

from __future__ import annotations

import getpass
import itertools
import mmap
import os
import shutil
import threading
from pathlib import Path
from typing import Mapping

import numpy as np

from ..errors import CapacityError, TierUnavailableError
from ..format import MARKER, parse_step_dirname, step_dirname, validate_filename
from ..policies import LatestN, PreservationPolicy, SavePolicy
from .base import Capacity, Tier

MADV_POPULATE_READ = 22
MADV_POPULATE_WRITE = 23


def default_path() -> str:
    """``/dev/shm/tierfs/<job id>``; the job id comes from TIERFS_JOB_ID, torchrun or SLURM."""
    job = (os.environ.get("TIERFS_JOB_ID") or os.environ.get("TORCHELASTIC_RUN_ID")
           or os.environ.get("SLURM_JOB_ID") or getpass.getuser())
    return f"/dev/shm/tierfs/{validate_filename(job)}"


def make_private_dir(path: Path) -> None:
    """Create ``path`` (and parents) with mode 0700; refuse a directory other users can enter."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.stat()
    if st.st_uid != os.getuid():
        raise TierUnavailableError(f"{path} belongs to another user; use a directory of your own")
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)


class _Buf:
    """A mapped file: the mapping outlives renames of the file."""

    __slots__ = ("path", "size", "mm", "writable", "exported")

    def __init__(self, path: Path, size: int, mm: mmap.mmap | None, writable: bool) -> None:
        self.path, self.size, self.mm, self.writable, self.exported = path, size, mm, writable, False

    def array(self) -> np.ndarray:
        if self.mm is None:
            return np.empty(0, dtype=np.uint8)
        return np.frombuffer(self.mm, dtype=np.uint8)

    def close(self) -> None:
        if self.mm is not None:
            try:
                self.mm.close()
            except BufferError:  # a view is still alive; the mapping goes when it does
                pass
            self.mm = None


class MemoryTier(Tier):
    """Steps in a private directory on tmpfs, written by memory copies into reused mappings.

    Parameters
    ----------
    path:
        Directory for this job on this node (default ``/dev/shm/tierfs/<job id>``). Created 0700.
    save, keep:
        Policies; default every step, keep the latest 2.
    budget:
        Most bytes this tier may hold (steps, pooled buffers and, later, replicas for peers). A save that
        would exceed it fails before writing. Hold at least (kept steps + 1) steps' worth.
    name:
        Label in listings (default ``"ram"``).
    """

    kind = "memory"

    def __init__(self, path: str | os.PathLike | None = None, *, save: SavePolicy | None = None,
                 keep: PreservationPolicy | None = None, budget: int | None = None, name: str = "ram") -> None:
        super().__init__(name, save, keep if keep is not None else LatestN(2))
        self.path = Path(path if path is not None else default_path())
        self.budget = budget
        self._bufs: dict[Path, _Buf] = {}  # every file this process has mapped, by current path
        self._pool: list[_Buf] = []  # mapped files of deleted steps, ready for reuse
        self._pool_dir = self.path / f".pool.{os.getpid()}"
        self._ids = itertools.count()
        self._pool_limit = 0  # bytes: the largest step staged so far
        self._lock = threading.RLock()  # the store's worker deletes while the training thread stages
        self._idle = threading.Event()  # cleared while prepare() builds spare buffers
        self._idle.set()
        self._last_staged = -1

    # -- capabilities -------------------------------------------------------------------------------
    @property
    def is_local(self) -> bool:
        return True

    @property
    def zero_copy(self) -> bool:
        return True

    def capacity(self) -> Capacity:
        used = 0
        for root, _dirs, files in os.walk(self.path):
            for f in files:
                try:
                    used += os.stat(os.path.join(root, f)).st_size
                except FileNotFoundError:
                    pass
        try:
            sv = os.statvfs(self.path)
            free = sv.f_bavail * sv.f_frsize
        except FileNotFoundError:
            free = None
        return Capacity(used=used, budget=self.budget, free=free)

    # -- life cycle ---------------------------------------------------------------------------------
    def open(self) -> None:
        try:
            make_private_dir(self.path)
        except OSError as e:
            raise TierUnavailableError(f"RAM tier {self.path}: cannot create directory ({e.strerror})") from None
        for d in self.path.glob(".pool.*"):  # pools of processes that died
            pid = d.name.rsplit(".", 1)[-1]
            if pid.isdigit() and int(pid) != os.getpid() and not process_alive(int(pid)):
                shutil.rmtree(d, ignore_errors=True)

    def close(self) -> None:
        for b in self._bufs.values():
            b.close()
        for b in self._pool:
            b.close()
        self._bufs.clear()
        self._pool.clear()
        shutil.rmtree(self._pool_dir, ignore_errors=True)

    # -- listing ------------------------------------------------------------------------------------
    def _dir(self, step: int) -> Path:
        return self.path / step_dirname(step)

    def _file(self, step: int, name: str) -> Path:
        return self._dir(step) / validate_filename(name)

    def list_steps(self) -> dict[int, bool]:
        out = {}
        try:
            names = os.listdir(self.path)
        except FileNotFoundError:
            return {}
        for n in names:
            s = parse_step_dirname(n)
            if s is not None:
                out[s] = os.path.exists(os.path.join(self.path, n, MARKER))
        return out

    def file_sizes(self, step: int) -> dict[str, int]:
        d = self._dir(step)
        return {p.name: p.stat().st_size for p in d.iterdir() if p.is_file() and not p.name.startswith(".")}

    # -- writing ------------------------------------------------------------------------------------
    def stage(self, step: int, sizes: Mapping[str, int]) -> dict[str, np.ndarray]:
        """Map one buffer per file into the step directory, reusing pooled mappings where possible."""
        while True:  # a spare set being built is what this save needs: wait for it, don't build another
            self._idle.wait()
            with self._lock:
                if self._idle.is_set():  # prepare() clears it under this lock, so no build is under way
                    return self._stage(step, sizes)

    def _stage(self, step: int, sizes: Mapping[str, int]) -> dict[str, np.ndarray]:
        for n in sizes:
            validate_filename(n)
        self._last_staged = max(self._last_staged, step)
        self._recycle_own(step, sizes)
        total = sum(sizes.values())
        self._pool_limit = max(self._pool_limit, total)
        # Match pooled buffers to files: exact sizes first, then the smallest larger one.
        pool = sorted(self._pool, key=lambda b: b.size)
        plan: dict[str, _Buf | None] = {}
        for name, size in sorted(sizes.items(), key=lambda kv: -kv[1]):
            pick = next((b for b in pool if b.size == size), None) or next((b for b in pool if b.size > size), None)
            if pick is not None:
                pool.remove(pick)
            plan[name] = pick
        new_bytes = sum(sizes[n] for n, b in plan.items() if b is None)
        cap = self.capacity()
        if cap.available is not None and new_bytes > cap.available:
            # unmatched pooled buffers are reclaimable space: free them before giving up
            for b in pool:
                self._drop_pooled(b)
            cap = self.capacity()
            if cap.available is None or new_bytes > cap.available:
                raise CapacityError(
                    f"RAM tier {self.path}: step {step} needs {new_bytes / 1e6:.1f} MB more but only "
                    f"{max(0, cap.available or 0) / 1e6:.1f} MB is left (budget "
                    f"{'none' if self.budget is None else f'{self.budget / 1e6:.1f} MB'}, used "
                    f"{cap.used / 1e6:.1f} MB); raise budget= or keep fewer steps (need about "
                    f"(kept steps + 1) x step size)")
        d = self._dir(step)
        make_private_dir(d)
        out: dict[str, np.ndarray] = {}
        try:
            for name, b in plan.items():
                path, size = d / name, sizes[name]
                if b is None:
                    b = self._new_buf(path, size)
                else:
                    self._pool.remove(b)
                    os.rename(b.path, path)
                    b.path = path
                    if b.size != size:
                        b.close()
                        os.truncate(path, size)
                        b = self._map(path, size, writable=True)
                self._bufs[path] = b
                out[name] = b.array()
        except OSError as e:
            self.discard_staged(step)
            for name in plan:
                self._forget(d / name, unlink=True)
            if e.errno == 28:
                raise CapacityError(f"RAM tier {self.path}: out of space staging step {step}; free memory "
                                    "or keep fewer steps") from None
            raise
        self._staged[step] = out
        return out

    def write_staged(self, step: int) -> None:
        self._staged.pop(step, None)  # the bytes already are in the files

    def prepare(self, step: int, sizes: Mapping[str, int]) -> None:
        """Pre-fault one spare buffer per file of the next step, so that it never copies into fresh pages.

        Runs in the store's background worker after a commit. Until retention frees buffers of old steps
        (keep + 1 steps in), this is what keeps saves 2, 3, ... at memory speed. Skipped when the budget or
        free space would not allow it.
        """
        with self._lock:
            if self._last_staged > step:  # the next save came first and built its own buffers
                return
            self._pool_limit = max(self._pool_limit, sum(sizes.values()))
            have = sorted(b.size for b in self._pool)
            missing = []
            for size in sorted(sizes.values()):
                if size in have:
                    have.remove(size)
                elif size:
                    missing.append(size)
            avail = self.capacity().available
            if not missing or (avail is not None and sum(missing) > avail):
                return
            self._pool_dir.mkdir(mode=0o700, exist_ok=True)
            paths = [self._pool_dir / f"{next(self._ids)}.bin" for _ in missing]
            self._idle.clear()
        try:
            for path, size in zip(paths, missing):  # the slow part, outside the lock
                try:
                    b = self._new_buf(path, size)
                except OSError:
                    path.unlink(missing_ok=True)
                    return
                with self._lock:
                    self._pool.append(b)
        finally:
            self._idle.set()

    def _recycle_own(self, step: int, sizes: Mapping[str, int]) -> None:
        """An uncommitted leftover of this step: move this process's files to the pool."""
        d = self._dir(step)
        if d.exists() and not (d / MARKER).exists():
            for name in sizes:
                p = d / name
                if p.exists():
                    b = self._bufs.pop(p, None)
                    self._to_pool(p, b)

    def _new_buf(self, path: Path, size: int) -> _Buf:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            if size:
                os.posix_fallocate(fd, 0, size)  # ENOSPC here, not SIGBUS later
                mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
                try:
                    mm.madvise(MADV_POPULATE_WRITE)
                except OSError:  # kernels before 5.14
                    pass
            else:
                mm = None
        finally:
            os.close(fd)
        return _Buf(path, size, mm, writable=True)

    def _map(self, path: Path, size: int, writable: bool) -> _Buf:
        if size == 0:
            return _Buf(path, 0, None, writable)
        fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
        try:
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, prot)
        finally:
            os.close(fd)
        try:
            mm.madvise(MADV_POPULATE_READ)
        except OSError:
            pass
        return _Buf(path, size, mm, writable)

    def write_file(self, step: int, name: str, data) -> None:
        path = self._file(step, name)
        make_private_dir(path.parent)
        self._forget(path, unlink=False)
        tmp = path.with_name(f".{name}.tmp")
        mv = memoryview(data).cast("B")
        try:
            with open(tmp, "wb", opener=lambda p, f: os.open(p, f, 0o600)) as f:
                f.write(mv)
            os.rename(tmp, path)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            if e.errno == 28:
                raise CapacityError(f"RAM tier {self.path}: out of space writing {name}") from None
            raise

    def write_marker(self, step: int, data: bytes) -> None:
        self.write_file(step, MARKER, data)

    # -- reading ------------------------------------------------------------------------------------
    def read_file(self, step: int, name: str) -> np.ndarray:
        """A view of the file's bytes through a kept mapping (read-only unless this process wrote it)."""
        path = self._file(step, name)
        b = self._bufs.get(path)
        if b is None:
            size = path.stat().st_size  # FileNotFoundError when missing
            b = self._map(path, size, writable=False)
            self._bufs[path] = b
        return b.array()

    def read_range(self, step: int, name: str, start: int, end: int) -> bytes:
        return self.read_file(step, name)[start:end].tobytes()

    def export(self, step: int, name: str) -> np.ndarray:
        """A view handed to the user: its file is never reused for a later save."""
        a = self.read_file(step, name)
        self._bufs[self._file(step, name)].exported = True
        return a

    # -- deleting -----------------------------------------------------------------------------------
    def delete_step(self, step: int) -> None:
        with self._lock:
            self._delete_step(step)

    def _delete_step(self, step: int, prefix: str = "", marker: bool = True) -> None:
        d = self._dir(step)
        if marker:
            (d / MARKER).unlink(missing_ok=True)
        if not d.exists():
            return
        for p in list(d.iterdir()):
            if not p.name.startswith(prefix):
                continue
            b = self._bufs.pop(p, None)
            if b is not None and b.writable and not b.exported and p.suffix == ".bin":
                self._to_pool(p, b)
            else:
                if b is not None:
                    b.close()
                p.unlink(missing_ok=True)
        if prefix:
            try:
                os.rmdir(d)  # the last rank of the node to let go removes the directory
            except OSError:
                pass
        else:
            shutil.rmtree(d, ignore_errors=True)

    def release(self, step: int, rank: int, marker: bool) -> None:
        """Delete only ``rank``'s files of a step (its shard buffers go to this process's pool), and the
        marker if ``marker``: for ranks that share this directory with others on their node."""
        with self._lock:
            self._delete_step(step, prefix=f"rank_{rank:05d}.", marker=marker)

    def _to_pool(self, path: Path, b: _Buf | None) -> None:
        pooled = sum(x.size for x in self._pool)
        if b is None or not b.writable or b.exported or pooled + b.size > self._pool_limit:
            if b is not None:
                b.close()
            path.unlink(missing_ok=True)
            return
        self._pool_dir.mkdir(mode=0o700, exist_ok=True)
        dst = self._pool_dir / f"{next(self._ids)}.bin"
        os.rename(path, dst)
        b.path = dst
        self._pool.append(b)

    def _drop_pooled(self, b: _Buf) -> None:
        self._pool.remove(b)
        b.close()
        b.path.unlink(missing_ok=True)

    def _forget(self, path: Path, unlink: bool) -> None:
        b = self._bufs.pop(path, None)
        if b is not None:
            b.close()
        if unlink:
            path.unlink(missing_ok=True)

    def __repr__(self) -> str:
        return f"MemoryTier({str(self.path)!r})"


def process_alive(pid: int) -> bool:
    """Whether a process with this pid exists (ours or another user's)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
