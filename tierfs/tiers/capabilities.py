"""What only some tiers do, as capabilities the store asks for (``isinstance(tier, Staging)``), never by
the tier's class.

- :class:`Staging`: the tier hands out the buffers a save is copied into and persists them (the RAM tier:
  mapped files reused from step to step). A first tier without it is staged through :class:`HeapStaging`
  (buffers of process memory, written with ``write_files``); :func:`staging` picks one.
- :class:`SharedDirectory`: ranks of one node may use the same storage (the RAM tier's directory): the
  store observes which do (``identity``), each deletes only its own files (``release``), and one job at a
  time uses it (``lock_on_open``).
- :class:`LocalFiles`: the tier keeps files in directories of this machine (the RAM tier, the peer tier's
  replicas, a ``file://`` object tier): what it creates when it opens, and who else is using them.
- :class:`ZeroCopy`: reads are views of the stored bytes; ``export`` hands one to the user, read-only.
- :class:`FileDeletes`: a shared tier (the object tier) on which retention spreads a step's deletion over
  the ranks: the owner deletes the marker, then each rank its own files, so what one rank asks of the
  storage does not grow with the job.

``tierfs.testing`` has a conformance suite per capability, beside ``TierTests``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Mapping, Protocol, runtime_checkable

import numpy as np

from ..util import readable as _readable
from ..errors import CapacityError
from ..format import validate_filename
from .base import Tier


@runtime_checkable
class Staging(Protocol):
    """A tier that owns the buffers a save is copied into."""

    def buffers(self, step: int, sizes: Mapping[str, int]) -> dict[str, np.ndarray]:
        """Writable 1-D uint8 buffers, one per file, that :meth:`persist` writes under their names. Fails
        (CapacityError) before anything is written when the files would not fit."""

    def buffer_memo(self, step: int, name: str) -> dict[Any, Any] | None:
        """A dict that lives as long as the buffer ``buffers`` gave for file ``name`` of ``step``, where the
        store keeps what it works out about that buffer (typed views of it) for later saves into the same
        buffer; None where buffers are not reused."""

    def persist(self, step: int) -> None:
        """Persist the staged buffers of ``step`` under their names."""

    def discard(self, step: int) -> None:
        """Forget the staged buffers of ``step`` (a save that failed), leaving no file behind."""

    def prepare(self, step: int, sizes: Mapping[str, int], held: bool = False) -> None:
        """Get ready, off the critical path, for the save after ``step``, whose files will likely have these
        sizes; ``held``: a step the keep policy lets go is still being read or copied (an upload), so its
        buffers will not come back for the next saves."""

    def drop_spares(self) -> None:
        """Give back the buffers kept for saves that will not come (the process is exiting)."""


@runtime_checkable
class SharedDirectory(Protocol):
    """A node-local tier whose storage several ranks of a node may share, one job at a time."""

    #: take the job's lock on the storage when the tier opens (a store that saves): a second job fails then
    lock_on_open: bool

    def identity(self) -> list[Any]:
        """After ``open``: a JSON value equal on two ranks exactly when they use the same storage (the RAM
        tier: host, device and inode of its root)."""

    def release(self, step: int, rank: int, marker: bool) -> None:
        """Delete ``rank``'s files of ``step`` (and the marker if ``marker``): each rank of a node takes back
        its own files; the last one out removes the step."""


@runtime_checkable
class FileDeletes(Protocol):
    """A shared tier whose files of a step can be deleted a few at a time, by the ranks that wrote them."""

    def delete_files(self, step: int, names: Iterable[str]) -> None:
        """Delete these files of ``step`` (one missing is no error), in as few requests as the storage
        allows (one batch on S3 and GCS)."""

    def remove_if_empty(self, step: int) -> None:
        """Remove ``step``'s directory if no file is left in it (stores that keep emptied directories);
        nothing otherwise, and no error."""


@runtime_checkable
class SharedStore(Protocol):
    """A tier every rank of a job reaches at one place, whose reachability one rank checks for all."""

    #: ask the store, when the tier opens, whether it is there and the credentials work (default True; a
    #: store opening the tier on every rank of a job sets it on one rank only, whose failure fails them all)
    probe_on_open: bool


@runtime_checkable
class LocalFiles(Protocol):
    """A tier that keeps its files in directories of this machine."""

    def local_dirs(self) -> list[Path]:
        """The directories the tier creates when it opens (a constructor that fails removes those it made)."""

    def live_users(self) -> list[int]:
        """Live processes other than this one that are using the tier's files (a running job)."""


@runtime_checkable
class ZeroCopy(Protocol):
    """A tier whose reads are views of the stored bytes."""

    def export(self, step: int, name: str) -> np.ndarray:
        """A view of file ``name`` of ``step`` handed to the user: writes never reach the file, and the file
        is not reused while the view lives."""

    def view(self, step: int, name: str) -> np.ndarray:
        """A read-only view of the file whose pages are mapped as they are read (for sending it on)."""


class HeapStaging:
    """:class:`Staging` for a tier that has none: buffers of process memory, persisted with ``write_files``."""

    def __init__(self, tier: Tier) -> None:
        self.tier = tier
        self._staged: dict[int, dict[str, np.ndarray]] = {}

    def buffers(self, step: int, sizes: Mapping[str, int]) -> dict[str, np.ndarray]:
        nbytes, avail = sum(sizes.values()), self.tier.capacity().available
        if avail is not None and nbytes > avail:
            raise CapacityError(
                f"tier {self.tier.name!r}: saving {_readable.size(nbytes)} would exceed its space "
                f"({_readable.size(avail)} left); raise the budget, free space or keep fewer steps")
        bufs = {validate_filename(n): np.empty(s, dtype=np.uint8) for n, s in sizes.items()}
        self._staged[step] = bufs
        return bufs

    def buffer_memo(self, step: int, name: str) -> dict[Any, Any] | None:
        return None

    def persist(self, step: int) -> None:
        bufs = self._staged.pop(step, None)
        if bufs:
            self.tier.write_files(step, bufs)

    def discard(self, step: int) -> None:
        self._staged.pop(step, None)

    def prepare(self, step: int, sizes: Mapping[str, int], held: bool = False) -> None:
        pass

    def drop_spares(self) -> None:
        pass


def staging(tier: Tier) -> Staging:
    """How a save is staged into ``tier``: the tier itself when it has :class:`Staging`, else
    :class:`HeapStaging`."""
    return tier if isinstance(tier, Staging) else HeapStaging(tier)
