"""The RAM tier: a private directory on tmpfs whose files stay mapped and are reused.

Saving into fresh tmpfs pages costs 3-7x a plain memory copy (page set-up). So this tier keeps every
file it wrote mapped, and when retention deletes a step its shard files move to a per-process pool
instead of being unlinked; the next save renames pooled files into the new step (a mapping follows its
file) and copies straight into pages that are already there. New files are reserved with
``posix_fallocate`` (a full tmpfs becomes a clean CapacityError, never a SIGBUS) and pre-faulted with
``MADV_POPULATE_WRITE``. A staged step that fails (no bytes or no inodes left) or that the store
discards gives its buffers back to the pool and leaves no file behind. One job writes to a directory at a
time, and no file a zero-copy view maps is reused or rewritten, by any process (:mod:`._lock`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import threading
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from ..util import args as _args
from ..util.fileio import atomic_write, make_private_dir
from .rootdir import check_root, default_path, filesystem_type, root_dir, warn_unless_memory
from ..errors import TierUnavailableError
from ..format import MARKER, parse_step_dirname, step_dirname, validate_filename
from ..policies import LatestN, PreservationPolicy, SavePolicy
from . import _room
from ._lock import Exports, JobLock, remove_dead_pools, unleased, users
from ._mapped import MappedFile, Pool, no_space, open_mapped
from .base import Bytes, Capacity, Tier

__all__ = ["MemoryTier", "default_path"]


class MemoryTier(Tier):
    """Steps in a private directory on tmpfs, written by memory copies into reused mappings.

    Parameters
    ----------
    path:
        Directory for this job on this node (default ``/dev/shm/tierfs/<job id>``), on tmpfs (elsewhere it
        works, with a warning). Created 0700. System directories (``/``, ``/etc``, ``/proc``, ``/dev/shm``
        itself, ...) are refused.
    save, keep:
        Policies; default every step, keep the latest 2.
    budget:
        Most bytes this tier may hold (steps, pooled buffers and, later, replicas for peers). A save that
        would exceed it fails before writing. Hold at least (kept steps + 1) steps' worth.
    name:
        Label in listings (default ``"ram"``).
    """

    kind = "memory"
    #: take the job lock (one job per directory, :mod:`._lock`) when the tier opens, so that a second job
    #: fails there; otherwise at its first write (a process that only reads never takes it). A store that
    #: writes sets it (``TieredStore(cleanup=True)``).
    lock_on_open = False
    #: map every page of a file read up front (``MADV_POPULATE_READ``): a read that verifies every byte
    #: then runs at memory speed
    _populate_reads = True

    def __init__(self, path: str | os.PathLike[str] | None = None, *, save: SavePolicy | None = None,
                 keep: PreservationPolicy | None = None, budget: int | None = None, name: str = "ram") -> None:
        super().__init__(name, save, keep if keep is not None else LatestN(2))
        self.path = root_dir(path if path is not None else default_path(), "MemoryTier path")
        self.budget = _args.optional_integer(budget, "MemoryTier budget (bytes)")
        self._bufs: dict[Path, MappedFile] = {}  # every file this process has mapped, by current path
        self._pool = Pool(self.path / f".pool.{os.getpid()}")  # mapped files of deleted steps, for reuse
        self._lock = threading.RLock()  # the store's worker deletes while the training thread stages
        self._staged: dict[int, dict[str, np.ndarray]] = {}
        self._last_staged = -1
        self._spares = True  # prepare() builds spare buffers (not once the process exits)
        self._pool.job = JobLock(self.path, self._pool.dir)  # held from the first write (or open) until close
        self._exports = Exports()  # the mappings zero-copy views are made of, and their steps' leases
        # manifests and markers are written durably (fsync) unless the directory is on tmpfs, where an
        # fsync does nothing but cost its system calls (a power loss takes every file there anyway)
        self._fsync = True

    # -- capabilities -------------------------------------------------------------------------------
    @property
    def is_local(self) -> bool:
        return True

    @property
    def location(self) -> str:
        return str(self.path)

    def identity(self) -> list[Any]:
        st = os.stat(self.path)
        return [socket.gethostname(), st.st_dev, st.st_ino]

    def capacity(self) -> Capacity:
        return _room.capacity(self.path, self.budget)

    def stats(self) -> dict[str, int]:
        """This process's buffers: ``created`` (new files, pre-faulted), of them ``made_ahead`` (in the
        background, for a later save; the others were made by a save, on its thread), ``reused`` (taken from
        the pool), ``pooled`` (kept for the next saves, and their ``pooled_bytes``) and ``mapped`` (files
        mapped)."""
        with self._lock:
            return {"created": self._pool.created, "made_ahead": self._pool.made_ahead,
                    "reused": self._pool.reused, "pooled": len(self._pool.files),
                    "pooled_bytes": self._pool.nbytes, "mapped": len(self._bufs)}

    # -- life cycle ---------------------------------------------------------------------------------
    def open(self) -> None:
        check_root(self.path, "RAM tier path")
        try:
            make_private_dir(self.path)
        except OSError as e:
            raise TierUnavailableError(f"RAM tier {self.path}: cannot create directory ({e.strerror})") from None
        warn_unless_memory(self.path, "RAM tier")
        self._fsync = filesystem_type(self.path) != "tmpfs"
        self._job.create()
        if self.lock_on_open:
            self._job.claim()
        remove_dead_pools(self.path)

    def check_readable(self) -> None:
        if not self.path.is_dir():
            raise TierUnavailableError(f"tier {self.name!r}: {self.path} is not a directory")
        if not os.access(self.path, os.R_OK | os.X_OK):
            raise TierUnavailableError(f"tier {self.name!r}: {self.path} is not readable")

    def close(self) -> None:
        for b in self._bufs.values():
            b.close()
        self._bufs.clear()
        self._pool.clear()
        self._job.release()
        if not self._job.path.exists():  # (another tier of this process on the directory holds the lock)
            shutil.rmtree(self._pool.dir, ignore_errors=True)

    @property
    def _job(self) -> JobLock:
        """This process's part of the directory's job lock: its pool's (one for tiers sharing the pool)."""
        job: JobLock = self._pool.job
        return job

    def drop_spares(self) -> None:
        """Give this process's pooled buffers back to the tmpfs now and build no more, the tier staying
        open: for an exit whose background work may still use the tier, so no pool outlives the process."""
        with self._lock:
            self._spares = False
            self._pool.clear()

    # -- listing ------------------------------------------------------------------------------------
    def _dir(self, step: int) -> Path:
        return self.path / step_dirname(step)

    def _file(self, step: int, name: str) -> Path:
        return self._dir(step) / validate_filename(name)

    file_path = _file  # a helper process of the node reads the step's files by path (the same pages)

    def list_steps(self) -> dict[int, bool]:
        out = {}
        try:
            names = os.listdir(self.path)
        except FileNotFoundError:
            return {}
        for n in names:
            s = parse_step_dirname(n)
            if s is not None and not os.path.islink(os.path.join(self.path, n)):  # (no step is a link: never
                out[s] = os.path.exists(os.path.join(self.path, n, MARKER))  # followed, to read or delete)
        return out

    def file_sizes(self, step: int) -> dict[str, int]:
        d = self._dir(step)
        return {p.name: p.stat().st_size for p in d.iterdir() if p.is_file() and not p.name.startswith(".")}

    def last_written(self, step: int) -> float | None:
        d = self._dir(step)
        times = []
        for p in [d, *d.iterdir()] if d.is_dir() else []:
            try:
                times.append(p.stat().st_mtime)
            except FileNotFoundError:
                pass
        return max(times) if times else None

    def live_users(self) -> list[int]:
        """Live processes (other than this one) using this directory: they hold its job lock, map a file
        in it (Linux ``/proc/<pid>/maps``) or own a buffer pool there (``.pool.<pid>``)."""
        return users(self.path)

    # -- writing ------------------------------------------------------------------------------------
    def buffers(self, step: int, sizes: Mapping[str, int]) -> dict[str, np.ndarray]:
        """Map one buffer per file into the step directory, reusing pooled mappings where possible. Never
        waits for spare buffers being made in the background (:meth:`prepare`): what the pool lacks is made
        here, and the background stops after the file it is making (which it keeps only if the tier is still
        within its budget: this save counts that file's room as its own)."""
        with self._lock:
            return self._stage(step, sizes)

    def _stage(self, step: int, sizes: Mapping[str, int]) -> dict[str, np.ndarray]:
        for n in sizes:
            validate_filename(n)
        self._job.claim()
        self._pool.stagings += 1  # (stops a fill of spare buffers under way: Pool.fill)
        self._recycle_own(step, sizes)
        d = self._dir(step)
        self._pool.staged(step, {d / n: size for n, size in sizes.items()})
        plan = self._pool.match(sizes)
        new_bytes = sum(sizes[n] for n, b in plan.items() if b is None)
        self._last_staged = max(self._last_staged, step)
        _room.make_room(self.path, self.capacity, self._pool, step, new_bytes,
                        {id(b) for b in plan.values() if b is not None})
        out: dict[str, np.ndarray] = {}
        try:
            make_private_dir(d)
            for name, b in plan.items():
                path, size = d / name, sizes[name]
                b = self._pool.new(path, size) if b is None else self._pool.take(b, path, size)
                self._bufs[path] = b
                out[name] = b.array()
        except OSError as e:
            self._staged.pop(step, None)
            self._take_back(step, {_rank_prefix(n) for n in plan})
            if no_space(e):
                raise _room.full(self.path, f"staging step {step}") from None
            raise
        self._staged[step] = out
        return out

    def buffer_memo(self, step: int, name: str) -> dict[Any, Any] | None:
        b = self._bufs.get(self._file(step, name))
        return None if b is None else b.memo

    def discard(self, step: int) -> None:
        """``step`` will not be committed: this process's buffers of it go back to the pool and its manifest,
        if written, is removed (the directory too once empty), so that a failed save holds no space."""
        with self._lock:
            self._staged.pop(step, None)
            d = self._dir(step)
            mine = {_rank_prefix(p.name) for p, b in self._bufs.items() if p.parent == d and b.writable}
            self._take_back(step, mine)

    def _take_back(self, step: int, prefixes: set[str]) -> None:
        """Remove the files of an uncommitted ``step`` that start with one of ``prefixes`` (one rank's
        files), their buffers to the pool, and the step's directory if nothing else is left in it."""
        if (self._dir(step) / MARKER).exists():
            return  # committed after all: only retention or the caller deletes it
        for prefix in sorted(prefixes):
            self._delete_step(step, prefix=prefix, marker=False)
        try:
            os.rmdir(self._dir(step))
        except OSError:  # gone already, or another rank's files are in it
            pass

    def persist(self, step: int) -> None:
        self._staged.pop(step, None)  # the bytes already are in the files

    def prepare(self, step: int, sizes: Mapping[str, int], held: bool = False) -> None:
        """Pre-fault one spare buffer per file of the next step, and of the replica a peer tier keeping
        shards here receives with it, so that neither copies into fresh pages.

        Runs in the store's background worker once a step's commit and copies are done. Until retention
        frees buffers of old steps (keep + 1 steps in), this is what keeps saves 2, 3, ... at memory speed;
        while an upload ``held`` a step the keep policy lets go, it also makes up for the buffers that step
        keeps, for the saves after it and the replicas they bring. Skipped when a later save staged already
        (and no step is held), or when the budget or free space would not allow it; stopped by a save that
        stages meanwhile (it makes what it lacks at its own priority, not behind this lower one).
        """
        with self._lock:
            if (self._last_staged > step and not held) or not self._spares:  # a later save staged (the
                return  # steps before it give it their buffers, unless one is held), or exiting
            self._pool.limit = max(self._pool.limit, sum(sizes.values()))
            # a whole spare set: this rank's files and, where it keeps peers' shards, a replica's too
            want = self._pool.wanted() or list(sizes.values())
            missing = self._pool.missing(want)
            if not missing:  # the spare set is there (a steady save): nothing to count or make
                return
            avail = self.capacity().available
            if avail is not None and sum(missing) > avail:
                return
        self._pool.fill(want, self._lock, lambda: self.capacity().available)

    def _recycle_own(self, step: int, sizes: Mapping[str, int]) -> None:
        """An uncommitted leftover of this step: move this process's files to the pool."""
        d = self._dir(step)
        if d.exists() and not (d / MARKER).exists():
            with unleased(d) as free:
                for name in sizes:
                    p = d / name
                    if p.exists():
                        b = self._bufs.pop(p, None)
                        if not free and b is not None:  # a view maps it: unlinked, never reused
                            b.close()
                            b = None
                        self._pool.give(p, b)

    def write_file(self, step: int, name: str, data: Bytes) -> None:
        path = self._file(step, name)
        self._job.claim()
        self._forget(path, unlink=False)
        try:
            make_private_dir(path.parent)
            atomic_write(path, data, fsync=self._fsync)
        except OSError as e:
            if no_space(e):
                raise _room.full(self.path, f"writing {name} of step {step}") from None
            raise

    def write_marker(self, step: int, data: bytes) -> None:
        self.write_file(step, MARKER, data)

    # -- reading ------------------------------------------------------------------------------------
    def read_file(self, step: int, name: str, *, populate: bool | None = None) -> np.ndarray:
        """A view of the file's bytes through a kept mapping (read-only unless this process wrote it). A new
        mapping's pages are all mapped at once unless ``populate`` is False (default: the tier's choice)."""
        path = self._file(step, name)
        b = self._bufs.get(path)
        if b is None:
            size = path.stat().st_size  # FileNotFoundError when missing
            new = open_mapped(path, size, writable=False,
                              populate=self._populate_reads if populate is None else populate)
            b = self._bufs.setdefault(path, new)  # a restore's threads may map a file at once: one mapping stays
            if b is not new:
                new.close()
        return b.array()

    def view(self, step: int, name: str) -> np.ndarray:
        """The file as :meth:`read_file` gives it, its pages mapped as they are read (a file only sent on)."""
        return self.read_file(step, name, populate=False)

    def local_dirs(self) -> list[Path]:
        return [self.path]

    def export(self, step: int, name: str) -> np.ndarray:
        """A view handed to the user: a copy-on-write mapping of the file the restore verifies, so that a
        write through it never reaches the file; neither this process nor any other of the job reuses
        or rewrites the file while a view of its step lives (a lease, :mod:`._lock`)."""
        self.read_file(step, name)
        path = self._file(step, name)
        b = self._bufs.get(path)
        if b is None:  # deleted at once by another thread of this process
            raise FileNotFoundError(f"{path} was deleted while it was being read")
        b.exported = True
        return self._exports.view(path, b.ino, b.size)

    # -- deleting -----------------------------------------------------------------------------------
    def delete_step(self, step: int) -> None:
        self._job.claim()
        with self._lock:
            self._delete_step(step)

    def _delete_step(self, step: int, prefix: str = "", marker: bool = True) -> None:
        d = self._dir(step)
        if d.is_symlink():  # not a step of the tier's: the link goes, what it points to stays
            d.unlink()
            return
        if marker:
            (d / MARKER).unlink(missing_ok=True)
        if not d.exists():
            return
        bufs = {p: self._bufs.pop(p, None) for p in d.iterdir() if p.name.startswith(prefix)}
        reuse = {p for p, b in bufs.items() if b is not None and p.suffix == ".bin" and b.reusable}
        with unleased(d) if reuse else contextlib.nullcontext(False) as free:  # no zero-copy view maps them
            for p, b in bufs.items():
                if p in reuse and free:
                    self._pool.give(p, b)
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
        self._job.claim()
        with self._lock:
            self._delete_step(step, prefix=f"rank_{rank:05d}.", marker=marker)

    def _forget(self, path: Path, unlink: bool) -> None:
        b = self._bufs.pop(path, None)
        if b is not None:
            b.close()
        if unlink:
            path.unlink(missing_ok=True)

    def __repr__(self) -> str:
        return f"MemoryTier({str(self.path)!r})"


def _rank_prefix(name: str) -> str:
    """``"rank_00003."`` for any of rank 3's files (``rank_00003.0001.bin``, ``rank_00003.manifest.json``)."""
    return name.split(".", 1)[0] + "."
