"""The interfaces of tiers.

:class:`Tier` is what every tier that holds files implements (the RAM tier, the object tier, a third
party's): it stores steps in the on-tier format (`tierfs.format`) and knows nothing of the store, of
other tiers, or of when to save: policies decide that. Paths a tier takes are always ``(step, file
name)`` pairs; file names are validated so nothing outside the tier's root is ever touched. Subclasses
implement the abstract primitives; ``write_files``/``read_files`` (bulk, may run concurrently) have
defaults built on them. What only some tiers do (staging saves into buffers they own, a directory ranks
of a node share, local files, zero-copy views) is a capability (:mod:`.capabilities`), asked for as such.
``tierfs.testing.TierTests`` is the suite every tier passes, with one more per capability.

:class:`Replicator` is the other role a tier can have: it keeps copies of *other* ranks' shards, moved
between ranks in exchanges every rank joins (the peer tier). The store holds at most one, after the RAM
tier, and saves to it with ``replicate`` and restores from it with ``fetch``.

:class:`AnyTier` is what the store's bookkeeping, listing and retention use of both.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Protocol, Sequence, Union, runtime_checkable

import numpy as np

from ..util import args as _args
from ..format.blockio import as_u8
from ..format import MARKER, Manifest, Marker
from ..policies import FixedIntervalPolicy, PreservationPolicy, SavePolicy

#: ``pace(nbytes)``: called before bytes move (a bandwidth throttle)
Pace = Callable[[int], None]
#: file contents as tiers take and give them: any contiguous bytes-like object (a tier's read may be a
#: read-only view of its storage)
Bytes = Union[bytes, bytearray, memoryview, "np.ndarray[Any, Any]"]

log = logging.getLogger("tierfs")


def _holder_args(cls: str, name: Any, save: Any, keep: Any) -> tuple[str, SavePolicy, PreservationPolicy]:
    """A tier's name and policies, checked (``cls``: the tier's class, as messages name it)."""
    _args.name(name, f"{cls} name")
    if save is not None:
        _args.instance(save, f"{cls} save", SavePolicy, "a save policy such as FixedIntervalPolicy(10)")
    _args.instance(keep, f"{cls} keep", PreservationPolicy, "a keep policy such as LatestN(2)")
    return name, save if save is not None else FixedIntervalPolicy(1), keep


@dataclass(frozen=True)
class Capacity:
    """Space on a tier, in bytes. ``budget``/``free`` are None when unknown or unlimited."""

    used: int
    budget: int | None
    free: int | None

    @property
    def available(self) -> int | None:
        """Bytes a save may still add: the smaller of budget headroom and free space."""
        left = [x for x in ((self.budget - self.used) if self.budget is not None else None, self.free)
                if x is not None]
        return min(left) if left else None


class Tier(ABC):
    """A place that holds checkpoint steps.

    Parameters
    ----------
    name:
        Label used in ``store.steps()``, logs and restore info.
    save:
        Which steps this tier takes (default: every step).
    keep:
        Which of its committed steps it keeps (see subclasses for defaults).
    """

    #: short kind name, e.g. "memory" or "object"
    kind: str = "tier"

    def __init__(self, name: str, save: SavePolicy | None, keep: PreservationPolicy) -> None:
        self.name, self.save_policy, self.keep_policy = _holder_args(type(self).__name__, name, save, keep)

    # -- capabilities -------------------------------------------------------------------------------
    @property
    def is_local(self) -> bool:
        """True when each node has its own copy (e.g. tmpfs); False when all ranks share one store."""
        return False

    def file_path(self, step: int, name: str) -> Path | None:
        """Where another process of this node opens file ``name`` of ``step`` (a helper process reads the
        first tier's files so); None where it cannot (the default)."""
        return None

    def recipe(self) -> dict[str, Any] | None:
        """Keyword arguments that build this tier again in another process (a helper process's uploads);
        None where it cannot be built so (the default)."""
        return None

    @property
    def location(self) -> str:
        """Where the tier keeps its steps, for people (a directory or a URL)."""
        return self.name

    @abstractmethod
    def capacity(self) -> Capacity: ...

    # -- primitives ---------------------------------------------------------------------------------
    def open(self) -> None:
        """Check the tier is reachable and create its root; raise TierUnavailableError if not."""

    def check_readable(self) -> None:
        """Raise TierUnavailableError unless the tier can be read; create and change nothing (for tools
        that only look, such as ``tierfs ls``). Default: ``open()``."""
        self.open()

    def close(self) -> None:
        """Release mappings, connections and threads."""

    @abstractmethod
    def list_steps(self) -> dict[int, bool]:
        """Every step directory on the tier, mapped to whether it is committed."""

    @abstractmethod
    def file_sizes(self, step: int) -> dict[str, int]:
        """Name → length of every file of a step (marker included if present)."""

    def sizes_of(self, step: int, names: Iterable[str]) -> dict[str, int]:
        """Name → length of those of ``names`` that ``step`` holds. A shared tier asks for each file, so
        that a rank confirming its own files never lists the other ranks' (the default lists the step)."""
        wanted = set(names)
        return {n: size for n, size in self.file_sizes(step).items() if n in wanted} if wanted else {}

    @abstractmethod
    def write_file(self, step: int, name: str, data: Bytes) -> None: ...

    @abstractmethod
    def read_file(self, step: int, name: str) -> Bytes:
        """The whole file as a 1-D uint8 array (a view of the stored bytes on a ZeroCopy tier) or bytes."""

    @abstractmethod
    def write_marker(self, step: int, data: bytes) -> None:
        """Write the commit marker; on local filesystems atomically (temporary name, then rename)."""

    @abstractmethod
    def delete_step(self, step: int) -> None:
        """Remove a step, marker first, so a half-deleted step never looks committed."""

    # -- derived operations -------------------------------------------------------------------------
    def committed_steps(self) -> list[int]:
        return sorted(s for s, ok in self.list_steps().items() if ok)

    def read_range(self, step: int, name: str, start: int, end: int) -> bytes:
        """Bytes ``start:end`` of a file (default: cut from ``read_file``)."""
        return as_u8(self.read_file(step, name))[start:end].tobytes()

    def last_written(self, step: int) -> float | None:
        """When the newest file of ``step`` was written (seconds since the epoch), or None if unknown."""
        return None

    def read_marker(self, step: int) -> Marker:
        return Marker.from_bytes(bytes(self.read_file(step, MARKER)))

    def note_marker(self, step: int, marker: Marker) -> None:
        """``step``'s marker, as a caller read it: a tier whose keys depend on a step's format version (the
        object tier, :mod:`tierfs.format.keys`) learns it here instead of reading the marker again.
        Default: nothing."""

    def write_files(self, step: int, files: Mapping[str, Bytes], pace: Pace | None = None) -> None:
        """Write several files; ``pace(nbytes)`` is called before each (a bandwidth throttle)."""
        for name, data in files.items():
            if pace is not None:
                pace(as_u8(data).nbytes)
            self.write_file(step, name, data)

    def read_files(self, step: int, names: list[str]) -> dict[str, Bytes]:
        return {n: self.read_file(step, n) for n in names}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


@runtime_checkable
class AnyTier(Protocol):
    """What the store's bookkeeping, listing and retention use of every tier, whatever its role."""

    name: str
    save_policy: SavePolicy
    keep_policy: PreservationPolicy

    def open(self) -> None: ...

    def close(self) -> None: ...

    def capacity(self) -> Capacity: ...

    def list_steps(self) -> dict[int, bool]: ...

    def committed_steps(self) -> list[int]: ...

    def delete_step(self, step: int) -> None: ...


#: a shard as ``fetch`` returns it to its receiver: manifest, manifest bytes, marker bytes, files
Fetched = tuple[Manifest, bytes, bytes, dict[str, np.ndarray]]
#: ``landing(manifest) -> {entry name: uint8 array of its length}``: where a receiver wants entries to land
ReceiveInto = Callable[[Manifest], Mapping[str, np.ndarray]]
#: ``(source rank, receiving rank, reason)`` of a copy that failed
FailedCopy = tuple[int, int, str]


class Replicator(ABC):
    """A tier that keeps copies of other ranks' shards, moved between ranks in exchanges every rank of the
    job joins (collective). The store binds it when it opens, saves to it with :meth:`replicate` once a
    step is committed in the first tier, lists what it holds with :meth:`holdings`, restores a rank's
    lost shard with :meth:`fetch` and, after a restore, gives replaced ranks their copies back.

    Its own storage (the copies it keeps) is listed, deleted and retained like a tier's (:class:`AnyTier`).
    """

    kind: str = "replicator"
    #: for every rank, the ranks that keep copies of its shard (set by ``bind``)
    targets: list[list[int]]
    #: the node (machine) of every rank, as the replicator places copies (set by ``bind``)
    nodes: list[int]

    def __init__(self, name: str, save: SavePolicy | None, keep: PreservationPolicy) -> None:
        self.name, self.save_policy, self.keep_policy = _holder_args(type(self).__name__, name, save, keep)

    @property
    def location(self) -> str:
        return self.name

    @abstractmethod
    def bind(self, first: Tier, group: Any) -> None:
        """Keep copies beside ``first`` (the store's first tier) and exchange them among ``group``'s ranks
        (collective, when the store opens)."""

    @abstractmethod
    def holdings(self) -> dict[int, list[int]]:
        """``{step: [ranks whose shard this rank keeps]}`` for every committed step."""

    @abstractmethod
    def replicate(self, step: int, marker: bytes, manifest: bytes, files: Mapping[str, Any], *,
                  pairs: Sequence[tuple[int, int]] | None = None, pace: Pace | None = None,
                  role: str = "copy", error: str | None = None) -> list[FailedCopy]:
        """Send this rank's shard of ``step`` to its targets and keep the shards sent to it (collective).

        ``pairs`` are ``(source rank, receiving rank)``, the same on every rank (default: every rank to
        each of its targets). A rank that cannot read its own shard passes ``error`` and still takes
        part. ``role`` is the thread role ("copy": the store's background worker; "main": a restore).
        Returns the failed pairs, the same on every rank; when there are none every copy is committed.
        """

    @abstractmethod
    def fetch(self, step: int, assign: Mapping[int, int], role: str = "main",
              landing: ReceiveInto | None = None) -> Fetched | str | None:
        """Move shards of ``step`` from holders to the ranks that lack them (collective); ``assign`` is
        ``{rank: holder}``, the same on every rank. ``landing`` (the receiver's, optional) names arrays
        that entries go straight into: every entry it names in the returned files lands there, and its
        bytes in those files are undefined. Returns, on a receiving rank, the shard (every block
        checked as it landed) or the reason it failed; None on other ranks."""

    def rebuildable(self, holders: dict[tuple[int, int], list[int]], fast: Sequence[set[int]],
                    notes: dict[int, str]) -> dict[tuple[int, int], list[int]]:
        """A restore's ``holders`` (``{(step, rank): [ranks keeping a copy of its shard]}``, the same on every
        rank) without the shards this replicator cannot give back, given the steps each rank holds in the
        tiers before it (``fast``); ``notes[step]`` says why, for the error should no step be left. A
        replicator whose copies stand alone (a replica) gives them all."""
        return holders

    def drop(self, step: int, rank: int) -> None:
        """Stop offering the copy of ``rank``'s shard of ``step`` kept here: its receiver could not use it,
        and a later restore must not pick it again."""

    def transfer_group(self) -> Any:
        """A group of its own for a restore's other bulk transfers between ranks (collective on first
        use), or None: the store's."""
        return None

    # -- its own storage, as a tier's ---------------------------------------------------------------
    def open(self) -> None:
        """Create its storage (after ``bind``)."""

    def close(self) -> None:
        """Release its storage."""

    @abstractmethod
    def capacity(self) -> Capacity: ...

    @abstractmethod
    def list_steps(self) -> dict[int, bool]:
        """Every step it keeps copies of, mapped to whether they are committed."""

    def committed_steps(self) -> list[int]:
        return sorted(s for s, ok in self.list_steps().items() if ok)

    @abstractmethod
    def delete_step(self, step: int) -> None:
        """Drop every copy of ``step`` this rank keeps."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"
