"""The commit protocol's checks and copies, each written once and used by every caller (the store, the
peer tier, ``tierfs cp``/``verify``/``gc``, the adapters).

- :func:`checked_manifest`: a rank's manifest of a step on a tier, trusted only once it matches its commit
  marker (:func:`tierfs.format.manifest_from_marker`, which the peer tier's wire protocol uses too).
- :func:`step_manifests`: every rank's manifest of a committed step, each checked.
- :func:`check_complete`: every file of a step is there, at its length, before its marker is written.
- :func:`copy_shard` and :func:`commit`: a verified copy with the marker last (every block checked
  before it is written, the manifest after its files, the marker after every manifest).
- :func:`verify_shard`: every checksum of a shard, a batch of files at a time.
- :func:`common_steps`: the steps every rank can get.
"""

from __future__ import annotations

from typing import Callable, Iterable, Mapping, Sequence

from .format import blockio as _blocks
from .errors import ChecksumError, FormatError, StepNotFoundError
from .format import (MARKER, Manifest, Marker, crc32c, listed_in, manifest_filename, manifest_from_marker,
                     step_digest)
from .tiers.base import Tier

#: bytes read at once while copying or checking a step: bounds memory, keeps object transfers concurrent
BATCH_BYTES = 256 << 20
BATCH_FILES = 8

Progress = Callable[[int], None]


def checked_manifest(tier: Tier, step: int, rank: int, marker: Marker | None = None
                     ) -> tuple[Manifest, bytes]:
    """Rank ``rank``'s manifest of ``step`` on ``tier`` and its bytes, checked against the marker (read
    from the tier unless given)."""
    marker = tier.read_marker(step) if marker is None else marker
    listed_in(marker, step, manifest_filename(rank))  # before reading: a wrong rank costs no download
    tier.note_marker(step, marker)  # where the step's files are (its version): no second read of the marker
    mbytes = bytes(tier.read_file(step, manifest_filename(rank)))
    return manifest_from_marker(marker, mbytes, step, rank), mbytes


def step_manifests(tier: Tier, step: int) -> tuple[bytes, Marker, list[tuple[str, bytes, Manifest]]]:
    """The marker bytes and marker of a committed ``step`` and every manifest it lists, each checked.

    Raises StepNotFoundError when the step is missing or partial, FormatError/ChecksumError naming the
    manifest when one is missing (a node-local tier holds only its node's ranks) or does not match.
    """
    steps = tier.list_steps()
    if step not in steps:
        raise StepNotFoundError(f"step {step} is not on tier {tier.name!r}")
    if not steps[step]:
        raise StepNotFoundError(f"step {step} on tier {tier.name!r} is partial (no commit marker)")
    raw = bytes(tier.read_file(step, MARKER))
    marker = Marker.from_bytes(raw)
    if marker.step != step or len(marker.manifests) != marker.world_size:
        raise FormatError(f"the commit marker of step {step} on tier {tier.name!r} lists "
                          f"{len(marker.manifests)} manifests for step {marker.step} of world size "
                          f"{marker.world_size}")
    out = []
    for rank, name in enumerate(sorted(marker.manifests)):
        if name != manifest_filename(rank):
            raise FormatError(f"the commit marker lists {name}, expected {manifest_filename(rank)}")
        try:
            m, mbytes = checked_manifest(tier, step, rank, marker)
        except FileNotFoundError:
            raise FormatError(f"{name} of step {step} is missing on tier {tier.name!r} (a node-local tier holds "
                              "only its node's ranks: copy from a shared tier)") from None
        out.append((name, mbytes, m))
    if marker.digest is not None and step_digest({r: crc32c(mb) for r, (_, mb, _) in enumerate(out)}) != marker.digest:
        raise ChecksumError(f"the manifests of step {step} on tier {tier.name!r} are not the set its commit marker "
                            "was written for")
    return raw, marker, out


def check_complete(tier: Tier, step: int, expected: Mapping[str, int | None]) -> None:
    """Before a marker is written: every expected file of ``step`` is on ``tier``, at its length (None:
    any length)."""
    have = tier.sizes_of(step, expected)
    bad = [n for n, size in expected.items() if n not in have or (size is not None and have[n] != size)]
    if bad:
        raise FormatError(f"tier {tier.name!r} step {step}: {len(bad)} file(s) missing or wrong size before "
                          f"commit (e.g. {bad[0]}); another process may have removed them; not committing")


def batches(files: Mapping[str, int], max_bytes: int | None = BATCH_BYTES,
            max_files: int | None = BATCH_FILES) -> list[list[str]]:
    """A shard's files in groups of at most ``max_bytes`` / ``max_files`` (None: no bound), in order."""
    out: list[list[str]] = [[]]
    size = 0
    for name, n in files.items():
        full = (max_bytes is not None and size + n > max_bytes) or (max_files is not None and
                                                                    len(out[-1]) >= max_files)
        if out[-1] and full:
            out.append([])
            size = 0
        out[-1].append(name)
        size += n
    return [b for b in out if b]


def verify_shard(tier: Tier, step: int, manifest: Manifest, *, threads: int | None = None,
                 progress: Progress | None = None) -> int:
    """Check every block of a shard on ``tier`` (the files it holds: :meth:`Manifest.held_files`), a batch
    of files at a time; returns the bytes checked."""
    checked = 0
    for names in batches(manifest.held_files(tier.is_local)):
        part = manifest.subset(names)
        _blocks.verify(part, tier.read_files(step, names), threads)
        checked += part.nbytes
        if progress is not None:
            progress(part.nbytes)
    return checked


def copy_shard(src: Tier, dst: Tier, step: int, manifest: Manifest, mbytes: bytes, *,
               threads: int | None = None, pace: Progress | None = None, batched: bool = True,
               progress: Progress | None = None) -> int:
    """Copy one rank's shard of ``step`` from ``src`` to ``dst``, verified: every block is checked before
    its file is written (a damaged copy never becomes another tier's), the manifest goes after its
    files, and the result is checked complete. The marker is the caller's (:func:`commit`), once every
    rank's shard is there. ``pace(nbytes)`` is called before bytes are checked and before they are
    written (a bandwidth throttle); ``batched=False`` moves the whole shard at once (a RAM source: reads
    are views). Only the files ``dst`` holds are copied (:meth:`Manifest.held_files`: a shared tier
    stores entries other ranks own only in their shards). Returns the bytes copied."""
    held = manifest.held_files(dst.is_local)
    groups = batches(held) if batched else [list(held)]
    for names in groups:
        files = src.read_files(step, names)
        part = manifest.subset(names)
        _blocks.verify(part, files, threads, pace=pace)
        dst.write_files(step, files, pace=pace)
        del files
        if progress is not None:
            progress(part.nbytes)
    mname = manifest_filename(manifest.rank)
    dst.write_file(step, mname, mbytes)
    check_complete(dst, step, {**held, mname: len(mbytes)})
    return sum(held.values())


def commit(dst: Tier, step: int, marker: bytes, expected: Mapping[str, int | None]) -> None:
    """Write the commit marker of ``step`` once every ``expected`` file is on ``dst``."""
    check_complete(dst, step, expected)
    dst.write_marker(step, marker)


def expected_manifests(marker: Marker) -> dict[str, int | None]:
    """The manifests a step's marker lists, as :func:`check_complete` takes them."""
    return {n: None for n in marker.manifests}


def common_steps(views: Sequence[Iterable[int]]) -> set[int]:
    """The steps in every rank's view (each rank's list of the steps it can get)."""
    sets = [set(v) for v in views]
    return set.intersection(*sets) if sets else set()
