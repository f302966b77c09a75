"""Operations the command line runs on tiers outside a training job: copy a step, find stale leftovers.

``copy_step`` moves a committed step from one tier to another the way the store's background copy does
(:func:`tierfs.protocol.copy_shard` for every rank's shard, then the source's commit marker, byte for
byte, last). ``partial_steps`` lists uncommitted step directories with the time their newest file was
written, so that ``tierfs gc`` never removes a step a running job is writing (see also
``Tier.live_users``).
"""

from __future__ import annotations

import time
from typing import Callable

from .errors import ChecksumError, FormatError, StepExistsError
from .protocol import commit, copy_shard, step_manifests
from .tiers.base import Tier


def copy_step(src: Tier, dst: Tier, step: int, *, overwrite: bool = False, threads: int | None = None,
              progress: Callable[[int], None] | None = None) -> int:
    """Copy committed ``step`` from ``src`` to ``dst``, verified, marker last; returns the bytes copied.

    Parameters
    ----------
    src, dst : Tier
        Open tiers (``dst`` may be a plain directory as an ``ObjectTier("file://...")``).
    step : int
        The step; it must be committed on ``src``.
    overwrite : bool
        Replace a copy (committed or partial) already on ``dst``; without it that is a StepExistsError.
    threads : int, optional
        Checksum threads.
    progress : callable, optional
        Called with the bytes of each batch written.

    Raises
    ------
    StepNotFoundError, StepExistsError, ChecksumError, FormatError, OSError
        Nothing is committed on ``dst`` unless every byte verified and every file was written.
    """
    marker_bytes, marker, manifests = step_manifests(src, step)
    there = dst.list_steps().get(step)
    if there is not None:
        if not overwrite:
            what = "committed" if there else "partially written (an interrupted or running copy)"
            raise StepExistsError(f"step {step} is already {what} on {dst.name!r}; pass --overwrite to replace it")
        dst.delete_step(step)
    total = 0
    expected: dict[str, int | None] = {}
    for name, raw, m in manifests:
        try:
            total += copy_shard(src, dst, step, m, raw, threads=threads, progress=progress)
        except (ChecksumError, FormatError) as e:
            raise type(e)(f"{name}: {e}; nothing committed on {dst.name!r}") from e
        expected.update(m.files)
        expected[name] = len(raw)
    commit(dst, step, marker_bytes, expected)
    return total


def partial_steps(tier: Tier, now: float | None = None) -> list[tuple[int, float | None]]:
    """``[(step, seconds since its newest file was written, or None if unknown)]`` of uncommitted steps."""
    now = time.time() if now is None else now
    out = []
    for step, ok in sorted(tier.list_steps().items()):
        if not ok:
            t = tier.last_written(step)
            out.append((step, None if t is None else max(0.0, now - t)))
    return out
