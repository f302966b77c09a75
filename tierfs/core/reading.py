"""Reading a rank's shard from a tier: verified, then copied once into where the caller wants it.

A :class:`Sink` says where a shard's entries go: new arrays (``restore``), the caller's arrays in place
(``restore_into``), or read-only views handed to a callback (``read_entries``, e.g. DCP's reader). Every
read checks the manifest against the marker and every block of the wanted entries against the manifest
before its bytes are used. :meth:`Reader.first_verified` is the one loop that tries tiers fastest first,
logs each one skipped and why, and goes on.

Nothing here is collective: any rank may read any rank's shard (the DCP reader reshards that way).
"""

from __future__ import annotations

import functools
import logging
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Sequence, TypeVar

import numpy as np

from .. import _copy, _hooks, _nogc, state as st
from .._stages import stage
from ..errors import ArgumentError, RestoreError, StateMismatchError, StepNotFoundError, TierfsError
from ..format import MARKER, Entry, Manifest, Marker
from ..protocol import checked_manifest, verify_shard
from ..tiers.base import Tier
from ..tiers.memory import MemoryTier
from .layout import DIRECT_MAX, ReadViews, describe
from .parts import Parts
from .sharing import by_bundle

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


class Sink:
    """Where a shard's entries go. ``wanted`` names the entries to read (None: all); a ``partial`` sink
    needs only the files holding them (a restore reads every file: they may re-seed peers)."""

    wanted: set[str] | None = None
    partial = False

    def __init__(self) -> None:
        self.values: dict[str, Any] = {}

    def json(self, e: Entry) -> None:
        self.values[e.name] = e.value

    def check(self, manifest: Manifest) -> None:
        """Before any bytes are read: raise StateMismatchError when the caller's target cannot take this
        shard (it is the caller's mistake, not a damaged copy)."""
        check_wanted(manifest, self.wanted)

    def direct(self, e: Entry) -> Any:
        """A tensor that takes ``e`` with one ``copy_`` after verification (see :class:`InPlace`), or None."""
        return None

    def land(self, e: Entry) -> np.ndarray | None:
        """A writable uint8 array of ``e``'s length that a peer's bytes of ``e`` may be received straight
        into (after :meth:`check`), or None. The entry's value is then in place once :meth:`took` is called."""
        return None

    def took(self, e: Entry) -> None:
        """``e``'s bytes landed, all verified, in the array :meth:`land` gave."""

    def elsewhere(self, manifest: Manifest, held: Mapping[str, int]) -> None:
        """A partial sink reading a shard whose tier lacks some of its files (see :class:`Views`)."""
        raise NotImplementedError

    def copy_direct(self, targets: list[Any], sources: list[Any]) -> None:
        """Copy each verified source (a typed view) into its target tensor (in :meth:`finish`)."""
        raise NotImplementedError

    def array(self, e: Entry, src: np.ndarray, tier: Tier | None, step: int) -> np.ndarray | None:
        """Where the verified bytes ``src`` of array entry ``e`` are copied (None: nowhere). ``tier`` is
        where they were read (None: received into this process, from a peer)."""
        raise NotImplementedError

    def finish(self) -> None:
        """After every copy: move values that could not be written in place."""

    def reset(self) -> None:
        """A source failed midway: forget what it delivered."""
        self.values.clear()


class NewArrays(Sink):
    """New arrays/tensors; with ``zero_copy``, read-only views of a zero-copy tier's files instead."""

    def __init__(self, zero_copy: bool = False) -> None:
        super().__init__()
        self.zero_copy = zero_copy
        self._landing: dict[str, Any] = {}

    def land(self, e: Entry) -> np.ndarray | None:
        if self.wanted is not None and e.name not in self.wanted:
            return None
        obj, raw = st.allocate(e.lib, e.dtype, e.shape)
        self._landing[e.name] = obj
        return raw

    def took(self, e: Entry) -> None:
        self.values[e.name] = self._landing[e.name]

    def array(self, e: Entry, src: np.ndarray, tier: Tier | None, step: int) -> np.ndarray | None:
        if self.zero_copy and tier is not None and tier.zero_copy:
            view = tier.export(step, e.file)[e.offset:e.offset + e.length]
            view.flags.writeable = False
            self.values[e.name] = st.view_as(e.lib, e.dtype, e.shape, view)
            return None
        obj, raw = st.allocate(e.lib, e.dtype, e.shape)
        self.values[e.name] = obj
        return raw


class InPlace(Sink):
    """The arrays/tensors of a nested state, overwritten in place (others are replaced).

    When every tensor of the target has exactly its entry's dtype and shape (the usual restore), the
    per-entry checks are skipped and small tensors are copied together after verification, from typed
    views of the tier's mapped files kept with the mapping (see :class:`~tierfs.core.layout.ReadViews`).
    """

    def __init__(self, state: Mapping[str, Any]) -> None:
        super().__init__()
        self.state = state
        with _nogc.paused():
            self.names, self.targets, self.structure = describe(state)
            self.index = {n: i for i, n in enumerate(self.names)}
        self.wanted = set(self.index)
        self._slots: dict[str, tuple[Any, Any]] | None = None
        self._after: list[Callable[[], Any]] = []
        self._fits = False
        self._direct: tuple[list[Any], list[Any]] = ([], [])

    @property
    def slots(self) -> dict[str, tuple[Any, Any]]:
        """Each leaf's (parent, key), for values replaced rather than written in place."""
        if self._slots is None:
            slots: dict[str, tuple[Any, Any]] = {}

            def walk(d: Any, prefix: str) -> None:
                for k, v in d.items():
                    if isinstance(v, Mapping):
                        walk(v, f"{prefix}{k}{st.SEP}")
                    else:
                        slots[f"{prefix}{k}"] = (d, k)
            walk(self.state, "")
            self._slots = slots
        return self._slots

    def check(self, manifest: Manifest) -> None:
        super().check(manifest)
        self._fits = ReadViews.of(manifest).fits(self.names, self.structure)
        if self._fits:
            return
        for e in manifest.entries:  # every array/tensor target must take its entry in place
            if e.kind == "array" and e.name in self.index:
                st.check_target(manifest.key(e.name), self.targets[self.index[e.name]], e.lib, e.dtype, e.shape)

    def direct(self, e: Entry) -> Any:
        """The target tensor ``e`` is copied into after verification, or None (copied block by block)."""
        if self._fits and e.length <= DIRECT_MAX and e.lib == "torch":
            return self.targets[self.index[e.name]]
        return None

    def land(self, e: Entry) -> np.ndarray | None:
        if e.name not in self.index:
            return None
        return st.target_view(e.name, self.targets[self.index[e.name]], e.lib, e.dtype, e.shape)

    def copy_direct(self, targets: list[Any], sources: list[Any]) -> None:
        self._direct[0].extend(targets)
        self._direct[1].extend(sources)

    def array(self, e: Entry, src: np.ndarray, tier: Tier | None, step: int) -> np.ndarray | None:
        target = self.targets[self.index[e.name]]
        raw = st.target_view(e.name, target, e.lib, e.dtype, e.shape)
        if raw is not None:
            return raw
        # a copy of the target's own kind (the checkpoint's may be the other library's), then into it
        if st.is_tensor(target):
            tmp, traw = st.allocate("torch", str(target.dtype).removeprefix("torch."), e.shape)
            self._after.append(lambda: target.copy_(tmp))
        elif isinstance(target, np.ndarray):
            tmp, traw = st.allocate("numpy", target.dtype.str, e.shape)
            self._after.append(lambda: np.copyto(target, tmp))
        else:
            tmp, traw = st.allocate(e.lib, e.dtype, e.shape)
            parent, key = self.slots[e.name]
            self._after.append(lambda: parent.__setitem__(key, tmp))
        return traw

    def finish(self) -> None:
        dst, src = self._direct
        if dst:
            torch = sys.modules["torch"]
            with torch.no_grad():
                torch._foreach_copy_(dst, src)
            self._direct = ([], [])
        for fn in self._after:
            fn()
        self._after.clear()
        for name, v in self.values.items():  # JSON values
            parent, key = self.slots[name]
            parent[key] = v

    def reset(self) -> None:
        super().reset()
        self._after.clear()
        self._direct = ([], [])


class Views(Sink):
    """``{name: (entry, value)}``: read-only views of the tier's bytes for arrays (valid while the tier's
    files are pinned), the value for JSON entries."""

    partial = True

    def __init__(self, wanted: Sequence[str] | None) -> None:
        super().__init__()
        self.wanted = None if wanted is None else set(wanted)
        self.away: dict[int, list[str]] = {}

    def json(self, e: Entry) -> None:
        self.values[e.name] = (e, e.value)

    def elsewhere(self, manifest: Manifest, held: Mapping[str, int]) -> None:
        """Wanted entries in files the tier does not hold for this rank go to :attr:`away` (by the rank whose
        shard holds them there) and are no longer wanted here."""
        assert self.wanted is not None
        for b, es in zip(manifest.bundles, by_bundle(manifest.entries, manifest.bundles)):
            for e in es:
                if e.name in self.wanted and e.file not in held:
                    self.away.setdefault(b["owner"], []).append(e.name)
                    self.wanted.discard(e.name)

    def array(self, e: Entry, src: np.ndarray, tier: Tier | None, step: int) -> np.ndarray | None:
        self.values[e.name] = (e, src)
        return None


def check_wanted(manifest: Manifest, wanted: set[str] | None) -> None:
    """A target with entries the checkpoint lacks is the caller's mistake, not a damaged copy."""
    missing = wanted - ReadViews.of(manifest).names if wanted is not None else set()
    if missing:
        keys = ", ".join(manifest.key(n) for n in sorted(missing)[:5]) + (", ..." if len(missing) > 5 else "")
        raise StateMismatchError(f"target state has entries the checkpoint lacks (step {manifest.step} rank "
                                 f"{manifest.rank}): {keys}; remove them from the target or restore another step")


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
