"""What the ranks' machinery (collectives, diagnosis, severing) needs of a group of the job's processes.

:class:`~tierfs.ranks.groups.TorchGroup` provides it; the modules that serve it take this protocol instead
of the class, so that imports among :mod:`tierfs.ranks` point one way: ``groups`` uses ``collectives``,
``diagnosis`` and ``severing``, and none of them uses ``groups``.
"""

from __future__ import annotations

from typing import Any, Callable, ContextManager, Protocol

from .waits import Operation


class Member(Protocol):
    """This process's place in a group of the job's processes over torch.distributed."""

    @property
    def rank(self) -> int:
        """This process's rank in the group."""

    @property
    def world_size(self) -> int:
        """The group's size."""

    @property
    def timeout(self) -> float:
        """Seconds every wait on the group may take."""

    @property
    def _dist(self) -> Any:
        """The ``torch.distributed`` module."""

    @property
    def _state(self) -> dict[str, str]:
        """Why this rank's connections on the group were closed (``"closed"``), a wait on it failed
        (``"failed"``), it was closed after a failure of the job's ranks (``"severed"``)."""

    @property
    def _lanes(self) -> list[Any]:
        """The torch.distributed groups that carry the group's transfers (empty once destroyed, and for a
        group whose collectives and transfers go over tierfs's streams: :mod:`tierfs.ranks.tree`)."""

    @property
    def _job(self) -> int:
        """The number every rank of the group shares (it names the group's keys in the job's store)."""

    @property
    def _calls(self) -> list[int]:
        """How many collectives ran on the group, in a list (the same number on every rank)."""

    @property
    def _gone(self) -> Callable[[int], bool] | None:
        """``gone(peer)``: whether a peer's process ended (:mod:`tierfs.ranks.liveness`), or None."""

    @property
    def _pg(self) -> Any:
        """The torch.distributed group of the collectives."""

    def bounded(self) -> ContextManager[Operation]:
        """Run a block as one operation: its waits share one deadline (:mod:`tierfs.ranks.waits`)."""
