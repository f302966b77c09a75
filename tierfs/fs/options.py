"""The ``tiered::`` filesystem's options, target, RAM directory and paths, checked before anything is done.

Options may come from the caller or from fsspec's config as strings (``FSSPEC_TIERED_BUDGET=...``); each
bad one is a one-line :class:`~tierfs.errors.ArgumentError` naming it. The RAM directory follows the RAM
tier's rules (:mod:`tierfs.tiers.rootdir`: no system directory, a warning when not on tmpfs).

The target is checked as an object tier's URL is (:func:`tierfs.util.args.object_url`): a typo such as
``tiered::s3:/bucket/run`` is an error, not a directory ``./s3:/bucket/run``. Through a chained URL fsspec
hands the filesystem the target's path already resolved (a path without a protocol made absolute below
the current directory), so there a relative path cannot be told from an absolute one: a local target
below the current directory that does not exist yet is written to with a warning saying so.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec

from ..util import args as _args
from ..util.fileio import make_private_dir
from ..tiers.rootdir import check_root, default_path, root_dir, warn_unless_memory
from ..ranks import seconds
from ..errors import ArgumentError, TierUnavailableError

log = logging.getLogger("tierfs")

WHAT = "tiered:// path"
TARGET = "tiered:: target"


@dataclass(frozen=True)
class Options:
    """The drain's options, checked and normalised."""

    timeout: float | None
    drain: str
    when_full: str
    budget: int | None
    bandwidth: float | None
    concurrency: int
    retries: int


def option(value: Any, what: str) -> Any:
    """An option as given: None for ``None``, ``""`` or ``"none"``; a number for a numeric string; a whole
    float as an int."""
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "none")):
        return None
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise ArgumentError(f"{what} must be a number or None, got {value!r}") from None
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def options(*, timeout: Any, drain: Any, when_full: Any, budget: Any, bandwidth: Any, concurrency: Any,
            retries: Any) -> Options:
    """The filesystem's options (see :class:`~tierfs.fs.TieredFileSystem`), checked."""
    t = option(timeout, "timeout (seconds)")
    rate = option(bandwidth, "drain_bandwidth")
    return Options(
        timeout=None if t is None else seconds(t),
        drain=_args.choice(drain, "drain", ("background", "manual")),
        when_full=_args.choice(when_full, "when_full", ("wait", "raise")),
        budget=_args.optional_integer(option(budget, "budget"), "budget (bytes)"),
        bandwidth=None if rate is None else _args.number(rate, "drain_bandwidth (bytes/s, or None)"),
        concurrency=_args.integer(option(concurrency, "drain_concurrency"), "drain_concurrency"),
        retries=_args.integer(option(retries, "retries"), "retries"))


def ram_root(path: Any) -> Path:
    """The RAM directory's path, checked (``path`` None: the default); nothing is created."""
    return root_dir(path if path is not None else default_path() + "-fsspec", WHAT)


def make_ram_root(root: Path) -> Path:
    """Create the RAM directory (0700) once its checks pass; returns its resolved path."""
    check_root(root, WHAT)
    try:
        make_private_dir(root)
    except OSError as e:
        raise TierUnavailableError(f"{WHAT} {root}: cannot create the directory ({e.strerror})") from None
    warn_unless_memory(root, WHAT)
    return root.resolve()


def path_arg(path: Any, what: str) -> Any:
    """``path`` when it is a path (a str or os.PathLike) or a list of them; else a one-line ArgumentError."""
    ok = (isinstance(path, (str, os.PathLike)) or
          (isinstance(path, (list, tuple)) and all(isinstance(p, (str, os.PathLike)) for p in path)))
    if not ok:
        raise ArgumentError(f"tiered:// {what}: a path is a string (or a list of them), got {_args.shown(path)}")
    return path


def data_arg(path: Any, value: Any) -> None:
    """Raise unless ``value`` is bytes or a bytes-like object (what ``pipe`` writes to ``path``)."""
    try:
        memoryview(value)
    except TypeError:
        raise ArgumentError(f"tiered:// pipe: the data for {path!r} must be bytes (or a bytes-like object), got "
                            f"{_args.shown(value, 40)}") from None


def target(fo: Any, target_protocol: Any, target_options: dict[str, Any] | None,
           fs: fsspec.AbstractFileSystem | None) -> tuple[fsspec.AbstractFileSystem, dict[str, Any]]:
    """The target filesystem and its options (for the drain's key), checked before anything is created.

    Parameters
    ----------
    fo : str or None
        The target URL or path (``s3://bucket/run``; from a chained URL, the target's path).
    target_protocol : str or None
        The target's protocol (a chained URL sets it; None: from ``fo``).
    target_options : dict or None
        The target's options.
    fs : fsspec.AbstractFileSystem or None
        A target filesystem instance instead.

    Raises
    ------
    ArgumentError
        No target, a target URL with a typo, an unknown protocol, no bucket.
    """
    if fs is not None:
        _args.instance(fs, "fs", fsspec.AbstractFileSystem, "an fsspec filesystem")
        return fs, {k: v for k, v in getattr(fs, "storage_options", {}).items() if k not in ("asynchronous", "loop")}
    opts = {k: v for k, v in (target_options or {}).items() if k not in ("asynchronous", "loop")}
    if target_protocol is None:
        if fo is None or fo == "":
            raise ArgumentError("tiered:: needs a target: use a URL such as tiered::s3://bucket/run, or pass "
                                "target_protocol= (or fs=)")
        url = _args.object_url(fo, TARGET)  # as the caller wrote it
        target_protocol = url.rsplit("::", 1)[-1].split("://", 1)[0] if "://" in url else "file"
    else:
        if not isinstance(target_protocol, str) or not target_protocol:
            raise ArgumentError(f"tiered:: target_protocol must be a protocol name such as 's3', got "
                                f"{_args.shown(target_protocol)}")
        _args.url_protocol(target_protocol, "tiered:: target_protocol", target_protocol)
        if isinstance(fo, str):
            _resolved(fo, target_protocol)
    return fsspec.filesystem(target_protocol, **opts), opts


def _resolved(fo: str, protocol: str) -> None:
    """Check a target path fsspec resolved from a chained URL (``tiered::s3:/b`` reaches here as the local
    path ``<cwd>/s3:/b``)."""
    if protocol in _args.BUCKET_PROTOCOLS and (not fo.strip("/") or fo.startswith("/")):
        raise _args.URLArgumentError(f"{TARGET} {protocol}://{fo} names no bucket: write "
                                     f"tiered::{protocol}://BUCKET/PREFIX, e.g. tiered::{protocol}://bucket/run")
    if protocol not in _args.LOCAL_PROTOCOLS:
        return
    cwd = os.getcwd()
    if cwd == "/" or not fo.startswith(cwd.rstrip("/") + "/"):
        return
    rel = fo[len(cwd.rstrip("/")) + 1:]  # what the caller wrote, if it was a relative path
    if rel == ":" or rel.startswith(":/"):  # tiered:: with nothing after it
        raise _args.URLArgumentError(f"{TARGET} is empty: use a URL such as tiered::s3://bucket/run")
    meant = _args.mangled(rel)
    if meant is not None:
        raise _args.URLArgumentError(f"{TARGET} {rel!r} is not a URL: did you mean {meant!r}?")
    top = Path(cwd, rel.split("/", 1)[0])
    if not top.exists():
        log.warning("%s %s is a new directory below the current one, on local disk (a path without a protocol "
                    "is local); for object storage write its URL, e.g. tiered::s3://%s", TARGET, fo, rel)
