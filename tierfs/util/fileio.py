"""Local files written the one durable way: a private temporary file beside the target, fsync, rename,
fsync of the directory. A reader never sees half a file and a power loss never leaves one behind.

Every local write of tierfs goes through :func:`atomic_write`: the RAM tier's manifests and markers, the
object tier on ``file://``, the fsspec drain's uploads to a local target and the DCP export's
``.metadata``. On tmpfs the fsyncs cost nothing.
"""

from __future__ import annotations

import errno
import itertools
import os
import stat
from typing import IO, Any, Callable, Union

from . import hooks as _hooks

#: prefix of temporary names: listings leave such names out, and a name of this form is never a
#: user's (``.tierfs-tmp-<pid>-<n>``: the pid tells whether the writer is still alive)
TMP_PREFIX = ".tierfs-tmp-"
FILE_MODE = 0o600

_ids = itertools.count()

Source = Union[bytes, bytearray, memoryview, Any, Callable[[IO[bytes]], None]]


def tmp_name(directory: str | os.PathLike[str]) -> str:
    """A fresh temporary path in ``directory`` (named with this process's pid)."""
    return os.path.join(os.fspath(directory), f"{TMP_PREFIX}{os.getpid()}-{next(_ids)}")


def is_tmp_name(name: str) -> bool:
    """Whether a file name (last path component) is a temporary name of an unfinished write."""
    return name.startswith(TMP_PREFIX)


def tmp_owner(name: str) -> int | None:
    """The pid that made a temporary name, or None when ``name`` is not one."""
    if not is_tmp_name(name):
        return None
    pid = name[len(TMP_PREFIX):].split("-", 1)[0]
    return int(pid) if pid.isdigit() else None


def private_opener(path: str, flags: int) -> int:
    """``open(..., opener=private_opener)``: new files are readable by their owner only."""
    return os.open(path, flags, FILE_MODE)


def fsync_dir(directory: str | os.PathLike[str]) -> None:
    """Make a rename in ``directory`` survive a power loss."""
    fd = os.open(os.fspath(directory) or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str | os.PathLike[str], data: Source, *, fsync: bool = True, mode: int | None = None) -> None:
    """Write ``path`` whole or not at all.

    ``data`` is a bytes-like object (written straight from its buffer, no copy) or a function that
    writes into the open temporary file. The temporary file is removed on any failure. The file is
    private to its owner (:data:`FILE_MODE`) unless ``mode`` says otherwise (set before it is renamed).
    """
    path = os.fspath(path)
    directory = os.path.dirname(path) or "."
    tmp = tmp_name(directory)
    try:
        with open(tmp, "wb", opener=private_opener) as f:
            if callable(data):
                data(f)
            else:
                f.write(memoryview(data).cast("B"))
            f.flush()
            if mode is not None:
                os.fchmod(f.fileno(), mode)
            if fsync:
                os.fsync(f.fileno())
        _hooks.at("rename", path=path)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    if fsync:
        fsync_dir(directory)


def make_private_dir(path: "os.PathLike[str] | str") -> None:
    """Create ``path`` (and parents) with mode 0700; refuse a directory other users can enter. (With the
    ``os`` calls themselves: a save makes sure of its step's directory before each file it writes.)"""
    p = os.fspath(path) or "."
    try:
        os.mkdir(p, 0o700)
    except FileExistsError:
        pass
    except FileNotFoundError:  # parents first, with the default mode (as ``Path.mkdir(parents=True)``)
        os.makedirs(os.path.dirname(os.path.abspath(p)), exist_ok=True)
        try:
            os.mkdir(p, 0o700)
        except FileExistsError:
            pass
    st = os.stat(p)
    if not stat.S_ISDIR(st.st_mode):
        raise FileExistsError(errno.EEXIST, "exists and is not a directory", p)
    if st.st_uid != os.getuid():
        from ..errors import TierUnavailableError

        raise TierUnavailableError(f"{p} belongs to another user; use a directory of your own")
    if st.st_mode & 0o077:
        os.chmod(p, 0o700)


def process_alive(pid: int) -> bool:
    """Whether a process with this pid exists (ours or another user's)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def shared_file_mode() -> int:
    """The mode a plain ``open(path, "w")`` gives a new file: 0o666 less the process's umask (0o644 with the
    usual umask of 0o022), read from ``/proc/self/status`` where Linux says it (no change to the umask)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o644
