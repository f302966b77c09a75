"""This process's drains: one per (RAM directory, target), shared by every ``tiered::`` instance on them.

fsspec makes separate instances per thread and for async use, and zarr makes its own; all of them that
name the same RAM directory and target get the same :class:`~tierfs.fs.writeback.Drain`, so ``flush()``
on any of them waits for writes made through all of them.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import fsspec

from ..util import exitwork as _exit
from . import upload
from .writeback import Drain

log = logging.getLogger("tierfs")


_DRAINS: dict[tuple, Drain] = {}
_DRAINS_LOCK = threading.Lock()


def drain_for(root: Path, target: fsspec.AbstractFileSystem, key: tuple, *, budget: int | None,
              drain: str, bandwidth: float | None, concurrency: int, retries: int, when_full: str,
              exit_timeout: float) -> Drain:
    """This process's drain for the RAM directory ``root`` and the target identified by ``key``; made
    by the first caller, whose options it keeps. Its uploads still pending at interpreter exit are
    finished within ``exit_timeout`` seconds (:mod:`tierfs.util.exitwork`)."""
    dkey = (os.getpid(), str(root), key)
    with _DRAINS_LOCK:
        d = _DRAINS.get(dkey)
        if d is None:
            d = _DRAINS[dkey] = Drain(root, target, budget=budget, drain=drain, bandwidth=bandwidth,
                                      concurrency=concurrency, retries=retries, when_full=when_full,
                                      exit_timeout=exit_timeout)
            _exit.register(d, exit_timeout, upload.exit_work)
        elif not d.same_options(budget, drain, bandwidth, when_full, exit_timeout):
            log.warning("tiered: %s already has a drain with other options; keeping the first ones", root)
    return d
