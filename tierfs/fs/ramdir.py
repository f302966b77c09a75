"""The RAM directory behind ``tiered::``: target paths mirrored as private files, and what it holds.

:class:`RamDir` maps RAM-relative names (``bucket/run/a.bin``) to files below its root, keeps their sizes
(in order of writing: least recently written first), makes the private temporary files that writes in
progress go to, and lists only complete files. It knows nothing of the target or of uploads: the drain
(``writeback.Drain``) decides what may be evicted and holds its lock around every change of names.
Files, temporary names and directories are made the way the RAM tier makes them (``tierfs.util.fileio``);
room is computed by the tiers' rule (:class:`tierfs.tiers.base.Capacity`).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any, Iterator

from ..util.fileio import FILE_MODE, TMP_PREFIX, is_tmp_name, make_private_dir, process_alive, tmp_name, tmp_owner
from ..errors import ArgumentError
from ..tiers.base import Capacity

Info = dict[str, Any]
#: the RAM directory's subdirectory of files whose upload failed for good at an exit (a missing bucket, no
#: permission): no listing shows it and no later process uploads what is in it (``upload.ExitWork``)
FAILED = ".tierfs-failed"


def rel_path(path: str) -> str:
    """The RAM-relative form of a target path; refuses components that could leave the RAM directory."""
    rel = path.strip("/")
    if not rel:
        return ""
    for part in rel.split("/"):
        if part in ("", ".", "..") or "\x00" in part or is_tmp_name(part):
            raise ArgumentError(f"unsafe path {path!r} for tiered://: no empty, '.', '..' or "
                                f"'{TMP_PREFIX}*' components")
    if rel.split("/", 1)[0] == FAILED:
        raise ArgumentError(f"path {path!r} for tiered:// starts with {FAILED!r}, the name of the RAM directory's "
                            "failed uploads; choose another name")
    return rel


class RamDir:
    """A private directory (0700) of files named by RAM-relative paths, and their sizes."""

    def __init__(self, root: Path) -> None:
        make_private_dir(root)
        self.root = root
        self.sizes: dict[str, int] = {}  # every complete file -> bytes; insertion order = least recently written
        self.reserved = 0  # bytes of writes in progress

    def path(self, rel: str) -> Path:
        return self.root / rel if rel else self.root

    def holds(self, rel: str) -> bool:
        return rel in self.sizes

    def is_dir(self, rel: str) -> bool:
        return self.path(rel).is_dir()

    def make_dir(self, rel: str) -> Path:
        """Create ``rel`` (and parents) as private directories; returns its path."""
        p = self.path(rel)
        make_private_dir(p)
        return p

    # -- space --------------------------------------------------------------------------------------
    def used(self) -> int:
        return sum(self.sizes.values()) + self.reserved

    def capacity(self, budget: int | None, replacing: str = "") -> Capacity:
        """Space for a write that replaces ``replacing`` (whose bytes it frees)."""
        try:
            sv = os.statvfs(self.root)
            free: int | None = sv.f_bavail * sv.f_frsize
        except OSError:
            free = None
        return Capacity(used=self.used() - self.sizes.get(replacing, 0), budget=budget, free=free)

    # -- names --------------------------------------------------------------------------------------
    def _walk(self, top: Path) -> Iterator[tuple[str, list[str], list[str]]]:
        """``os.walk(top)``, without the directory of failed uploads."""
        for dirpath, dirs, files in os.walk(top):
            if Path(dirpath) == self.root and FAILED in dirs:
                dirs.remove(FAILED)
            yield dirpath, dirs, files

    @property
    def failed_dir(self) -> Path:
        """Where files whose upload failed for good at an exit are kept (see :data:`FAILED`)."""
        return self.root / FAILED

    def set_aside(self, rel: str) -> Path:
        """Move ``rel`` below :attr:`failed_dir` (same relative path), out of every listing and upload;
        returns its new path."""
        dst = self.failed_dir / rel
        make_private_dir(dst.parent)
        os.replace(self.path(rel), dst)
        self.sizes.pop(rel, None)
        self.prune(self.path(rel).parent)
        return dst

    def failed_files(self) -> list[Path]:
        """The files in :attr:`failed_dir`."""
        return [Path(d) / f for d, _, fs in os.walk(self.failed_dir) for f in fs if not is_tmp_name(f)]

    def prune_failed(self) -> None:
        """Remove the empty directories of :attr:`failed_dir`, and it too once empty."""
        for d, _, _ in sorted(os.walk(self.failed_dir), key=lambda w: len(w[0]), reverse=True):
            try:
                os.rmdir(d)
            except OSError:  # not empty
                pass

    def leftovers(self) -> Iterator[Path]:
        """The files an earlier process left, after removing the temporary files of dead writers."""
        for dirpath, _dirs, files in self._walk(self.root):
            for name in files:
                p = Path(dirpath) / name
                if is_tmp_name(name):
                    pid = tmp_owner(name)
                    if pid is not None and not process_alive(pid):
                        p.unlink(missing_ok=True)
                    continue
                yield p

    def files_under(self, rel: str) -> list[Path]:
        """``rel`` itself if it is a file, else every complete file below it."""
        base = self.path(rel)
        if base.is_file():
            return [base]
        return [Path(d) / f for d, _, fs in self._walk(base) for f in fs if not is_tmp_name(f)]

    def tmpfile(self, rel: str, name: str) -> Path:
        """A fresh private temporary file next to ``rel``'s path (``name`` is for the error)."""
        final = self.path(rel)
        if final.is_dir():
            raise IsADirectoryError(f"{name} is a directory")
        make_private_dir(final.parent)
        tmp = Path(tmp_name(final.parent))
        os.close(os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, FILE_MODE))
        return tmp

    def unlink(self, rel: str, prune: bool = False) -> None:
        """Remove a file; with ``prune`` also its empty parent directories."""
        p = self.path(rel)
        try:
            p.unlink()
        except FileNotFoundError:
            pass
        self.sizes.pop(rel, None)
        if prune:
            self.prune(p.parent)

    def prune(self, d: Path) -> None:
        while d != self.root and self.root in d.parents:
            try:
                d.rmdir()
            except OSError:
                return
            d = d.parent

    # -- listing (complete files only: never a temporary name) --------------------------------------
    def info(self, rel: str) -> Info | None:
        """``{"name": rel, "size", "type", "mtime"}``, or None when RAM holds no such file or directory."""
        try:
            st = self.path(rel).stat()
        except (FileNotFoundError, NotADirectoryError):
            return None
        kind = "directory" if stat.S_ISDIR(st.st_mode) else "file"
        return {"name": rel, "size": st.st_size if kind == "file" else 0, "type": kind, "mtime": st.st_mtime}

    def ls(self, rel: str) -> list[Info] | None:
        """The entries directly below ``rel`` (``rel`` itself if it is a file); None if RAM has no ``rel``."""
        p = self.path(rel)
        if p.is_file():
            info = self.info(rel)
            return [info] if info is not None else None
        if not p.is_dir():
            return None
        out = []
        for entry in os.scandir(p):
            if is_tmp_name(entry.name) or (p == self.root and entry.name == FAILED):
                continue
            info = self.info(f"{rel}/{entry.name}" if rel else entry.name)
            if info is not None:
                out.append(info)
        return out

    def find(self, rel: str, maxdepth: int | None, withdirs: bool) -> dict[str, Info]:
        """Every file below ``rel`` (and directory, with ``withdirs``), by RAM-relative name."""
        base = self.path(rel)
        if base.is_file():
            info = self.info(rel)
            return {rel: info} if info is not None else {}
        out: dict[str, Info] = {}
        if not base.is_dir():
            return out
        if withdirs and rel and (info := self.info(rel)) is not None:
            out[rel] = info
        depth0 = len(base.parts)
        for dirpath, dirs, files in self._walk(base):
            depth = len(Path(dirpath).parts) - depth0 + 1  # entries directly below ``base`` are at depth 1
            names = files + dirs if withdirs else list(files)
            if maxdepth is not None and depth >= maxdepth:
                dirs[:] = []
            for name in names:
                if is_tmp_name(name):
                    continue
                child = Path(dirpath, name).relative_to(self.root).as_posix()
                if (info := self.info(child)) is not None:
                    out[child] = info
        return out
