"""Where a local tier may keep its directory, checked before anything is created there.

A tier makes its directory private (mode 0700) and fills it, so it must be a directory of its own:
never a system directory (``/``, ``/etc``, ``/usr``, ``/dev/shm`` itself, ...), nothing below the
kernel's pseudo file systems (``/proc``, ``/sys``, ``/dev``), never a shared directory such as ``/tmp``.
These are refused by path and by file system type, not by permissions (root may write anywhere). A
directory that is not on tmpfs works, with a warning: the RAM tier then writes to disk.

Used by the RAM tier (:class:`~tierfs.tiers.MemoryTier`) and the ``tiered::`` filesystem's RAM directory.
"""

from __future__ import annotations

import getpass
import logging
import os
import stat
from pathlib import Path
from typing import Any

from ..util.args import shown
from ..errors import ArgumentError, TierUnavailableError
from ..format import validate_filename

log = logging.getLogger("tierfs")

EXAMPLE = "/dev/shm/tierfs/<job>"
#: directories that are never a tier's own: making one private would lock everyone else out of it
SYSTEM_DIRS = frozenset({
    "/", "/bin", "/boot", "/dev", "/etc", "/home", "/lib", "/lib32", "/lib64", "/libx32", "/media", "/mnt",
    "/opt", "/proc", "/root", "/run", "/sbin", "/srv", "/sys", "/tmp", "/usr", "/var", "/var/lib", "/var/log",
    "/var/tmp", "/usr/local", "/dev/shm", "/run/shm", "/run/user"})
#: trees that hold the system itself or the kernel's files: nothing below them (but /dev/shm/...)
SYSTEM_TREES = ("/proc", "/sys", "/dev", "/etc", "/boot", "/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64",
                "/libx32")
#: file systems of the kernel's own files, never storage
KERNEL_FS = frozenset({
    "proc", "sysfs", "devtmpfs", "devpts", "cgroup", "cgroup2", "debugfs", "tracefs", "securityfs", "configfs",
    "pstore", "bpf", "fusectl", "mqueue", "binfmt_misc", "efivarfs", "selinuxfs", "autofs", "nsfs",
    "rpc_pipefs"})
MEMORY_FS = frozenset({"tmpfs", "ramfs"})
#: Linux's limits on a path and on one name in it (bytes): longer ones fail every system call
PATH_MAX, NAME_MAX = 4096, 255


def default_path() -> str:
    """``/dev/shm/tierfs/<job id>``; the job id comes from TIERFS_JOB_ID, torchrun or SLURM."""
    job = (os.environ.get("TIERFS_JOB_ID") or os.environ.get("TORCHELASTIC_RUN_ID")
           or os.environ.get("SLURM_JOB_ID") or getpass.getuser())
    return f"/dev/shm/tierfs/{validate_filename(job)}"


def _inside(path: str, tree: str) -> bool:
    return path == tree or path.startswith(tree.rstrip("/") + "/")


def root_dir(path: Any, what: str) -> Path:
    """``path`` as a :class:`Path`, unless it cannot be a tier's own directory by its name alone.

    Parameters
    ----------
    path : str or os.PathLike
        The directory the caller gave.
    what : str
        How messages name it, e.g. ``"MemoryTier path"``.

    Raises
    ------
    ArgumentError
        ``path`` is not a path (a NUL in it, or longer than the system allows), or is (or resolves to) a
        system directory or lies in a system tree.

    Notes
    -----
    A leading ``~`` is the user's home directory, as in a shell.
    """
    if isinstance(path, bytes) or not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise ArgumentError(f"{what} must be a directory path (a str or Path), e.g. {EXAMPLE!r}, got "
                            f"{shown(path)}")
    given = os.path.expanduser(os.fspath(path))  # '~/ckpt' is the user's, as in a shell
    if not isinstance(given, str):
        raise ArgumentError(f"{what} must be a directory path (a str or Path), e.g. {EXAMPLE!r}, got "
                            f"{shown(path)}")
    if "\0" in given:
        raise ArgumentError(f"{what} {shown(given)} holds a NUL character, which no path can; give a directory "
                            f"path, e.g. {EXAMPLE!r}")
    longest = max(len(os.fsencode(part)) for part in given.split("/"))
    size = len(os.fsencode(given))
    if size >= PATH_MAX or longest > NAME_MAX:
        why = f"{size} bytes, at most {PATH_MAX - 1}" if size >= PATH_MAX else \
            f"a name of {longest} bytes in it, at most {NAME_MAX}"
        raise ArgumentError(f"{what} {shown(given)} is too long for a path ({why}); give a shorter directory, "
                            f"e.g. {EXAMPLE!r}")
    real = os.path.realpath(given)
    system = real in SYSTEM_DIRS or (any(_inside(real, t) for t in SYSTEM_TREES) and not _inside(real, "/dev/shm"))
    if system:
        also = f" ({real})" if real != os.path.abspath(given) else ""
        raise ArgumentError(f"{what} {given!r}{also} is a system directory: a tier makes its directory private "
                            f"(mode 0700) and fills it; give a directory of its own, e.g. {EXAMPLE!r}")
    return Path(given)


def check_local_url(url: str, what: str) -> None:
    """For a URL (or path) an object tier would keep its steps under: refuse a system directory when it is
    local (``file://``, ``local://`` or a plain path), as :func:`root_dir` does; other URLs pass. A chained
    URL (fsspec's ``a::b``) keeps its files where its last part says."""
    if not isinstance(url, str):
        return
    url = url.rsplit("::", 1)[-1]
    for prefix in ("file://", "local://"):
        if url.startswith(prefix):
            url = url[len(prefix):]
            break
    else:
        if "://" in url:
            return
    root_dir(url or "/", what)


def filesystem_type(path: str | os.PathLike[str]) -> str | None:
    """The type of the file system holding ``path`` (``"tmpfs"``, ``"ext4"``, ...); None when unknown."""
    real = os.path.realpath(path)
    try:
        with open("/proc/self/mounts", encoding="utf-8", errors="replace") as f:
            mounts = [line.split()[1:3] for line in f if len(line.split()) >= 3]
    except OSError:  # not Linux
        return None
    best, kind = "", None
    for point, fstype in mounts:
        point = point.replace("\\040", " ").replace("\\011", "\t").replace("\\134", "\\")
        if _inside(real, point) and len(point) >= len(best):
            best, kind = point, fstype
    return kind


def check_root(path: Path, what: str) -> None:
    """Before a tier creates or takes over ``path``: raise if it cannot be a private directory of this
    process's user. Checks the file system type, what is there, and whether it can be written.

    Raises
    ------
    ArgumentError
        ``path`` is on a kernel file system (proc, sysfs, ...) or is a shared directory (sticky, like /tmp).
    TierUnavailableError
        ``path`` (or the nearest part of it that exists) is a file, or this user cannot write there.
    """
    have = path
    while not os.path.lexists(have) and have != have.parent:
        have = have.parent
    kind = filesystem_type(have)
    if kind in KERNEL_FS:
        raise ArgumentError(f"{what} {path} is on {kind}, the kernel's own files, not storage; give a directory "
                            f"of its own, e.g. {EXAMPLE!r}")
    if not have.is_dir():
        where = "is a file" if have == path else f"cannot be created: {have} is a file"
        raise TierUnavailableError(f"{what} {path} {where}, not a directory; give a directory, e.g. {EXAMPLE!r}")
    mode = have.stat().st_mode
    if have == path and mode & stat.S_ISVTX:
        raise ArgumentError(f"{what} {path} is a shared directory (mode {stat.filemode(mode)}, like /tmp): a "
                            "tier makes its directory private; use a directory of your own below it")
    if not os.access(have, os.W_OK | os.X_OK):
        where = "is" if have == path else f"cannot be created: {have} is"
        raise TierUnavailableError(f"{what} {path} {where} not writable by this user; give a directory you can "
                                   f"write, e.g. {EXAMPLE!r}")


def warn_unless_memory(path: Path, what: str) -> None:
    """Log a warning when ``path`` is not on tmpfs: it works, but writes go to disk, not memory."""
    kind = filesystem_type(path)
    if kind is not None and kind not in MEMORY_FS:
        log.warning("%s %s is on %s, not tmpfs: it works, but writes go to disk instead of memory (slower, and "
                    "they use disk space); use a directory under /dev/shm for a RAM tier", what, path, kind)


def mapping_processes(root: Path, exclude: set[int]) -> set[int]:
    """Live processes (but ``exclude``) that map a file below ``root`` (Linux ``/proc/<pid>/maps``)."""
    prefix = str(root.resolve()) + "/"
    pids: set[int] = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        pid = int(maps.parent.name)
        if pid in exclude:
            continue
        try:
            with open(maps, encoding="utf-8", errors="replace") as f:
                if any(prefix in line for line in f):
                    pids.add(pid)
        except OSError:  # gone, or not ours to read
            continue
    return pids


def missing_dirs(path: str | os.PathLike[str]) -> list[Path]:
    """``path`` and those of its parents that do not exist yet, deepest first: what creating ``path``
    would create, noted before, so that :func:`remove_new_dirs` can take back exactly those."""
    out: list[Path] = []
    p = Path(os.path.abspath(path))
    while not os.path.lexists(p) and p != p.parent:
        out.append(p)
        p = p.parent
    return out


def remove_new_dirs(dirs: list[Path]) -> None:
    """Remove the directories of ``dirs`` (from :func:`missing_dirs`) that are empty now, deepest first.
    A directory holding anything (another process's files) stays, and so do its parents; never raises."""
    for d in sorted(set(dirs), key=lambda p: len(p.parts), reverse=True):
        try:
            os.rmdir(d)
        except OSError:  # not there, not empty, or not ours to remove
            continue
