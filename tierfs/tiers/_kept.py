"""What the replicators that keep pieces of other ranks' shards in this node's RAM share: the directory they
keep them in (inside the RAM tier's, on its budget and its pool of spare buffers), its life as a tier's,
and their groups of the job's ranks, one set per thread role."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..util.fileio import make_private_dir
from ..util.worker import BACKGROUND_NICE
from ..errors import TierfsError
from .base import Capacity, Replicator, Tier
from .memory import MemoryTier


class Kept(MemoryTier):
    """The directory of copies this rank keeps; it shares the RAM tier's budget, and its pool of spare
    buffers (the buffers of this rank's step that retention frees when the next one commits take the next
    copy, and the copy's old buffers the next step; the pool keeps up to one spare set of each, as a save
    every step stages the next step while the last one's copies still arrive)."""

    #: copies are read only to be sent: their pages are mapped as the wire reads them, not all up front
    _populate_reads = False

    def __init__(self, path: Any, ram: MemoryTier, name: str) -> None:
        super().__init__(path, name=name)
        self._ram = ram
        self._pool, self._lock = ram._pool, ram._lock  # one pool, used under one lock

    def capacity(self) -> Capacity:
        return self._ram.capacity()  # counts this directory too: it lies inside the RAM tier's


class KeptInRam(Replicator):
    """A :class:`~tierfs.tiers.base.Replicator` whose copies are a :class:`Kept` directory beside the RAM
    tier (``<ram>/<folder>/rank_<r>``), exchanged over groups of its own. A subclass's ``bind`` calls
    :meth:`keep_beside`."""

    backend: str
    connections: int
    _local: Kept | None = None

    def keep_beside(self, first: Tier, group: Any, folder: str) -> None:
        """Keep the copies in ``first``'s directory (a MemoryTier), and make the groups (collective)."""
        if not isinstance(first, MemoryTier):
            raise TierfsError(f"{type(self).__name__} keeps its copies in the RAM tier: put a MemoryTier first, "
                              f"e.g. TieredStore([MemoryTier(path), {type(self).__name__}(), ObjectTier(url)])")
        self._local = Kept(first.path / folder / f"rank_{group.rank:05d}", first, self.name)
        # one set of groups per thread role, made (or taken from the process's pool) now, never on a save's
        # or a restore's path. "copy": copies run in a background worker, its transfer threads give way to
        # training too; "main": restores (a node's loss, re-seeding peers). Over tierfs's streams a role's
        # group holds no gloo group (its collectives go over the streams too) and costs nothing idle; only
        # where bulk bytes go over gloo is a role `connections` gloo groups, each with its threads (an I/O
        # loop that wakes every 10 ms: 1-2.5 ms of CPU a second) and a listening socket (TorchGroup.fork)
        self._groups = {"copy": group.fork(self.backend, nice=BACKGROUND_NICE, lanes=self.connections),
                        "main": group.fork(self.backend, lanes=self.connections)}

    def _group(self, role: str) -> Any:
        """The groups of a thread role: "copy" (the background worker) or "main" (restores)."""
        if role not in ("copy", "main"):
            raise ValueError(f"unknown role {role!r}: 'copy' or 'main'")
        groups = getattr(self, "_groups", None)
        if groups is None:
            raise TierfsError(f"{type(self).__name__} is used only through a TieredStore, which binds it to the "
                              "job's ranks")
        return groups[role]

    def transfer_group(self) -> Any:
        """The restore's group (``connections`` lanes where bulk bytes go over gloo): its bulk transfers too."""
        return self._group("main")

    @property
    def local(self) -> MemoryTier:
        """The copies this rank keeps, as a RAM tier of their own (inside the RAM tier's directory)."""
        if self._local is None:
            raise TierfsError(f"{type(self).__name__} is used only through a TieredStore, which binds it to the "
                              "RAM tier")
        return self._local

    @property
    def location(self) -> str:
        return self.local.location if self._local is not None else "(not bound)"

    def local_dirs(self) -> list[Path]:
        """The copies' directory, inside the RAM tier's (none before ``bind``)."""
        return [self._local.path] if self._local is not None else []

    def live_users(self) -> list[int]:
        return self._local.live_users() if self._local is not None else []

    def capacity(self) -> Capacity:
        return self.local.capacity()

    def open(self) -> None:
        make_private_dir(self.local.path.parent)
        self.local.open()

    def close(self) -> None:
        if self._local is not None:
            self._local.close()

    def list_steps(self) -> dict[int, bool]:
        return self.local.list_steps()

    def delete_step(self, step: int) -> None:
        self.local.delete_step(step)
