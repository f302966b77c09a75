"""Sinks: where a shard's entries go once verified, and the shard as a source delivers it.

New arrays (``restore``), the caller's arrays in place (``restore_into``), or read-only views handed to a
callback (``read_entries``, e.g. DCP's reader). :func:`~tierfs.core.restore.fill.fill` checks every block
of a :class:`Shard`'s wanted entries against its manifest and copies them into the sink once. A sink also
offers its arrays as the places a peer's large entries are received into (``Landing``, :meth:`Sink.land`): their bytes go
from the wire straight into the target, checked block by block as they land, with no receive buffer and no
copy after; the shard records them as ``landed`` and :func:`~tierfs.core.restore.fill.fill` leaves them be.
"""

from __future__ import annotations

import sys
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from ... import state as st
from ...format import blockio as _blocks
from ...util import nogc as _nogc
from ...errors import DeviceError, StateMismatchError
from ...format import Entry, Manifest
from ...tiers.base import Tier
from ...tiers.capabilities import ZeroCopy
from ..layout import DIRECT_MAX, ReadViews, describe, key_name
from ..dataparallel import by_bundle


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
        raw = {n: _blocks.as_u8(f) for n, f in self.files.items()}
        for e in self.manifest.entries:
            v = self.landed.get(e.name)
            if v is not None:
                raw[e.file][e.offset:e.offset + e.length] = v
        return Shard(self.manifest, self.mbytes, self.marker, self.files)


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

    def device_target(self, e: Entry) -> Any:
        """A contiguous CUDA tensor that takes ``e``'s bytes block by block as they are verified, or None."""
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
    """New arrays/tensors; with ``zero_copy``, read-only views of a zero-copy tier's files instead: a write
    raises (numpy's ValueError, a TierfsError for torch) and never reaches the tier's file (the views map
    it copy-on-write), and the tier never reuses the file while a view lives (:meth:`Tier.export`)."""

    def __init__(self, zero_copy: bool = False, device: Any = None) -> None:
        super().__init__()
        self.zero_copy = zero_copy
        self.device = device  # a CUDA torch.device new tensors are made on, or None
        self._landing: dict[str, Any] = {}
        self._manifest: Manifest | None = None

    def device_target(self, e: Entry) -> Any:
        if self.device is None or e.lib != "torch" or (self.wanted is not None and e.name not in self.wanted):
            return None
        torch = sys.modules["torch"]
        try:
            t = self.values[e.name] = torch.empty(tuple(e.shape), dtype=getattr(torch, e.dtype), device=self.device)
        except torch.OutOfMemoryError:
            key = self._manifest.key(e.name) if self._manifest is not None else repr(e.name)
            raise DeviceError(f"{key} ({e.length} bytes) does not fit in the free memory of {self.device}: free "
                              "device memory, or restore to device='cpu' and move what fits") from None
        return t

    def check(self, manifest: Manifest) -> None:
        super().check(manifest)
        self._manifest = manifest  # (messages name the user's keys)

    def land(self, e: Entry) -> np.ndarray | None:
        if (self.wanted is not None and e.name not in self.wanted) or (self.device is not None and e.lib == "torch"):
            return None
        obj, raw = st.allocate(e.lib, e.dtype, e.shape)
        self._landing[e.name] = obj
        return raw

    def took(self, e: Entry) -> None:
        self.values[e.name] = self._landing[e.name]

    def array(self, e: Entry, src: np.ndarray, tier: Tier | None, step: int) -> np.ndarray | None:
        if self.zero_copy and isinstance(tier, ZeroCopy):
            view = tier.export(step, e.file)[e.offset:e.offset + e.length]
            key = self._manifest.key(e.name) if self._manifest is not None else repr(e.name)
            self.values[e.name] = st.read_only_view(e.lib, e.dtype, e.shape, view, f"{key} (step {step})")
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
        self._empty = _empty_mappings(state)  # (a fresh optimizer's state: {})

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
            try:
                walk(self.state, "")
            finally:
                del walk  # (it refers to itself: a cycle holding the caller's state until the collector runs)
            self._slots = slots
        return self._slots

    def check(self, manifest: Manifest) -> None:
        super().check(manifest)
        _check_kinds(manifest, self.index, self.targets, self._empty)
        views = ReadViews.of(manifest)
        self._fits = _expects_all(views) and views.fits(self.names, self.structure)
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

    def device_target(self, e: Entry) -> Any:
        i = self.index.get(e.name)
        if i is None:
            return None
        t = self.targets[i]
        if not (st.is_tensor(t) and t.device.type == "cuda" and t.is_contiguous()):
            return None
        st.check_target(repr(e.name), t, e.lib, e.dtype, e.shape)
        return t

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
            i = self.index.get(name)
            if i is not None and _scalar_into(self.targets[i], v):
                continue  # a number into the target's one element (a module's buffer stays the same tensor)
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


_complete: "weakref.WeakKeyDictionary[ReadViews, bool]" = weakref.WeakKeyDictionary()


def _expects_all(views: ReadViews) -> bool:
    """Whether ``views`` knows the exact type every array entry needs (not a torch entry's when the views
    were made before torch was imported): only then may a target that :meth:`ReadViews.fits` skip the
    per-entry checks (a torch target of another dtype is an error, as a numpy one is, not a conversion)."""
    got = _complete.get(views)
    if got is None:
        got = _complete[views] = all(e.name in views.expected for e in views.manifest.entries if e.kind == "array")
    return got


def check_wanted(manifest: Manifest, wanted: set[str] | None) -> None:
    """A target with entries the checkpoint lacks is the caller's mistake, not a damaged copy."""
    missing = wanted - ReadViews.of(manifest).names if wanted is not None else set()
    if missing:
        keys = ", ".join(manifest.key(n) for n in sorted(missing)[:5]) + (", ..." if len(missing) > 5 else "")
        raise StateMismatchError(f"target state has entries the checkpoint lacks (step {manifest.step} rank "
                                 f"{manifest.rank}): {keys}; remove them from the target or restore another step")


def _empty_mappings(state: Mapping[str, Any], prefix: str = "") -> list[str]:
    """The names of the empty mappings in a target (which :func:`describe` sees no leaves of)."""
    out: list[str] = []
    for k, v in state.items():
        if isinstance(v, Mapping):
            name = prefix + key_name(k, prefix)
            out += _empty_mappings(v, name + st.SEP) if v else [name]
    return out


def _check_kinds(manifest: Manifest, index: Mapping[str, int], targets: Sequence[Any], empty: list[str]) -> None:
    """A target that would silently miss what the checkpoint holds is the caller's mistake: an empty mapping
    where the checkpoint has entries (a fresh optimizer's state), or a tensor or array where it holds a
    plain value (replaced in the mapping, the tensor itself, a module's buffer say, would keep its value)."""
    for e in manifest.entries:
        if e.kind == "json" and e.name in index and (st.is_tensor(t := targets[index[e.name]])
                                                     or isinstance(t, np.ndarray)) and not _one_number(t, e.value):
            raise StateMismatchError(
                f"{manifest.key(e.name)}: step {manifest.step} holds a plain value ({type(e.value).__name__} "
                f"{str(e.value)[:40]}) where the target has a {type(t).__name__} of {_count(t)} elements; put a "
                "plain value (or none) there, or restore() the step into new values")
    for p in empty:
        under = [e.name for e in manifest.entries if e.name.startswith(p + st.SEP)]
        if under:
            raise empty_target(manifest.key(p), manifest.step, len(under), manifest.key(under[0]))


def empty_target(key: str, step: int, n: int, example: str) -> StateMismatchError:
    """The error of a target whose ``key`` is an empty mapping where ``step`` holds ``n`` entries (a fresh
    optimizer's state), as both restore paths (plain and through DCP) say it."""
    return StateMismatchError(
        f"target state {key} is empty but step {step} holds {n} entries under it (e.g. {example}): an "
        "optimizer's state is empty until its first step; make it first (one optimizer step, or "
        "torch.distributed.checkpoint.state_dict.get_state_dict), leave it out of the target to restore "
        "without it, or restore the step into new values")


def _count(t: Any) -> int:
    return int(t.numel()) if st.is_tensor(t) else int(t.size)


def _one_number(t: Any, value: Any) -> bool:
    """Whether a plain ``value`` goes into target ``t`` in place: a number (a numpy scalar saved as one, an
    int step counter) into a tensor or array of one element."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and _count(t) == 1


def _scalar_into(t: Any, value: Any) -> bool:
    """Write ``value`` into ``t`` in place when :func:`_one_number` says it goes there; whether it did."""
    if not (st.is_tensor(t) or isinstance(t, np.ndarray)) or not _one_number(t, value):
        return False
    if st.is_tensor(t):
        torch = sys.modules["torch"]
        with torch.no_grad():
            t.fill_(value)
    else:
        t.flat[0] = value
    return True
