"""The RAM tier's buffers: files on tmpfs that stay mapped, and a pool of them kept for reuse.

A mapping follows its file through renames, so a buffer of a deleted step can be renamed into the next
step and copied into at memory speed (its pages already exist). New files are reserved with
``posix_fallocate`` (a full tmpfs becomes ENOSPC, never a SIGBUS on a page fault) and pre-faulted with
``MADV_POPULATE_WRITE``.
"""

from __future__ import annotations

import ctypes
import errno
import itertools
import logging
import mmap
import os
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import numpy as np

from ..util import hooks as _hooks

log = logging.getLogger("tierfs")

MADV_POPULATE_READ = 22
MADV_POPULATE_WRITE = 23


def _madvise() -> Any:
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):  # no libc madvise: mmap.madvise, which holds the GIL
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_libc_madvise = _madvise()


def populate_pages(mm: mmap.mmap, advice: int) -> None:
    """Map every page of ``mm`` now (``MADV_POPULATE_READ`` or ``_WRITE``; nothing on kernels before 5.14).

    Through libc, so the GIL is released while the kernel works (``mmap.madvise`` holds it: populating
    256 MiB would stall every other thread of the process, the training loop's included, for tens of ms)."""
    view = np.frombuffer(mm, dtype=np.uint8)
    try:
        if _libc_madvise is not None and _libc_madvise(view.ctypes.data, view.size, advice) == 0:
            return
    finally:
        del view  # the mapping may be closed later only once no view is left
    try:
        mm.madvise(advice)
    except OSError:  # kernels before 5.14
        pass


def no_space(e: OSError) -> bool:
    """Whether an error means the tmpfs is full: no bytes or no inodes left, or a quota reached."""
    return e.errno in (errno.ENOSPC, errno.EDQUOT)


class Memo(dict):  # type: ignore[type-arg]
    """A mapped buffer's memo (:meth:`~tierfs.tiers.capabilities.Staging.buffer_memo`): what the store works
    out about the buffer (typed views of it), and in :attr:`held` what is tied to its pages (a page-lock),
    each a function that lets it go, called by :meth:`release` before the mapping is unmapped."""

    __slots__ = ("held",)

    def __init__(self) -> None:
        super().__init__()
        self.held: dict[str, Callable[[], None]] = {}

    def release(self) -> None:
        """Let go of everything held, then forget the views."""
        held, self.held = self.held, {}
        for name, fn in held.items():
            try:
                fn()
            except Exception as e:  # noqa: BLE001 - the mapping goes anyway
                log.warning("tierfs: releasing %s of a mapped buffer failed: %s", name, e)
        self.clear()


class MappedFile:
    """A file and its mapping (None for an empty file)."""

    __slots__ = ("path", "size", "mm", "writable", "exported", "memo", "ino")

    def __init__(self, path: Path, size: int, mm: mmap.mmap | None, writable: bool, ino: int = 0) -> None:
        self.path, self.size, self.mm, self.writable, self.exported = path, size, mm, writable, False
        self.ino = ino  # the file's inode: a view handed to the user maps this file, not one put in its place
        self.memo = Memo()  # the store's views of this mapping (Tier.buffer_memo), dropped with it

    def array(self) -> np.ndarray:
        if self.mm is None:
            return np.empty(0, dtype=np.uint8)
        return np.frombuffer(self.mm, dtype=np.uint8)

    @property
    def reusable(self) -> bool:
        """Whether a later save may copy into it: written by this process, never handed to the user."""
        return self.writable and not self.exported

    def close(self) -> None:
        self.memo.release()  # page-locks and views of the mapping: without them it can be unmapped now
        if self.mm is not None:
            try:
                self.mm.close()
            except BufferError:  # a view is still alive; the mapping goes when it does
                pass
            self.mm = None


def create(path: Path, size: int) -> MappedFile:
    """A new private file of ``size`` bytes, reserved, mapped writable and pre-faulted."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        mm = None
        ino = os.fstat(fd).st_ino
        if size:
            os.posix_fallocate(fd, 0, size)  # ENOSPC here, not SIGBUS later
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            populate_pages(mm, MADV_POPULATE_WRITE)
    finally:
        os.close(fd)
    return MappedFile(path, size, mm, writable=True, ino=ino)


def open_mapped(path: Path, size: int, writable: bool, populate: bool = True) -> MappedFile:
    """An existing file, mapped (read-only unless ``writable``) and pre-faulted unless ``populate`` is False
    (then each page is mapped as it is first read)."""
    fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
    try:
        ino = os.fstat(fd).st_ino
        if size == 0:
            return MappedFile(path, 0, None, writable, ino)
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED, prot)
    finally:
        os.close(fd)
    if populate:
        populate_pages(mm, MADV_POPULATE_READ)
    return MappedFile(path, size, mm, writable, ino)


def map_private(path: Path, ino: int, size: int) -> mmap.mmap:
    """A copy-on-write mapping (``MAP_PRIVATE``) of the file ``path``, which must be inode ``ino`` of
    ``size`` bytes: its pages are the file's own (no copy) until this process writes one, and then that
    page is this process's alone, so a write through it never reaches the file, and never faults.

    Raises
    ------
    FileNotFoundError
        ``path`` is gone or another file took its place.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        st = os.fstat(fd)
        if st.st_ino != ino or st.st_size != size:
            raise FileNotFoundError(errno.ENOENT, "replaced while it was being read", str(path))
        return mmap.mmap(fd, size, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)


class Pool:
    """Mapped files of deleted steps, kept in a per-process directory for the next saves.

    It holds at most ``limit`` bytes: the most bytes staged for one step so far, in every tier that shares
    the pool (a RAM tier and the copies of other ranks' shards it keeps: one spare set of each, since a
    save can stage the next step while the copies of the last one still arrive). ``created`` and
    ``reused`` count the buffers made fresh and taken from the pool, ``made_ahead`` those of ``created``
    made in the background for a later save (see ``MemoryTier.stats``).
    """

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.files: list[MappedFile] = []
        self.limit = 0
        self._per_step: dict[int, dict[Any, int]] = {}  # the files staged for each recent step: their sizes
        self.created = 0
        self.made_ahead = 0
        self.reused = 0
        self.stagings = 0  # stagings so far (a save's, a received copy's): a fill under way ends when it changes
        self.making: Path | None = None  # the file a fill is making now, outside the lock (not pooled yet)
        self._ids = itertools.count()
        self.job: Any = None  # this process's part of the directory's job lock (its file is in this directory)

    def staged(self, step: int, files: Mapping[Any, int]) -> None:
        """Count the files staged for ``step`` (``{path: size}``; a file staged again, as a retried save
        does, counts once); the limit grows to the most bytes any step took."""
        got = self._per_step.setdefault(step, {})
        got.update(files)
        self.limit = max(self.limit, sum(got.values()))
        if len(self._per_step) > 16:  # only recent steps are staged alongside each other
            del self._per_step[min(self._per_step)]

    def wanted(self) -> list[int]:
        """The sizes of the files the recent step that took the most bytes staged, in every tier sharing
        the pool: what a spare set holds (a RAM tier's shard and the replica it keeps for a peer)."""
        return list(max(self._per_step.values(), key=lambda f: sum(f.values()), default={}).values())

    @property
    def nbytes(self) -> int:
        return sum(b.size for b in self.files)

    def path(self) -> Path:
        """A fresh name in the pool's directory (created 0700)."""
        self.dir.mkdir(mode=0o700, exist_ok=True)
        return self.dir / f"{next(self._ids)}.bin"

    def match(self, sizes: Mapping[str, int]) -> dict[str, MappedFile | None]:
        """A pooled buffer for each file where one fits, without taking it: the same size first, then
        the smallest larger one; largest files first."""
        free = sorted(self.files, key=lambda b: b.size)
        plan: dict[str, MappedFile | None] = {}
        for name, size in sorted(sizes.items(), key=lambda kv: -kv[1]):
            pick = next((b for b in free if b.size == size), None) or next((b for b in free if b.size > size), None)
            if pick is not None:
                free.remove(pick)
            plan[name] = pick
        return plan

    def missing(self, sizes: Iterable[int]) -> list[int]:
        """Of files of ``sizes``, the sizes no pooled buffer has exactly (empty files need none)."""
        have = sorted(b.size for b in self.files)
        out = []
        for size in sorted(sizes):
            if size in have:
                have.remove(size)
            elif size:
                out.append(size)
        return out

    def take(self, b: MappedFile, path: Path, size: int) -> MappedFile:
        """Move pooled ``b`` to ``path``, cut or grown to ``size`` bytes."""
        self.files.remove(b)
        os.rename(b.path, path)
        b.path = path
        self.reused += 1
        if b.size == size:
            return b
        b.close()
        os.truncate(path, size)
        return open_mapped(path, size, writable=True)

    def new(self, path: Path, size: int, ahead: bool = False) -> MappedFile:
        """A fresh buffer, its pages faulted in; ``ahead``: made in the background for a later save."""
        b = create(path, size)
        self.created += 1
        self.made_ahead += ahead
        return b

    def give(self, path: Path, b: MappedFile | None) -> None:
        """Keep ``b`` (the mapping of ``path``) for reuse if it may be reused and fits; else drop it. A
        buffer with something tied to its pages (a page-lock: costly to make again) takes the place of a
        pooled one of its size that has none."""
        if b is not None and b.reusable and b.memo.held and self.nbytes + b.size > self.limit:
            plain = next((f for f in self.files if f.size == b.size and not f.memo.held), None)
            if plain is not None:
                self.drop(plain)
        if b is None or not b.reusable or self.nbytes + b.size > self.limit:
            if b is not None:
                b.close()
            path.unlink(missing_ok=True)
            return
        dst = self.path()
        os.rename(path, dst)
        b.path = dst
        self.files.append(b)

    def made(self) -> int:
        """Bytes of the file a fill is making now that the tier's space already counts (0 without one). Read
        before the space is measured, it is never more than the measure counts: the file only grows while it
        is made, and its length (what a budget counts) shows only once its pages are reserved (what the file
        system counts)."""
        path = self.making
        if path is None:
            return 0
        try:
            return os.stat(path).st_size
        except FileNotFoundError:
            return 0

    def fill(self, want: list[int], lock: Any, room: Callable[[], int | None]) -> None:
        """Make buffers ahead until the pool holds files of ``want``'s sizes or its limit: one at a time, the
        slow part outside ``lock`` (which guards the pool), so that buffers of deleted steps may come back
        meanwhile; the pool never holds more than its limit. A buffer is begun only while ``room()`` (the
        bytes the tier may still take; None: no limit) has room for it, and kept only if the tier is still
        within it once the buffer is made: while it is made (``making``), a staging counts the bytes it holds
        so far as free (:meth:`made`). A staging that starts meanwhile ends the fill (after the file being
        made, which the pool keeps if it still lacks one of its size). Spare buffers are an optimisation: a
        file system that refuses one ends it."""
        with lock:
            start = self.stagings
        while True:
            with lock:
                missing = self.missing(want)
                if not missing or self.nbytes + missing[-1] > self.limit or self.stagings != start:
                    return
                left = room()
                if left is not None and missing[-1] > left:
                    return
                try:
                    path = self.path()
                except OSError:  # no inode for the pool's directory
                    return
                self.making = path
            b, kept = None, False
            try:
                _hooks.at("spare", nbytes=missing[-1])
                b = self.new(path, missing[-1], ahead=True)
            except OSError:
                path.unlink(missing_ok=True)
            finally:
                with lock:
                    try:
                        left = room() if b is not None else None  # (counts b: it is on disk)
                        kept = b is not None and b.size in self.missing(want) and \
                            self.nbytes + b.size <= self.limit and (left is None or left >= 0)
                    finally:
                        if kept and b is not None:
                            self.files.append(b)
                        elif b is not None:  # a deleted step's buffer came back, a staging took the room
                            self.discard(b)  # meanwhile, or the room could not be counted
                        self.making = None
            if not kept:
                return

    def drop(self, b: MappedFile) -> None:
        self.files.remove(b)
        self.discard(b)

    @staticmethod
    def discard(b: MappedFile) -> None:
        """Unmap and remove a buffer that is not in the pool."""
        b.close()
        b.path.unlink(missing_ok=True)

    def close(self) -> None:
        for b in self.files:
            b.close()
        self.files.clear()

    def clear(self) -> None:
        """Give every pooled buffer back to the file system (unmapped, unlinked)."""
        for b in self.files:
            b.close()
            b.path.unlink(missing_ok=True)
        self.files.clear()
