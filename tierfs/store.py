"""TieredStore: one checkpoint store over several tiers, fastest first.

A facade over ``tierfs/core/``, one concept per module: :mod:`~tierfs.core.saving` (stage, commit, hand
on), :mod:`~tierfs.core.restore` (the restore pipeline), :mod:`~tierfs.core.reads` (reads without
collectives), :mod:`~tierfs.core.retention`, :mod:`~tierfs.core.ledger` (what this process knows of every
step). The commit protocol's steps live in :mod:`tierfs.protocol`, agreeing across ranks in
:func:`tierfs.ranks.agree`.
"""

from __future__ import annotations

import datetime
import logging
import time
from typing import Any, Callable, Mapping, Sequence

from . import metrics as _metrics
from .util import args as _args
from .util import exitwork as _exit
from .core import lifecycle as _lifecycle
from .core.calls import Calls, serial
from .util.worker import DEFAULT_BACKGROUND_BANDWIDTH, Throttle
from .core.catchup import catch_up
from .core.context import check_tiers
from .core.storereads import ShardReads
from .core.storerestore import Restores
from .core.restore.session import AsSaved, ReadDcp
from .core.upkeep import Upkeep
from .core.reads import Reader
from .core.restore.pipeline import RestoreInfo
from .core.restore.plan import gather_plan, lost_steps
from .core.retention import Retention
from .core.saving import SavePath
from .ranks import Group, SingleProcess, TorchGroup, default_group, seconds
from .errors import ArgumentError, TierfsError
from .format import DEFAULT_BLOCK_SIZE, DEFAULT_FILE_SIZE
from .protocol import common_steps
from .tiers.base import AnyTier, Replicator

__all__ = ["DEFAULT_BACKGROUND_BANDWIDTH", "RestoreInfo", "TieredStore"]

log = logging.getLogger("tierfs")


class TieredStore(ShardReads, Restores, Upkeep):
    """A checkpoint store over ``tiers``, given fastest first (e.g. RAM, then object storage).

    Parameters
    ----------
    tiers:
        The tiers, fastest first; the first holds files (e.g. a ``MemoryTier``). ``save`` returns once it
        holds a committed copy. At most one ``PeerTier`` (a :class:`~tierfs.tiers.base.Replicator`),
        after the first.
    group:
        The ranks of the job; by default a single process, or torch.distributed when initialised.
    threads:
        Threads for copying and checksumming on the save/restore path (default: up to 4).
    file_size, block_size:
        Shard files hold about ``file_size`` bytes; crc32c covers blocks of ``block_size`` bytes.
    clock:
        Time source for time-based policies (tests inject one).
    cleanup:
        When the store opens, remove uncommitted steps (left by a crash) and copy on, in the background,
        committed steps a slower tier's policy took but that tier lacks (their process ended first). A
        process that only reads while another saves to the same tiers must pass ``cleanup=False``.
    max_in_flight:
        Saves whose work may be unfinished at once, per tier: not yet committed in the first tier, and
        still on their way to each slower tier. A save is bound only by the tiers it goes to.
    when_busy:
        At a tier's bound, ``"wait"`` until its oldest finishes, or ``"skip"`` the slow tiers at their bound
        for the new step (the first tier always takes it). A save that finds the first tier full while
        copies out of it are on their way waits for one to end (the steps they hold may then go).
    background_bandwidth:
        Bytes per second that copies to slower tiers may move on average, checksum checks included
        (default 256 MB/s; None: no cap), in bursts of up to 64 MiB, so training keeps its cores and memory
        bandwidth. The commit to the first tier is never capped. Background threads also run at a lower
        CPU priority.
    timeout:
        Seconds (or a ``timedelta``) any rank waits for the others in one of the store's collective or
        point-to-point operations (default 600). Past it, or as soon as a rank's process is gone, the
        waiting rank raises :class:`~tierfs.errors.RankWaitError` naming the stage and the rank(s) it
        waited for. A failure on one rank (a full disk, a damaged copy) is not a wait: the other ranks hear
        of it at once and raise naming the rank and the stage.
    exit_timeout:
        Seconds (or a ``timedelta``) that background work still unfinished when the interpreter exits (a
        store never closed) may take: commits and copies finish, with a progress line every few seconds,
        then the store closes. Past it, one warning names the steps not durable and the RAM tier holding
        them. ``0``: finish nothing at exit. Default: ``TIERFS_EXIT_TIMEOUT`` from the environment, else 600.
    helper:
        Upload from a process of this rank's own (:mod:`tierfs.core.helper`), which reads the first tier's
        files from the same pages, so the uploads' Python never takes the training loop's GIL; the training
        process keeps the ranks' agreement and the marker. A helper that ends mid-upload is a
        :class:`~tierfs.errors.HelperError` naming it (raised by the next call); the step stays in the
        first tier and the next upload starts a new helper. Default False.

    Notes
    -----
    When the store opens, the ranks observe which of them share the first tier's directory (host, device,
    inode): per-rank directories on one machine work as well as one per node. Node numbers
    (``TIERFS_NODE_RANK``, ``GROUP_RANK``, ``PeerTier(node_rank=...)``) that put ranks sharing a directory on
    different nodes are an error, raised on every rank. A constructor that fails closes the tiers it opened
    and removes the directories it created (never one that existed before). ``TIERFS_METRICS_PORT`` turns
    on its figures for a dashboard (:mod:`tierfs.metrics`).

    Threads may share a store: its calls run one at a time, in the order they come (the background work of
    earlier saves goes on meanwhile). A save that would remove a step another thread saved (a step below it:
    the timeline rule, see :meth:`save`) is an :class:`~tierfs.errors.ArgumentError`. With several ranks,
    every rank's threads must make their calls in the same order, as one thread would.
    """

    def __init__(self, tiers: Sequence[AnyTier], *, group: Group | None = None, threads: int | None = None,
                 file_size: int = DEFAULT_FILE_SIZE, block_size: int = DEFAULT_BLOCK_SIZE,
                 clock: Callable[[], float] = time.time, cleanup: bool = True, max_in_flight: int = 2,
                 when_busy: str = "wait", background_bandwidth: float | None = DEFAULT_BACKGROUND_BANDWIDTH,
                 timeout: float | datetime.timedelta | None = None,
                 exit_timeout: float | datetime.timedelta | None = None, helper: bool = False) -> None:
        self._calls = Calls()  # one call at a time, whatever the threads (see _calls)
        tiers, reps = check_tiers(tiers)
        self.max_in_flight = _args.integer(max_in_flight, "max_in_flight")
        self.when_busy = _args.choice(when_busy, "when_busy", ("wait", "skip"))
        self.threads = _args.optional_integer(threads, "threads")
        self.file_size = _args.integer(file_size, "file_size (bytes)")
        self.block_size = _args.integer(block_size, "block_size (bytes)")
        _args.flag(cleanup, "cleanup")
        _args.flag(helper, "helper")
        if not callable(clock):
            raise ArgumentError(f"clock must be a function returning seconds, got {_args.shown(clock)}")
        throttle = Throttle(background_bandwidth)
        self.timeout = seconds(timeout)
        self.exit_timeout = _exit.exit_seconds(exit_timeout)
        self._closed = True  # until it is open
        self._opening = _lifecycle.Opening(writes=cleanup)
        try:
            with self._opening.taking_groups(self.timeout):  # every group the store uses is taken now
                if group is not None and not isinstance(group, (SingleProcess, TorchGroup)):
                    raise ArgumentError(f"group must be a tierfs group (tierfs.ranks.TorchGroup, SingleProcess) or "
                                        f"None for the default (torch.distributed when initialised), got "
                                        f"{_args.shown(group)}")
                self.group = group.with_timeout(self.timeout) if group is not None else default_group(self.timeout)
                self._ctx = self._opening.build(tiers, reps, self.group, throttle, threads, self.file_size,
                                                  self.block_size, clock, helper)
            self._reader = Reader(self._ctx)
            self._retention = Retention(self._ctx, self._reader)
            self._saving = SavePath(self._ctx, self._retention)
            self._as_saved = AsSaved(self._ctx, self._reader, self.raise_background_errors, self._noted)
            known = _lifecycle.remove_uncommitted(self._ctx) if cleanup else {}
            # a shared tier listed by rank 0 alone (collective), and no tier listed twice
            self._ctx.refresh(shared=self.group, known=known)
            if cleanup:  # a store that saves: the copies a process ended before making
                catch_up(self._ctx, self._saving)
        except BaseException:
            self._opening.undo()
            raise
        self._closed = False
        _exit.register(self, self.exit_timeout, _lifecycle.exit_work)

    # -- the tiers ----------------------------------------------------------------------------------
    @property
    def tiers(self) -> list[AnyTier]:
        """Every tier, fastest first."""
        return self._ctx.tiers

    @property
    def replicator(self) -> Replicator | None:
        """The tier that keeps copies of other ranks' shards (the ``PeerTier``), if any."""
        return self._ctx.replicator

    def tier(self, name: str) -> AnyTier:
        """The tier named ``name``."""
        return self._ctx.tier(name)

    @serial
    def refresh(self) -> None:
        """Re-list every tier (steps written by other processes become visible)."""
        self._ctx.refresh()

    @serial
    def steps(self) -> dict[int, list[str]]:
        """``{step: [names of tiers holding a committed copy]}``, newest last."""
        self.refresh()
        return self._holdings()

    def _holdings(self) -> dict[int, list[str]]:
        out: dict[int, list[str]] = {}
        for t in self.tiers:
            for s in sorted(self._ctx.ledger.holding(t.name)):
                out.setdefault(s, []).append(t.name)
        return dict(sorted(out.items()))

    def has_step(self, step: int) -> bool:
        """Whether ``step`` is being saved or is committed on some tier, as this process knows (no listing)."""
        return self._ctx.ledger.known(step)

    @serial
    def common_steps(self, tiers: Sequence[str] | None = None, *,
                     timeout: float | datetime.timedelta | None = None, raise_lost: bool = False) -> list[int]:
        """The committed steps every rank of the job can restore from ``tiers`` (default: any tier), oldest
        first, as :meth:`restore` counts them: from its own tiers or, where its node was replaced, from the
        copies its peers keep (rebuilt from its group's, with erasure coding).

        Collective (``timeout``: how long to wait for the others, default the store's). ``raise_lost``: when
        ranks hold steps but none every rank can get, raise :class:`~tierfs.errors.CheckpointLostError`
        naming them, not an empty list."""
        names = _args.names(tiers, "tiers", self._ctx.names) if tiers is not None else None
        _args.flag(raise_lost, "raise_lost")
        self._ctx.work.restores.join()  # the steps as the last restore left them (its failure: at the next call)
        g = self.group if timeout is None else self.group.with_timeout(timeout)
        plan = gather_plan(self._ctx, self._ctx.usable(names), group=g, what="common steps", outcome="none listed")
        gettable = [plan.gettable(r) for r in range(len(plan.own))]
        lost = lost_steps(gettable, list(names or self._ctx.names), plan.notes) if raise_lost else None
        if lost is not None:
            raise lost
        return sorted(common_steps(gettable))

    def latest_common_step(self, tiers: Sequence[str] | None = None, *,
                           timeout: float | datetime.timedelta | None = None) -> int | None:
        """The newest of :meth:`common_steps` (collective), or None when there is none."""
        return ([None] + self.common_steps(tiers, timeout=timeout))[-1]

    # -- save ---------------------------------------------------------------------------------------
    @serial
    def should_save(self, step: int, *, force: bool = False, preempted: bool = False) -> list[AnyTier]:
        """The tiers whose save policy takes ``step`` (all of them with ``force``)."""
        return self._saving.should_save(_args.step(step), force=_args.flag(force, "force"),
                                        preempted=_args.flag(preempted, "preempted"))

    @serial
    def save(self, step: int, state: Mapping[str, Any], metadata: Mapping[str, Any] | None = None, *,
             metrics: Mapping[str, Any] | None = None, force: bool = False, overwrite: bool = False,
             preempted: bool = False, blocking: bool = True,
             timeout: float | datetime.timedelta | None = None, replicated: Any = None,
             overlap: Any = None) -> bool:
        """Save ``state`` as ``step`` to the tiers whose policies take it; False when none does.

        With ``blocking=True`` it returns once the first tier holds a committed copy. With
        ``blocking=False`` it returns as soon as the state is copied into the first tier's buffers (the
        caller may change the state right away); checksums and the commit follow in the background.
        Slower tiers are always written in the background. Raises any error background work hit since
        the last call. ``timeout`` bounds this save's waits on the other ranks instead of the store's.
        Every argument is checked first (an :class:`~tierfs.errors.ArgumentError`, or a bad leaf of
        ``state``, raised on every rank), before anything is written or replaced. Keys are non-empty strings
        (or ints) without ``/`` (which joins nested keys) or control characters; a state empty on one rank is
        saved (a rank holding nothing of the job's state), one empty on every rank is refused.

        Going back (the timeline rule): committed steps above ``step`` belong to a run the job went back
        from; they are removed from every tier before ``step`` is written, and so are those above the step
        last restored (:meth:`restore`, :meth:`resume_from`) when such newer steps exist. ``step`` itself,
        when already committed, is replaced if it is above the step last restored; otherwise
        :class:`~tierfs.errors.StepExistsError` unless ``overwrite=True``. A save that would so remove a step
        another thread of this process saved (since the last restore) is refused, an ArgumentError.

        ``replicated`` declares what other ranks hold identically (data parallelism): a list of keys
        (``["model", "optim"]``; nested keys joined by ``/``) whose arrays every rank of the job holds,
        or ``{key: [ranks that hold it]}`` (HSDP: the ranks of one replica group). The RAM tier keeps
        everything each rank needs; shared tiers store each such array once, the work spread over the
        ranks holding it; peers replicate only what no other node holds; a restore gets each rank's
        shared arrays from the ranks holding them. Worked out once per structure; at every commit the
        ranks check, from their checksums, that they do hold the same values (else the step is not
        committed).

        GPU tensors are copied straight into the RAM tier's page-locked buffers; ``save`` waits for those
        copies alone. ``overlap`` (optimizers, or tensors such as ``model.parameters()``) with
        ``blocking=False``: the copies of what it names may run on after ``save`` returns, each named
        optimizer's next ``step()`` waiting for them (:attr:`copies` otherwise). See the GPU guide.
        """
        self._check_open()
        self._check_order(step)
        with _metrics.SINK.saving(step):  # the stall, and when the step started, for the metrics
            saved = self._saving.save(step, state, metadata, metrics=metrics, force=force, overwrite=overwrite,
                                      preempted=preempted, blocking=blocking, max_in_flight=self.max_in_flight,
                                      when_busy=self.when_busy, timeout=timeout, replicated=replicated,
                                      overlap=overlap)
        if saved:
            self._calls.saved(_args.step(step), self._ctx.ledger.restored)
        return saved

    # -- restore (collective; the others: Restores) ----------------------------------------------------
    @serial
    def restore_as_saved(self, state: Mapping[str, Any] | None, step: int | None, tiers: Sequence[str], *,
                         loader: bool, read_dcp: ReadDcp) -> tuple[Any, RestoreInfo] | None:
        """Restore a step (None: the newest every rank can get, else older ones) over ``tiers``, each step
        read the way it was saved, over one plan (collective): the :class:`~tierfs.CheckpointManager`'s
        restore (:mod:`tierfs.core.restore.session`).

        A step the store saved is restored in place into ``state`` (None: into a new state); a step saved
        through DCP is read by ``read_dcp(step, into)``, which may restore ``{entry: tensor}`` through the
        same plan with ``into``, and raises :class:`~tierfs.core.restore.session.Unreadable` to try an
        older step. ``loader``: this rank reads its own shard after the restore. Returns ``(step or the new
        state, info)``, or None when no rank holds a step.
        """
        self._check_open()
        self._ctx.work.commits.join()  # as in every restore (see _restore)
        return self._as_saved.run(tiers, state, step, loader, read_dcp)

    def _check_order(self, step: Any) -> None:
        """A save of ``step`` from this thread removes no step another thread saved (see :mod:`tierfs.core.calls`)."""
        self._calls.check_save(step, self._ctx.ledger.restored)

    # -- life cycle ---------------------------------------------------------------------------------
    def _check_open(self) -> None:
        """Before a collective call: the store is open, and the rest of the last restore (which goes on in the
        background on a rank that returned before the others, see :meth:`restore_into`) is done."""
        if self._closed:
            raise TierfsError("the store is closed; create a new TieredStore")
        self._ctx.work.settle()

    @serial
    def close(self) -> None:
        """Finish background work, then release every tier. Raises a background failure, if any.

        While it waits it says what for (the steps and the tiers they are not yet on). Ctrl-C: the first
        press waits on and raises KeyboardInterrupt once the copies are done; the next (the first, when it
        ended the ``with`` block) stops at once, naming what is not durable and where it is.
        """
        if self._closed:
            return
        _exit.unregister(self)  # closed here: nothing is left for the exit to finish
        try:
            _exit.wait_for(_lifecycle.StoreWork(self), "closing the store")
            self.wait_until_finished()
            self._retention.close()  # what is left of the steps retention dropped from a shared tier
        finally:
            self._closed = True
            done = _lifecycle.StoreWork(self).pending() is None  # else Ctrl-C left copies running: not joined
            if done:
                self._ctx.work.close()
                for t in self.tiers:
                    t.close()
            self._opening.give_back_groups(usable=done)  # for the next store (not while copies use them)

    def _discard(self) -> None:
        """Undo the store for a constructor that failed after making it (``CheckpointManager``'s). Never raises."""
        _exit.unregister(self)
        self._closed = True
        self._opening.undo()

    def __enter__(self) -> "TieredStore":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

