"""What ``tierfs cp``, ``verify`` and ``gc`` do to steps on tiers outside a training job: copy a step, name
the damage a verification finds, find stale leftovers.

``copy_step`` moves a committed step from one tier to another the way the store's background copy does
(:func:`tierfs.protocol.copy_shard` for every rank's shard, then the source's commit marker, byte for byte,
last). ``verify_shard_naming_damage`` checks one rank's shard and names a damaged block by its file, its
bytes in that file and the user's key (:class:`Damage`). ``partial_steps`` lists uncommitted step
directories with the time their newest file was written, so that ``tierfs gc`` never removes a step a
running job is writing (see also ``Tier.live_users``).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from ..format import blockio as _blocks
from ..errors import ArgumentError, ChecksumError, FormatError, StepExistsError, TierfsError
from ..format import Manifest, blocks, crc32c
from ..protocol import batches, commit, copy_shard, step_manifests
from ..tiers.base import Tier
from ..tiers.capabilities import LocalFiles


@dataclass(frozen=True)
class Damage:
    """A block of a shard file whose crc32c is not the one its manifest records.

    ``start`` and ``end`` are byte offsets in ``file``; ``key`` is the entry holding the block as messages
    name it (the user's key, :meth:`Manifest.key`).
    """

    rank: int
    file: str
    start: int
    end: int
    key: str
    stored: int
    read: int

    def __str__(self) -> str:
        return (f"{self.file} bytes {self.start}-{self.end}, part of {self.key}: checksum mismatch (stored "
                f"{self.stored:#010x}, read {self.read:#010x})")


def find_damage(manifest: Manifest, files: Mapping[str, Any]) -> list[Damage]:
    """Every block of the array entries in ``files`` (a subset of the shard's files, bytes or arrays) whose
    crc32c differs from the manifest's, in file order; empty when all check out.

    Raises FormatError when a file's length is not the manifest's (a truncated copy).
    """
    raw = _blocks.shard_views(manifest, files)
    out = []
    for e in sorted((e for e in manifest.entries if e.kind == "array" and e.file in raw),
                    key=lambda e: (e.file, e.offset)):
        data = raw[e.file][e.offset:e.offset + e.length]
        for b, (s, t) in enumerate(blocks(e.length, manifest.block_size)):
            c = crc32c(data[s:t])
            if c != e.crc32c[b]:
                out.append(Damage(manifest.rank, e.file, e.offset + s, e.offset + t, manifest.key(e.name),
                                  e.crc32c[b], c))
    return out


def _damaged(tier: Tier, step: int, manifest: Manifest, files: Mapping[str, Any], e: ChecksumError) -> ChecksumError:
    """The ChecksumError ``e`` of a shard's files, naming the first damaged file, its bytes and the entry."""
    found = find_damage(manifest, files)
    if not found:
        return e  # the bytes changed back (a tier being written): keep what the check saw
    more = f" (and {len(found) - 1} more damaged blocks)" if len(found) > 1 else ""
    return ChecksumError(f"step {step} rank {manifest.rank} on {tier.name}: {found[0]}{more}")


def verify_shard_naming_damage(tier: Tier, step: int, manifest: Manifest, *, threads: int | None = None,
                 progress: Callable[[int], None] | None = None) -> int:
    """Check every block of one rank's shard of ``step`` on ``tier``; returns the bytes checked.

    As :func:`tierfs.protocol.verify_shard`, a batch of files at a time, but a ChecksumError names the
    damaged shard file, the byte range within it and the user's key::

        step 7 rank 0 on ram: rank_00000.0003.bin bytes 1048576-2097152, part of 'model.0.weight' (the
        chunk at 0,0): checksum mismatch (stored 0x1c291ca3, read 0x5a2d8e41)

    Raises
    ------
    ChecksumError
        A block does not match its checksum.
    FormatError
        A shard file is not as long as the manifest says (a truncated copy).
    OSError
        A file cannot be read.
    """
    checked = 0
    for names in batches(manifest.held_files(tier.is_local)):
        part = manifest.subset(names)
        files = tier.read_files(step, names)
        try:
            _blocks.verify(part, files, threads)
        except ChecksumError as e:
            raise _damaged(tier, step, manifest, files, e) from e
        finally:
            del files
        checked += part.nbytes
        if progress is not None:
            progress(part.nbytes)
    return checked


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
        if _place(src) == _place(dst):
            raise ArgumentError(f"{src.name!r} and {dst.name!r} are the same place: copying step {step} over "
                                "itself would delete it first")
        for _, _, m in manifests:  # every byte of the source before the copy there goes
            verify_shard_naming_damage(src, step, m, threads=threads)
        dst.delete_step(step)
    if dst.is_local and not src.is_local and any(m.local_files for _, _, m in manifests):
        raise TierfsError(f"step {step} on {src.name!r} stores the entries data-parallel ranks share once, in "
                          f"their owners' shards; {dst.name!r} would need every rank's copy: restore it through "
                          "a store (TieredStore.localize) or copy it to a shared tier")
    total = 0
    expected: dict[str, int | None] = {}
    for name, raw, m in manifests:
        try:
            total += copy_shard(src, dst, step, m, raw, threads=threads, progress=progress)
        except ChecksumError as e:
            # name the damaged file and bytes: look again, at the source's files only (the failure path)
            try:
                verify_shard_naming_damage(src, step, m, threads=threads)
                found: Exception = e
            except (ChecksumError, FormatError) as again:
                found = again
            raise ChecksumError(f"{found if found is not e else f'{name}: {e}'}; nothing committed on "
                                f"{dst.name!r}") from e
        except FormatError as e:
            raise FormatError(f"{name}: {e}; nothing committed on {dst.name!r}") from e
        expected.update(m.held_files(dst.is_local))
        expected[name] = len(raw)
    commit(dst, step, marker_bytes, expected)
    return total


def _place(tier: Tier) -> tuple[str, ...]:
    """Where a tier keeps its steps: its directory, resolved, or its store (protocol, endpoint) and root."""
    dirs = tier.local_dirs() if isinstance(tier, LocalFiles) else []
    if dirs:
        return (os.path.realpath(dirs[0]),)
    opts = getattr(tier, "storage_options", {}) or {}
    endpoint = opts.get("endpoint_url") or (opts.get("client_kwargs") or {}).get("endpoint_url") or ""
    return (str(getattr(tier, "protocol", "")), str(endpoint), str(getattr(tier, "root", tier.name)))


def partial_steps(tier: Tier, now: float | None = None) -> list[tuple[int, float | None]]:
    """``[(step, seconds since its newest file was written, or None if unknown)]`` of uncommitted steps."""
    now = time.time() if now is None else now
    out = []
    for step, ok in sorted(tier.list_steps().items()):
        if not ok:
            t = tier.last_written(step)
            out.append((step, None if t is None else max(0.0, now - t)))
    return out
