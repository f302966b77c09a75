"""A restore over one plan that reads each step the way it was saved: the
:class:`~tierfs.CheckpointManager`'s (:meth:`TieredStore.restore_as_saved <tierfs.TieredStore.restore_as_saved>`).

The plan (:func:`~.plan.gather_plan`) is gathered once, and decides:

- which steps to try, newest first (:meth:`~.plan.RestorePlan.candidates`): those every rank can get, from
  its own tiers or from a peer's replica, so a replaced node, whose RAM holds nothing, counts the steps its
  peers keep for it;
- where each rank's shard comes from (:class:`~.pipeline.Restore`, given the plan);
- whether a step saved through DCP must first be brought into every rank's RAM
  (:meth:`~.plan.RestorePlan.not_in_ram`): DCP's reader reads tiers directly, and a replaced node's shard
  is only at its peers.

Then, newest first:

- a step the store saved is restored by the store, once: fetching a replaced node's shard from its peer
  (written into its RAM too when the caller reads the rank's own shard afterwards, ``loader``) and sending
  the node the replicas it kept for others;
- a step saved through DCP is read by the caller's reader (``read_dcp``), which restores through the same
  plan where the target's tensors are whole entries of the rank's own shard.

Besides the restore itself a normal restart costs the plan and one all-reduce (whether the step was saved
through DCP).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Mapping, Sequence

from ... import state as st
from ...errors import CheckpointLostError, RestoreError, RestoreIncompleteError, StepNotFoundError, TierfsError
from ...format import DCP_SHARD_KEY
from ...ranks.agree import any_rank
from ...tiers.base import AnyTier
from ...util.stages import operation
from ..context import Context
from ..reads import Reader
from .pipeline import Restore
from .plan import RestorePlan, gather_plan
from .sinks import InPlace, NewArrays, Sink
from .sources import RestoreInfo

log = logging.getLogger("tierfs")

#: restore into ``{entry: array}`` through the session's plan (a DCP step's tensors that are whole entries)
Into = Callable[[Mapping[str, Any]], RestoreInfo]
#: ``read_dcp(step, into)``: a DCP step read by the caller, ``(its result, what the restore did)``
ReadDcp = Callable[[int, Into], "tuple[Any, RestoreInfo]"]


class Unreadable(RestoreError):
    """No tier holds a verified copy of a step for some rank, said by ``read_dcp`` (``skipped``: why, as in
    :class:`RestoreInfo`): an older step is tried."""

    def __init__(self, skipped: list[tuple[str, int, str]]) -> None:
        super().__init__("; ".join(f"{t} step {s}: {w}" for t, s, w in skipped))
        self.skipped = skipped


class AsSaved:
    """The store's restores that read each step the way it was saved (made when the store opens):
    :meth:`run`. ``check()`` runs in the plan's gather (the store raises background failures there);
    ``noted(info)`` after each restore of a step (the store's figures)."""

    def __init__(self, ctx: Context, reader: Reader, check: Callable[[], None],
                 noted: Callable[[RestoreInfo], None]) -> None:
        self.ctx, self.reader, self.check, self.noted = ctx, reader, check, noted

    def run(self, tiers: Sequence[str], state: Mapping[str, Any] | None, step: int | None, loader: bool,
            read_dcp: ReadDcp) -> tuple[Any, RestoreInfo] | None:
        """Restore a step over one plan (collective).

        Parameters
        ----------
        tiers:
            The names of the tiers to read, in order.
        state:
            The target, loaded in place; None: into a new state.
        step:
            The step to restore; None: the newest every rank can get, older ones when no tier holds a
            verified copy of it.
        loader:
            Whether this rank reads its own shard after the restore (a data loader's state): the shard
            must then be in its tiers, not only at a peer.
        read_dcp:
            Reads a step saved through DCP: ``read_dcp(step, into)``.

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
        usable = self.ctx.usable(tiers)
        names = [t.name for t in usable]
        with operation("restore"):  # what a wait outside a stage says it waited in
            plan = gather_plan(self.ctx, usable, self.check)
        steps = plan.candidates(step, names)
        if not steps:
            return None
        skipped: list[tuple[str, int, str]] = []
        for s in steps:
            try:
                out, info = self._step(plan, usable, s, state, loader, read_dcp)
            except RestoreIncompleteError:
                raise  # ranks returned this step: none may move to an older one
            except Unreadable as e:
                skipped += e.skipped
                continue
            except RestoreError as e:
                skipped.append((",".join(names), s, str(e)))
                continue
            if step is None:  # the newer steps only some ranks can get, passed over, as the store's restore says
                skipped += [(",".join(names), x, why) for x, why in plan.passed_over(s)]
            info.skipped = skipped + [x for x in info.skipped if x not in skipped]
            return out, info
        reasons = "; ".join(f"{t} step {s}: {w}" for t, s, w in skipped)
        raise RestoreError(f"no tier holds a verified copy ({reasons})")

    def _step(self, plan: RestorePlan, usable: list[AnyTier], s: int, state: Mapping[str, Any] | None,
              loader: bool, read_dcp: ReadDcp) -> tuple[Any, RestoreInfo]:
        """Step ``s`` read the way it was saved."""
        if self._is_dcp(s, [t.name for t in usable]):
            if plan.not_in_ram(s):  # a replaced node's shard is only at its peers, out of the reader's reach
                self._localize(plan, usable, s)
            return read_dcp(s, lambda direct: self.restore(plan, usable, InPlace(direct), s))
        if state is None:
            sink = NewArrays(False, None)
            info = self.restore(plan, usable, sink, s)
            return st.unflatten(sink.values), info
        # the loader's state is read from this rank's shard after the restore: it must be in its tiers
        adopt = plan.only_at_peers(s) and any_rank(self.ctx.group, loader)
        return s, self.restore(plan, usable, InPlace(state), s, adopt)

    def restore(self, plan: RestorePlan, usable: list[AnyTier], sink: Sink | None, s: int, adopt: bool = False
                ) -> RestoreInfo:
        """Restore step ``s`` into ``sink`` (None: verify only) through ``plan`` (collective); ``adopt``:
        every rank's shard is in its first tier afterwards, which the plan then notes."""
        info = Restore(self.ctx, usable, sink).run(s, adopt, plan)
        first = self.ctx.first
        if adopt and first in self.ctx.roles(usable)[0]:  # the first tier counts as RAM here
            plan.localized(s, first.name, s in self.ctx.ledger.holding(first.name))
        self.noted(info)
        return info

    def _localize(self, plan: RestorePlan, usable: list[AnyTier], s: int) -> None:
        """Bring every rank's shard of ``s`` into its RAM (collective): a replaced node's from a peer, for
        readers that read tiers directly. Failing costs only speed: the readers try the tiers."""
        try:
            self.restore(plan, usable, None, s, adopt=True)
        except (RestoreIncompleteError, CheckpointLostError):
            raise  # the last restore did not finish on every rank, or steps were lost
        except (StepNotFoundError, RestoreError) as e:
            log.warning("step %d could not be brought into RAM from peers (%s); restoring from the tiers", s, e)

    def _is_dcp(self, s: int, names: list[str]) -> bool:
        """Whether step ``s`` was saved through DCP's writer (collective; every rank gets the same answer)."""
        g = self.ctx.group
        try:
            mine: bool | None = DCP_SHARD_KEY in self.reader.read_manifest(s, g.rank, names)[0].metadata
        except (TierfsError, OSError, ValueError, KeyError):
            mine = None  # e.g. a rank beyond the saving job's world size, or a replaced node
        return any_rank(g, mine is True)
