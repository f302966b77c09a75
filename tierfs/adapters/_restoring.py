"""How :meth:`CheckpointManager.restore <tierfs.CheckpointManager.restore>` restores a step: the store's
restore, once, each step read the way it was saved (:meth:`TieredStore.restore_as_saved
<tierfs.TieredStore.restore_as_saved>`, :mod:`tierfs.core.restore.session`).

The store gathers the plan once: the steps every rank can get (a replaced node, whose RAM holds nothing,
counts the steps its peers keep for it), where each rank's shard comes from, and whether a step saved
through DCP must first be brought into every rank's RAM. A step saved through DCP is read here, by DCP's
reader (:func:`tierfs.adapters.dcp.managed.restore`), through the same plan.
"""

from __future__ import annotations

from typing import Any, Mapping

from ..core.restore.session import Into, Unreadable
from ..store import RestoreInfo, TieredStore
from . import _torchstate as ts


def restore(store: TieredStore, state: Any, step: int | None, tiers: list[str], loader: bool
            ) -> tuple[Any, RestoreInfo] | None:
    """Restore ``step`` (default: the newest every rank can get, else older ones) over ``tiers``
    (collective).

    Parameters
    ----------
    store:
        The manager's store.
    state:
        The target, loaded in place; None: into a new state.
    step:
        The step to restore; None: the newest one every rank can get, older ones when no tier holds a
        verified copy of it.
    tiers:
        The tiers to read, in order.
    loader:
        Whether this rank restores a data loader's state (read from its own shard after the restore).

    Returns
    -------
    tuple or None
        ``(step or the new state, what the restore did)``; None when no rank holds a step.

    Raises
    ------
    CheckpointLostError
        Ranks hold steps, none of which every rank can get.
    StepNotFoundError
        ``step`` is not one every rank can get.
    RestoreError
        No tier holds a verified copy of any step tried.
    """
    read_dcp = DcpStep(store, state, tiers)  # a step saved through DCP: read by DCP's reader, here
    return store.restore_as_saved(state, step, tiers, loader=loader, read_dcp=read_dcp)


class DcpStep:
    """``read_dcp`` of :meth:`TieredStore.restore_as_saved`: a step saved through DCP read by DCP's reader
    into ``state`` (None: a new state), over ``tiers``."""

    def __init__(self, store: TieredStore, state: Mapping[str, Any] | None, tiers: list[str]) -> None:
        self.store, self.state, self.tiers = store, state, tiers

    def __call__(self, step: int, into: Into) -> tuple[Any, RestoreInfo]:
        from .dcp import managed

        try:
            return managed.restore(self.store, self.state, step, self.tiers, into)
        except ts.Unusable as e:  # an older step is tried
            raise Unreadable(e.skipped) from None
