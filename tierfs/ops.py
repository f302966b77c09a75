"""Operations the command line runs on tiers outside a training job: copy a step, find stale leftovers.

``copy_step`` moves a committed step from one tier to another the way the store's background copy does:
every manifest checked against the marker, every block's crc32c checked before it is written, files
first, the commit marker (the source's, byte for byte) last. ``partial_steps`` lists uncommitted step
directories with the time their newest file was written, and ``live_users`` the processes still using a
RAM-tier directory, so that ``tierfs gc`` never removes a step a running job is writing.
"""

from __future__ import annotations

import datetime as _dt
import os
import time
from pathlib import Path
from typing import Any, Callable

from .errors import ChecksumError, FormatError, StepExistsError, StepNotFoundError
from .format import MARKER, Manifest, Marker, crc32c, manifest_filename, step_dirname
from .tiers.base import Tier
from .tiers.memory import process_alive

#: bytes read at once while copying or checking a step: bounds memory, keeps object transfers concurrent
BATCH_BYTES = 256 << 20
BATCH_FILES = 8


def batches(files: dict[str, int]) -> list[list[str]]:
    """A shard's files in groups of at most BATCH_BYTES / BATCH_FILES, in order."""
    out: list[list[str]] = [[]]
    size = 0
    for name, n in files.items():
        if out[-1] and (size + n > BATCH_BYTES or len(out[-1]) >= BATCH_FILES):
            out.append([])
            size = 0
        out[-1].append(name)
        size += n
    return [b for b in out if b]


def step_manifests(tier: Tier, step: int) -> tuple[bytes, Marker, list[tuple[str, bytes, Manifest]]]:
    """The marker of a committed ``step`` and every manifest it lists, each checked against it."""
    steps = tier.list_steps()
    if step not in steps:
        raise StepNotFoundError(f"step {step} is not on tier {tier.name!r}")
    if not steps[step]:
        raise StepNotFoundError(f"step {step} on tier {tier.name!r} is partial (no commit marker)")
    mbytes = bytes(tier.read_file(step, MARKER))
    marker = Marker.from_bytes(mbytes)
    if marker.step != step or len(marker.manifests) != marker.world_size:
        raise FormatError(f"commit marker of step {step} on tier {tier.name!r} does not describe it")
    out = []
    for rank, (name, crc) in enumerate(sorted(marker.manifests.items())):
        if name != manifest_filename(rank):
            raise FormatError(f"commit marker lists {name}, expected {manifest_filename(rank)}")
        try:
            raw = bytes(tier.read_file(step, name))
        except FileNotFoundError:
            raise FormatError(f"{name} of step {step} is missing on tier {tier.name!r} (a node-local tier holds "
                              "only its node's ranks: copy from a shared tier)") from None
        if crc32c(raw) != crc:
            raise ChecksumError(f"{name} of step {step} on tier {tier.name!r} does not match its commit marker")
        m = Manifest.from_bytes(raw)
        if m.step != step or m.rank != rank:
            raise FormatError(f"{name} is for step {m.step} rank {m.rank}")
        out.append((name, raw, m))
    return mbytes, marker, out


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
    from ._copy import verify as _verify

    mbytes, marker, manifests = step_manifests(src, step)
    there = dst.list_steps().get(step)
    if there is not None:
        if not overwrite:
            what = "committed" if there else "partially written (an interrupted or running copy)"
            raise StepExistsError(f"step {step} is already {what} on {dst.name!r}; pass --overwrite to replace it")
        dst.delete_step(step)
    total = 0
    expected: dict[str, int] = {}
    for name, raw, m in manifests:
        for names in batches(m.files):
            part = Manifest(step, m.rank, m.world_size,
                            [e for e in m.entries if e.kind == "array" and e.file in names],
                            {n: m.files[n] for n in names}, m.block_size)
            files = src.read_files(step, names)
            try:
                _verify(part, files, threads)
            except (ChecksumError, FormatError) as e:
                raise type(e)(f"{name}: {e}; nothing committed on {dst.name!r}") from e
            dst.write_files(step, files)
            del files
            total += part.nbytes
            if progress is not None:
                progress(part.nbytes)
        dst.write_file(step, name, raw)
        expected.update(m.files)
        expected[name] = len(raw)
    have = dst.file_sizes(step)
    bad = [n for n, size in expected.items() if have.get(n) != size]
    if bad:
        raise FormatError(f"{dst.name!r} step {step}: {len(bad)} file(s) missing or wrong size after the copy "
                          f"(e.g. {bad[0]}); not committed")
    dst.write_marker(step, mbytes)
    return total


# -- leftovers --------------------------------------------------------------------------------------

def _mtime(info: dict[str, Any]) -> float | None:
    """A file's modification time from an fsspec ``info``/``ls`` entry (keys differ per backend)."""
    for key in ("mtime", "LastModified", "updated", "last_modified", "created"):
        v = info.get(key)
        if v is None:
            continue
        if isinstance(v, (int, float)):
            return float(v)
        if isinstance(v, _dt.datetime):
            return v.timestamp()
        if isinstance(v, str):
            try:
                return _dt.datetime.fromisoformat(v.replace("Z", "+00:00")).timestamp()
            except ValueError:
                continue
    return None


def last_written(tier: Tier, step: int) -> float | None:
    """When the newest file of ``step`` on ``tier`` was written (seconds since the epoch), or None."""
    from .tiers import MemoryTier, ObjectTier

    times: list[float] = []
    if isinstance(tier, MemoryTier):
        d = tier.path / step_dirname(step)
        for p in [d, *d.iterdir()] if d.is_dir() else []:
            try:
                times.append(p.stat().st_mtime)
            except FileNotFoundError:
                pass
    elif isinstance(tier, ObjectTier):
        path = f"{tier.root}/{step_dirname(step)}"
        tier.fs.invalidate_cache(path)
        try:
            entries = tier.fs.ls(path, detail=True)
        except FileNotFoundError:
            return None
        for e in entries:
            t = _mtime(e)
            if t is None:
                return None  # the backend does not say: the age is unknown
            times.append(t)
    return max(times) if times else None


def partial_steps(tier: Tier, now: float | None = None) -> list[tuple[int, float | None]]:
    """``[(step, seconds since its newest file was written, or None if unknown)]`` of uncommitted steps."""
    now = time.time() if now is None else now
    out = []
    for step, ok in sorted(tier.list_steps().items()):
        if not ok:
            t = last_written(tier, step)
            out.append((step, None if t is None else max(0.0, now - t)))
    return out


def live_users(tier: Tier) -> list[int]:
    """Live processes (other than this one) using a RAM tier's directory: they map a file in it (Linux
    ``/proc/<pid>/maps``) or own a buffer pool there (``.pool.<pid>``). Empty for other tiers."""
    from .tiers import MemoryTier

    if not isinstance(tier, MemoryTier):
        return []
    me = os.getpid()
    pids: set[int] = set()
    for d in Path(tier.path).glob(".pool.*"):
        pid = d.name.rsplit(".", 1)[-1]
        if pid.isdigit() and int(pid) != me and process_alive(int(pid)):
            pids.add(int(pid))
    root = str(Path(tier.path).resolve()) + "/"
    for maps in Path("/proc").glob("[0-9]*/maps"):
        pid = int(maps.parent.name)
        if pid == me or pid in pids:
            continue
        try:
            with open(maps, encoding="utf-8", errors="replace") as f:
                if any(root in line for line in f):
                    pids.add(pid)
        except OSError:  # gone, or not ours to read
            continue
    return sorted(pids)

