"""The part of :class:`~tierfs.TieredStore`'s interface that restores (collective): into new arrays, in
place, into the first tier (``localize``), and the plan a restore chooses from. The restore itself is
:mod:`tierfs.core.restore`; the manager's restore, each step read the way it was saved, is
:meth:`TieredStore.restore_as_saved <tierfs.TieredStore.restore_as_saved>`."""

from __future__ import annotations

import datetime
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from .. import metrics as _metrics, state as st
from ..device.upload import restore_device
from ..errors import ArgumentError
from ..ranks import seconds
from ..util import args as _args
from .calls import Calls, serial
from .context import Context
from .reads import Reader
from .restore.pipeline import Restore, RestoreInfo
from .restore.plan import RestorePlan, gather_plan
from .restore.sinks import InPlace, NewArrays


class Restores:
    """Restores (a base of :class:`~tierfs.TieredStore`)."""

    _ctx: Context
    _reader: Reader
    _calls: Calls

    if TYPE_CHECKING:  # the store's: it is open and the last restore done; Upkeep's
        def _check_open(self) -> None: ...

        def raise_background_errors(self) -> None: ...

    def restore(self, step: int | None = None, *, tiers: Sequence[str] | None = None, zero_copy: bool = False,
                timeout: float | datetime.timedelta | None = None,
                device: Any = None) -> tuple[dict[str, Any], RestoreInfo]:
        """Read a step (default: the newest) into new arrays/tensors; returns ``(state, info)``.

        With ``zero_copy=True`` arrays served by the RAM tier are read-only views of its files.
        ``timeout`` bounds this restore's waits on the other ranks instead of the store's (transfers from
        peers keep the store's). ``device`` (e.g. ``"cuda:0"``): torch tensors are made there, each block
        copied from the verified RAM tier's pages as the next is verified (numpy arrays stay on the host).
        """
        sink = NewArrays(zero_copy, restore_device(device, zero_copy))
        info = self._restore(step, tiers, sink, timeout, lambda: _args.flag(zero_copy, "zero_copy"))
        return st.unflatten(sink.values), info

    def restore_into(self, state: Mapping[str, Any], step: int | None = None, *,
                     tiers: Sequence[str] | None = None,
                     timeout: float | datetime.timedelta | None = None) -> RestoreInfo:
        """Read a step (default: the newest) in place into the arrays/tensors of ``state``.

        Each block is verified before it is copied; if a tier fails midway the next one overwrites every
        entry. If every source fails, RestoreError is raised and ``state`` may hold a mix of values: do
        not train on it. ``timeout``: as for :meth:`restore`.

        While a rank that lost its RAM (a replaced node) still receives its shard from peers, a rank whose
        own verified copy is in ``state`` returns at once (so does :meth:`restore`). Its sends and the
        ranks' agreement go on in the background; the store's next call waits for them, and raises
        :class:`~tierfs.errors.RestoreIncompleteError` should that rank not get its shard (the ranks cannot
        all move to an older step then: restart the job). ``info.ranks`` is filled in once they are done.
        """
        sink = InPlace(state) if isinstance(state, Mapping) else None
        return self._restore(step, tiers, sink, timeout, lambda: _args.mapping(state, "state"))

    def localize(self, step: int | None = None, *, tiers: Sequence[str] | None = None,
                 timeout: float | datetime.timedelta | None = None) -> RestoreInfo:
        """Bring this rank's shard of a step (default: the newest every rank can get) into the first tier.

        Collective. Picks the step as ``restore`` does; a rank whose first tier lacks it gets its shard
        from a peer or a slower tier, verifies it and writes it into the first tier (committed once every
        rank of its node has it). Readers that read tiers directly, without collectives (the DCP reader),
        then find it in RAM. Returns what ``restore`` would: per rank, where the shard came from.
        ``timeout``: as for :meth:`restore`.
        """
        return self._restore(step, tiers, None, timeout, adopt=True)

    @serial
    def _restore(self, step: Any, tiers: Any, sink: InPlace | NewArrays | None, timeout: Any,
                 check: Callable[[], Any] = lambda: None, adopt: bool = False) -> RestoreInfo:
        """One restore. Its arguments (and ``check()``) are checked where every rank hears of a bad one."""
        self._check_open()
        # saves' commits first: their retention must not delete what this restore sends, and the copies they
        # hand on reach the copy workers before its re-seeding, in the same order on every rank
        self._ctx.work.commits.join()
        error: ArgumentError | None = None
        try:
            check()
            step, tiers = _args.optional_step(step), _args.names(tiers, "tiers", self._ctx.names)
            timeout = None if timeout is None else seconds(timeout)
        except ArgumentError as e:
            step, tiers, timeout, error = None, None, None, e

        def first() -> None:  # in the plan's gather: every rank raises
            if error is not None:
                raise error
            self.raise_background_errors()
        info = Restore(self._ctx, self._ctx.usable(tiers), sink, first, timeout).run(step, adopt)
        self._noted(info)
        return info

    def _noted(self, info: RestoreInfo) -> None:
        """What a restore leaves behind it: its figures, and the step the job goes on from."""
        _metrics.SINK.restored(info.tier, info.seconds, info.nbytes)
        self._calls.restored(info.step)

    @serial
    def restore_plan(self, tiers: Sequence[str] | None = None) -> RestorePlan:
        """What a restore over ``tiers`` (default: all) chooses from (collective), after the same waits: the
        steps each rank can get, from its own tiers or a peer's replica (``steps()``: those every rank can)."""
        self._check_open()
        self._ctx.work.commits.join()
        usable = self._ctx.usable(_args.names(tiers, "tiers", self._ctx.names))
        return gather_plan(self._ctx, usable, self.raise_background_errors)

    @serial
    def resume_from(self, step: int) -> None:
        """Note that the job goes on from ``step``, which it read by other means than :meth:`restore` (DCP's
        :class:`~tierfs.adapters.dcp.TieredReader`): the next save supersedes steps from there, as after a
        restore of it (see the timeline rule in the manager's guide). Every rank of the job calls it."""
        step = _args.step(step)
        self._ctx.ledger.restore_of(step)
        self._calls.restored(step)
