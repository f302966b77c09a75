"""The ``tiered::`` filesystem's options, RAM directory and paths, checked before anything is done.

Options may come from the caller or from fsspec's config as strings (``FSSPEC_TIERED_BUDGET=...``); each
bad one is a one-line :class:`~tierfs.errors.ArgumentError` naming it. The RAM directory follows the RAM
tier's rules (:mod:`tierfs._rootdir`: no system directory, a warning when not on tmpfs).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import _args
from .._fileio import make_private_dir
from .._rootdir import check_root, default_path, root_dir, warn_unless_memory
from ..dist import seconds
from ..errors import ArgumentError, TierUnavailableError

WHAT = "tiered:// path"


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
    """The filesystem's options (see :class:`~tierfs.adapters.fsspec.TieredFileSystem`), checked."""
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
