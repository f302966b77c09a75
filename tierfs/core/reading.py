"""Reading a rank's shard from a tier: verified, then copied once into where the caller wants it.

A :class:`~tierfs.core.sinks.Sink` says where a shard's entries go (:mod:`.sinks`). Every read checks
the manifest against the marker and every block of the wanted entries against the manifest
before its bytes are used. :meth:`Reader.first_verified` is the one loop that tries tiers fastest first,
logs each one skipped and why, and goes on.

Nothing here is collective: any rank may read any rank's shard (the DCP reader reshards that way).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Sequence, TypeVar

import numpy as np

from .. import _copy, _hooks, _nogc
from .._stages import stage
from ..errors import ArgumentError, RestoreError, StateMismatchError, StepNotFoundError, TierfsError
from ..format import MARKER, Entry, Manifest, Marker
from ..protocol import checked_manifest, verify_shard
from ..tiers.base import Tier
from ..tiers.memory import MemoryTier
from .layout import ReadViews
from .parts import Parts
from .sinks import Sink, Views

log = logging.getLogger("tierfs")
T = TypeVar("T")
#: errors that make one tier's copy unusable (the next source is tried)
UNUSABLE = (TierfsError, OSError, ValueError, KeyError)
Skipped = list[tuple[str, int, str]]  # (tier, step, reason)


@dataclass
class Shard:
    """One rank's shard of a step as read from some source; kept until a restore has re-seeded peers."""

    manifest: Manifest
    mbytes: bytes
    marker: bytes
    files: Mapping[str, Any]
    #: entries received straight into the sink's arrays, ``{name: uint8 view}``: their bytes in ``files``
    #: are undefined (see :meth:`whole`)
    landed: Mapping[str, np.ndarray] = field(default_factory=dict)

    def whole(self) -> Shard:
        """This shard with every byte in its files: the landed entries copied back from where they landed
        (for sending it on, while the restore still owns those arrays)."""
        if not self.landed:
            return self
        raw = {n: _copy.as_u8(f) for n, f in self.files.items()}
        for e in self.manifest.entries:
            v = self.landed.get(e.name)
            if v is not None:
                raw[e.file][e.offset:e.offset + e.length] = v
        return Shard(self.manifest, self.mbytes, self.marker, self.files)


class _Files(Mapping[str, Any]):
    """Files of a step in a tier, each read when first used, to be sent on."""

    def __init__(self, tier: Tier, step: int, names: Sequence[str]) -> None:
        self.tier, self.step, self.names = tier, step, list(names)

    def __getitem__(self, name: str) -> Any:
        if name not in self.names:
            raise KeyError(name)
        if isinstance(self.tier, MemoryTier):  # only sent on: the wire maps the pages as it reads them
            return self.tier.read_file(self.step, name, populate=False)
        return self.tier.read_file(self.step, name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


def fill(tier: Tier | None, step: int, shard: Shard, sink: Sink | None, threads: int | None,
         verified: bool = False) -> None:
    """Verify every block of the shard's wanted entries and copy them into the sink (no sink: verify the
    whole shard, copy nothing). ``tier`` is where the shard was read (None: received from a peer).
    ``verified``: every block was checked already (as it landed from a peer): only copy."""
    with _nogc.paused():
        _fill(tier, step, shard, sink, threads, verified)


def _fill(tier: Tier | None, step: int, shard: Shard, sink: Sink | None, threads: int | None,
          verified: bool = False) -> None:
    manifest = shard.manifest
    if sink is None:
        if not verified:
            _copy.verify(manifest, shard.files, threads)
        return
    sink.reset()  # what an earlier source delivered before it failed, or an older attempt's values
    sink.check(manifest)
    raw = _copy.shard_views(manifest, shard.files)
    landed = shard.landed
    jobs: list[_copy.Job] = []
    views = ReadViews.of(manifest)
    targets: list[Any] = []
    sources: list[Any] = []
    small: list[tuple[Entry, np.ndarray]] = []
    memos: dict[str, dict[Any, Any] | None] = {}
    wanted = sink.wanted
    entries = manifest.entries
    if wanted is not None and len(wanted) * 4 < len(entries):  # a few entries of many: look them up
        entries = [views.by_name[n] for n in wanted if n in views.by_name]
    for e in entries:
        if wanted is not None and e.name not in wanted:
            continue
        if e.kind == "json":
            sink.json(e)
            continue
        if e.name in landed:  # received straight into its array, every block checked as it landed
            sink.took(e)
            continue
        target = sink.direct(e)
        if target is not None:  # verified first, copied with the others after
            targets.append(target)
            if e.file not in memos:
                memos[e.file] = None if tier is None else tier.buffer_memo(step, e.file)
            typed, src = views.typed(e, raw[e.file], memos[e.file])
            sources.append(typed)
            if len(e.crc32c) == 1:
                small.append((e, src))
                continue
        else:
            src = raw[e.file][e.offset:e.offset + e.length]
        dst = None if target is not None else sink.array(e, src, tier, step)
        if verified and dst is None:
            continue  # nothing to check, nothing to copy here (a direct target's copy comes below)
        jobs.append(_copy.Job(e.name, src, dst, manifest.block_size, None if verified else e.crc32c,
                              functools.partial(manifest.key, e.name)))
    if not verified:
        _copy.verify_small([_copy.Job(e.name, src, None, manifest.block_size, e.crc32c,
                                      functools.partial(manifest.key, e.name)) for e, src in small]
                           if _hooks.active("block") else small, manifest)
    _copy.run(jobs, threads, checksum=not verified)
    if targets:
        sink.copy_direct(targets, sources)
    sink.finish()


class Reader:
    """Reads of committed steps, without collectives."""

    def __init__(self, parts: Parts) -> None:
        self.parts = parts

    def read_shard(self, tier: Tier, step: int, rank: int, sink: Sink | None) -> Shard:
        """Rank ``rank``'s shard of ``step`` from ``tier``, verified and delivered to ``sink``.

        A shared tier holds the entries several ranks share only in their owner's shard
        (:meth:`~tierfs.format.Manifest.held_files`): there the shard comes back without those files,
        what is there verified, and is delivered to no sink (the restore completes it from other ranks,
        :mod:`.completing`); a partial sink (``read_entries``) gets the others' names in ``sink.away``,
        by owner, to read from the owners' shards."""
        with self.parts.ledger.pinned(tier.name, step), stage("read", step, tier.name):
            marker = bytes(tier.read_file(step, MARKER))
            manifest, mbytes = checked_manifest(tier, step, rank, Marker.from_bytes(marker))
            if sink is not None:
                sink.check(manifest)  # before reading: a wrong target costs no download
            held = manifest.held_files(tier.is_local)
            whole = len(held) == len(manifest.files)
            names = list(held)
            if sink is not None and sink.partial and sink.wanted is not None:  # the files holding wanted arrays
                if not whole:
                    sink.elsewhere(manifest, held)
                names = sorted({e.file for e in manifest.entries if e.kind == "array" and e.name in sink.wanted})
            shard = Shard(manifest, mbytes, marker, tier.read_files(step, names) if names else {})
            if not whole and (sink is None or not sink.partial):
                _copy.verify(manifest.subset(names), shard.files, self.parts.threads)
                return shard
            fill(tier, step, shard, sink, self.parts.threads)
            return shard

    def open_shard(self, tier: Tier, step: int, rank: int) -> Shard:
        """Rank ``rank``'s shard of ``step`` in ``tier`` as it is, for sending on: its manifest checked
        against the marker, its blocks not read (each receiver checks them as they land); each file is
        read when first used."""
        marker = bytes(tier.read_file(step, MARKER))
        manifest, mbytes = checked_manifest(tier, step, rank, Marker.from_bytes(marker))
        return Shard(manifest, mbytes, marker, _Files(tier, step, list(manifest.held_files(tier.is_local))))

    def first_verified(self, tiers: Sequence[Tier], step: int, read: Callable[[Tier], T], skipped: Skipped,
                       what: str = "") -> tuple[Tier, T] | None:
        """``(tier, read(tier))`` for the first of ``tiers`` (fastest first) whose copy of ``step`` reads and
        verifies; each one skipped is logged and recorded in ``skipped``. A StateMismatchError (the
        caller's target is wrong, not the copy) is raised at once. None when every tier failed."""
        for t in tiers:
            try:
                return t, read(t)
            except (StateMismatchError, ArgumentError):  # the caller's mistake: no other copy does better
                raise
            except UNUSABLE as e:
                why = f"{type(e).__name__}: {e}"
                log.warning("tier %s step %d%s unusable, trying the next source (%s)", t.name, step, what, why)
                skipped.append((t.name, step, why))
        return None

    def holding(self, step: int, tiers: Sequence[str] | None) -> list[Tier]:
        """The file tiers among ``tiers`` (default: all) holding a committed copy of ``step``."""
        usable = self.parts.usable(tiers)
        self.parts.refresh()
        before, _, after = self.parts.roles(usable)  # in the order asked for
        held = [t for t in before + after if step in self.parts.ledger.holding(t.name)]
        if not held:
            raise StepNotFoundError(f"step {step} is not committed on {[t.name for t in usable]}")
        return held

    def read_marker(self, step: int, tiers: Sequence[str] | None = None) -> Marker:
        skipped: Skipped = []
        found = self.first_verified(self.holding(step, tiers), step, lambda t: t.read_marker(step), skipped)
        if found is None:
            raise RestoreError(f"step {step}: no readable commit marker ({_reasons(skipped)})")
        return found[1]

    def read_manifest(self, step: int, rank: int, tiers: Sequence[str] | None = None) -> tuple[Manifest, str]:
        def read(t: Tier) -> Manifest:
            with self.parts.ledger.pinned(t.name, step):
                return checked_manifest(t, step, rank)[0]
        skipped: Skipped = []
        found = self.first_verified(self.holding(step, tiers), step, read, skipped, f" rank {rank}")
        if found is None:
            raise RestoreError(f"step {step}: no tier holds a verified manifest of rank {rank} "
                               f"({_reasons(skipped)})")
        return found[1], found[0].name

    def read_entries(self, step: int, rank: int, names: Sequence[str] | None, tiers: Sequence[str] | None,
                     consume: Callable[[Mapping[str, tuple[Entry, Any]], str], None]) -> tuple[str, Skipped]:
        """See :meth:`TieredStore.read_entries`."""
        skipped: Skipped = []
        wanted = None if names is None else list(dict.fromkeys(names))
        for t in self.holding(step, tiers):
            sink = Views(wanted)
            with self.parts.ledger.pinned(t.name, step):
                if self.first_verified([t], step, lambda t: self._entries(t, step, rank, sink), skipped,
                                       f" rank {rank}") is not None:
                    consume(sink.values, t.name)  # while the tier's files are pinned
                    return t.name, skipped
        raise RestoreError(f"step {step} rank {rank}: no tier holds a verified copy ({_reasons(skipped)})")

    def _entries(self, t: Tier, step: int, rank: int, sink: Views) -> None:
        """Wanted entries of ``rank``'s shard on ``t``; those a shared tier holds in their owners' shards
        read from there."""
        self.read_shard(t, step, rank, sink)
        for owner, names in sorted(sink.away.items()):
            there = Views(names)
            self.read_shard(t, step, owner, there)
            sink.values.update(there.values)

    def verify(self, step: int, tier: Tier) -> Manifest:
        """Check every checksum of this rank's copy of ``step`` on ``tier``; raise on the first problem."""
        manifest, _ = checked_manifest(tier, step, self.parts.group.rank)
        verify_shard(tier, step, manifest, threads=self.parts.threads)
        return manifest


def _reasons(skipped: Skipped) -> str:
    return "; ".join(f"{t} step {s}: {w}" for t, s, w in skipped)
