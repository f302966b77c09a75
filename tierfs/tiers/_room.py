"""The RAM tier's space: what its directory holds, what the tmpfs has free, and the errors of a full one."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

from ..util import readable as _readable
from ..errors import CapacityError
from ._mapped import Pool
from .base import Capacity

FULL_ADVICE = "free memory on its tmpfs (other files or processes use it) or keep fewer steps"


def capacity(root: Path, budget: int | None) -> Capacity:
    """The bytes of every file below ``root``, ``budget``, and the bytes free on its file system."""
    used = 0
    for d, _dirs, files in os.walk(root):
        for f in files:
            try:
                used += os.stat(os.path.join(d, f)).st_size
            except FileNotFoundError:
                pass
    try:
        sv = os.statvfs(root)
        free: int | None = sv.f_bavail * sv.f_frsize
    except FileNotFoundError:
        free = None
    return Capacity(used=used, budget=budget, free=free)


def full(root: Path, what: str) -> CapacityError:
    """The error of a write (``what``) that found the tmpfs of ``root`` full (no bytes or no inodes left)."""
    try:
        sv = os.statvfs(root)
        left = f"{_readable.size(sv.f_bavail * sv.f_frsize)} and {sv.f_favail} inodes free"
    except OSError:
        left = "free space unknown"
    return CapacityError(f"RAM tier {root}: out of space {what} ({left}); {FULL_ADVICE}")


def no_room(root: Path, step: int, new_bytes: int, cap: Capacity) -> CapacityError:
    """The error of a save of ``step`` that needs ``new_bytes`` more than ``cap`` has room for."""
    by_budget = cap.budget is not None and (cap.free is None or cap.budget - cap.used <= cap.free)
    return CapacityError(
        f"RAM tier {root}: step {step} needs {_readable.size(new_bytes)} more but only "
        f"{_readable.size(max(0, cap.available or 0))} is left (budget "
        f"{'none' if cap.budget is None else _readable.size(cap.budget)}, used "
        f"{_readable.size(cap.used)}, {'unknown' if cap.free is None else _readable.size(cap.free)} free "
        f"on the tmpfs); {'raise budget= or keep fewer steps' if by_budget else FULL_ADVICE} (need about "
        f"(kept steps + 1) x step size)")


def make_room(root: Path, space: Callable[[], Capacity], pool: Pool, step: int, new_bytes: int,
              keep: set[int]) -> None:
    """Raise CapacityError unless ``new_bytes`` more fit in the tier at ``root`` (``space()``: its
    capacity now); the ``pool``'s buffers not in ``keep`` (ids) are reclaimable space and go first, and what
    a spare buffer being made meanwhile holds counts as free (``Pool.fill`` keeps it only if it still fits)."""
    if new_bytes <= 0:  # every buffer comes from the pool (a steady save): nothing to count
        return
    spare = pool.made()  # (before the space: never more than it counts)
    cap = space()
    if cap.available is None or new_bytes <= cap.available + spare:
        return
    for b in [b for b in pool.files if id(b) not in keep]:
        pool.drop(b)
    spare = pool.made()
    cap = space()
    if cap.available is not None and new_bytes > cap.available + spare:
        raise no_room(root, step, new_bytes, cap)
