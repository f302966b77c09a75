"""CheckpointManager: Orbax's manager interface over a TieredStore, with asynchronous save and preemption.

    with CheckpointManager([MemoryTier(...), ObjectTier(...)]) as mgr:
        start = mgr.restore(state)                    # None, or the step loaded in place
        for step in range((start or -1) + 1, total):
            train_step(state)
            mgr.save(step, state, metrics={"loss": loss})
"""

from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from ..util import args as _args, readable
from ..device import copies as _device
from ..tiers.rootdir import check_local_url
from ..ranks import seconds
from ..errors import ArgumentError
from . import _restoring, _torchstate as ts, loaderstate
from ._preemption import DEFAULT_SIGTERM_GRACE, Preemption
from ..policies import (AnyPreservationPolicy, BestN, EveryNSteps, FixedIntervalPolicy, LatestN,
                        PreservationPolicy, PreserveAll, RestorePolicy, StepInfo)
from ..store import RestoreInfo, TieredStore
from ..tiers import ObjectTier
from ..tiers.base import AnyTier

if TYPE_CHECKING:  # the DCP path imports torch: only when a state holds tensors, or a step was saved through it
    from .dcp.managed import Plan

log = logging.getLogger("tierfs")


@dataclass
class CheckpointManagerOptions:
    """Orbax's options, mapped onto tierfs policies for a single ``directory``.

    ``save_interval_steps`` → ``FixedIntervalPolicy``; ``max_to_keep`` → ``LatestN`` (or ``BestN`` with
    ``best_fn``); ``keep_period`` → ``EveryNSteps``; none of them → ``PreserveAll``.
    """

    save_interval_steps: int = 1
    max_to_keep: int | None = None
    keep_period: int | None = None
    best_fn: Callable[[dict[str, Any]], float] | None = None
    best_mode: str = "min"
    enable_async_checkpointing: bool = True

    def __post_init__(self) -> None:
        what = "CheckpointManagerOptions "
        _args.integer(self.save_interval_steps, what + "save_interval_steps")
        _args.optional_integer(self.max_to_keep, what + "max_to_keep")
        _args.optional_integer(self.keep_period, what + "keep_period")
        if self.best_fn is not None and not callable(self.best_fn):
            raise ArgumentError(f"{what}best_fn must be a function of the metrics, e.g. lambda m: m['loss'], "
                                f"got {_args.shown(self.best_fn)}")
        _args.choice(self.best_mode, what + "best_mode", ("min", "max"))
        _args.flag(self.enable_async_checkpointing, what + "enable_async_checkpointing")

    def keep_policy(self) -> PreservationPolicy:
        parts: list[PreservationPolicy] = []
        if self.max_to_keep is not None:
            parts.append(BestN(self.best_fn, self.max_to_keep, self.best_mode) if self.best_fn
                         else LatestN(self.max_to_keep))
        if self.keep_period is not None:
            parts.append(EveryNSteps(self.keep_period))
        if not parts:
            return PreserveAll()
        return parts[0] if len(parts) == 1 else AnyPreservationPolicy(parts)


class CheckpointManager:
    """Save every few steps without stalling training; restore from the fastest verified tier.

    Parameters
    ----------
    tiers:
        The tiers, fastest first, each with its ``save=`` and ``keep=`` policies. Or give ``directory``.
    directory, options:
        Orbax-style: one tier at ``directory`` (an fsspec URL or a local path) with policies from
        ``CheckpointManagerOptions``.
    storage_options:
        For ``directory``: passed unchanged to fsspec.
    restore_policy:
        Which tiers a restore may read and in which order (default: fastest verified first).
    handle_sigterm:
        Install a SIGTERM handler (every rank passes the same value): ``reached_preemption`` turns true, and
        the next ``save`` (one) goes, on every rank, to the tiers whose save policy includes
        ``PreemptionCheckpointingPolicy`` (to every tier if none does), whichever rank got the signal. On
        several ranks each ``save`` then starts with an all-reduce of one number (see
        :mod:`tierfs.adapters._preemption`).
    sigterm_grace:
        Seconds (or a ``timedelta``, default 30) a loop has after SIGTERM to hear of it through
        ``reached_preemption``. A loop that does not ask is stopped then: its next ``save`` saves nothing
        (unless none was made since the signal: then it is the preemption save), waits until the preemption
        save is durable (within ``exit_timeout``; later saves' copies are not waited for) and ends the
        process as an unhandled SIGTERM would, on every rank.
    use_dcp:
        How torch state is saved. ``None`` (the default): a state holding at least one ``torch.Tensor``
        (DTensor and other subclasses included) goes through PyTorch Distributed Checkpoint (``dcp.save``
        with :class:`~tierfs.adapters.dcp.TieredWriter`), so sharded states (FSDP2, DTensor) work and load
        with another world size; a state without tensors (numpy, JSON) goes to the store directly.
        ``True``: every state through DCP (needs torch). ``False``: never (tensors are saved whole per
        rank; DTensors are rejected). Restores read each step in the format it was saved in.
    overlap:
        With asynchronous checkpointing, the optimizer (or a list of them) whose parameters and state
        may still be copying from GPU memory when ``save`` returns: each optimizer's next ``step()`` waits
        for those copies first (a step pre-hook). Everything else is copied before ``save`` returns.
        ``store.copies`` is the handle to wait on. See the GPU guide.
    **store_options:
        Passed to ``TieredStore`` (``max_in_flight``, ``when_busy``, ``background_bandwidth``,
        ``exit_timeout``, ...).

    Notes
    -----
    A manager left open when the interpreter exits finishes its background commits and copies then, within
    ``exit_timeout`` (default ``TIERFS_EXIT_TIMEOUT``, else 600 s; ``0``: not at all), and closes; past it,
    one warning names the steps that are not durable and the RAM tier holding them. A constructor that
    fails leaves no tier open and no directory it created.
    """

    def __init__(self, tiers: Sequence[AnyTier] | None = None, *, directory: str | None = None,
                 options: CheckpointManagerOptions | None = None,
                 storage_options: Mapping[str, Any] | None = None,
                 restore_policy: RestorePolicy | None = None, handle_sigterm: bool = False,
                 sigterm_grace: float | datetime.timedelta = DEFAULT_SIGTERM_GRACE,
                 use_dcp: bool | None = None, overlap: Any = None, **store_options: Any) -> None:
        if use_dcp is not None and type(use_dcp) is not bool:
            raise ArgumentError(f"use_dcp must be None (torch states through DCP), True or False, got {use_dcp!r}")
        self.use_dcp = use_dcp
        if overlap is not None and not isinstance(overlap, (bool, str, bytes)) and not hasattr(overlap, "param_groups"):
            try:  # model.parameters() is a generator: kept as a list, for every save
                overlap = list(overlap)
            except TypeError:
                pass  # (refused just below)
        _device.Overlap.of(overlap)  # (an ArgumentError now, not at the first save)
        self.overlap = overlap
        self.options = _args.instance(options or CheckpointManagerOptions(), "options", CheckpointManagerOptions,
                                      "a CheckpointManagerOptions")
        if (tiers is None) == (directory is None):
            raise ArgumentError("give CheckpointManager either a list of tiers or directory=URL, not both")
        if directory is not None and (not isinstance(directory, str) or not directory):
            raise ArgumentError(f"directory must be a URL or a local path (a str), got {_args.shown(directory)}")
        _args.instance(restore_policy or RestorePolicy(), "restore_policy", RestorePolicy, "a RestorePolicy")
        _args.flag(handle_sigterm, "handle_sigterm")
        grace = _args.number(seconds(sigterm_grace) if isinstance(sigterm_grace, datetime.timedelta)
                             else sigterm_grace, "sigterm_grace (seconds)")
        if directory is not None:
            _args.object_url(directory, "directory", relative=True)  # s3:/bucket is a typo, not a local directory
            check_local_url(directory, "directory")
            url = directory if "://" in directory else f"file://{directory}"
            tiers = [ObjectTier(url, storage_options, save=FixedIntervalPolicy(self.options.save_interval_steps),
                                keep=self.options.keep_policy())]
        assert tiers is not None
        self.store = TieredStore(tiers, **store_options)
        self.restore_policy = restore_policy or RestorePolicy()
        self.last_restore_info: RestoreInfo | None = None
        self._restored: int | None = None
        self._dcp_plan: Plan | None = None  # the last DCP save's plan, replayed for the same structure
        self._preemption = Preemption(self.store, grace)
        if handle_sigterm:
            try:  # (only the main thread may install one)
                self._preemption.install()
            except BaseException:
                self.store._discard()  # a failed constructor leaves no open tier and no directory it made
                raise

    # -- saving -------------------------------------------------------------------------------------
    def should_save(self, step: int) -> bool:
        """Whether ``save(step, ...)`` would write anything. Not collective: on several ranks the preemption
        tiers count once the ranks agreed that one got SIGTERM (at a ``save`` or ``reached_preemption``)."""
        step = _args.step(step)
        with self.store._calls.lock:
            if self._exists(step) and not self._replaces(step):
                return False
            return bool(self.store.should_save(step, preempted=self._preemption.pending()))

    def save(self, step: int, state: Mapping[str, Any], metrics: Mapping[str, Any] | None = None,
             force: bool = False, *, loader: Any = None) -> bool:
        """Save ``state`` at ``step`` to the tiers whose policies take it; returns whether it saved.

        Returns after the state is copied into the RAM tier's buffers; the rest runs in the background
        (``enable_async_checkpointing=False`` waits for the commit). A step that already exists is not
        saved again, unless it is newer than the step this manager restored (a run that resumed from an
        earlier step replaces the steps it is redoing). Torch state goes through DCP (see ``use_dcp``);
        every rank of a job must call ``save`` with the same step. The arguments are checked first, each a
        one-line :class:`~tierfs.errors.ArgumentError` (a bad leaf of ``state`` too, on every rank).
        ``loader``: a data loader (``StatefulDataLoader``, or any object with ``state_dict()`` and
        ``load_state_dict()``), or ``{name: loader}``, whose state is saved in this rank's shard, without
        pickle (:mod:`tierfs.adapters.loaderstate`); ``restore(..., loader=...)`` gives it back.

        Threads may share a manager: its saves and restores run one at a time; a save that would remove a
        step another thread saved (one above it, by the timeline rule) is an ArgumentError (see
        :class:`~tierfs.TieredStore`).
        """
        step, force = _args.step(step), _args.flag(force, "force")
        metrics = _args.jsonable(metrics, "metrics") if metrics is not None else None
        _check_state(state)
        if not state and not loaderstate.objects(loader):
            raise ArgumentError("state is empty: nothing to save; pass the training state (e.g. {'model': "
                                "model.state_dict(), 'optim': optimizer.state_dict()}) or loader=")
        with self.store._calls.lock:
            self.store._check_order(step)  # before anything is written, on either path
            return self._save_now(step, state, metrics, force, loader)

    def _save_now(self, step: int, state: Mapping[str, Any], metrics: Mapping[str, Any] | None, force: bool,
                  loader: Any) -> bool:
        pre = self._preemption
        try:
            preempted, ending = pre.agree()  # (with handle_sigterm: one all-reduce, the same on every rank)
            stopped = (f"{readable.duration(pre.grace)} ago and the training loop did not stop (it never called "
                       "reached_preemption)")
            if ending and not preempted:  # the preemption save was made: this one is not, the process ends
                pre.end(f"{stopped}: step {step} is not saved")
            through_dcp = self._through_dcp(state)
            state = loaderstate.attach(state, loader, trusted=not through_dcp)
            if through_dcp:
                from .dcp import managed

                saved = managed.save(self, step, state, metrics, force, preempted)
            else:
                saved = self._save(step, state, metrics, force, preempted)
        except Exception as e:
            if pre.ends_on(e):  # another rank ended on SIGTERM amid this save, or the grace is over
                pre.end(f"came and the save of step {step} failed ({type(e).__name__}: {e})")
            raise
        if saved and preempted:
            pre.saved(step)  # once: later saves follow the tiers' usual policies
        if ending:  # no save since the signal before the grace was over: this one was the preemption save
            pre.end(f"{stopped}: step {step} went to the preemption tiers")
        return saved

    def _save(self, step: int, state: Mapping[str, Any], metrics: Mapping[str, Any] | None, force: bool,
              preempted: bool) -> bool:
        overwrite = False
        if self._exists(step):
            if not self._replaces(step):
                return False
            log.info("step %d exists from %s; replacing it", step, self._before())
            overwrite = True
        if preempted and not force and not self.store.should_save(step, preempted=True):
            force = True  # no tier names a preemption policy: save everywhere
        return self.store.save(step, state, metrics=metrics, force=force, overwrite=overwrite, overlap=self.overlap,
                               preempted=preempted, blocking=not self.options.enable_async_checkpointing)

    def _through_dcp(self, state: Mapping[str, Any]) -> bool:
        if self.use_dcp is not None:
            if not self.use_dcp and ts.has_tensor(state, sharded_only=True):
                raise ArgumentError("the state holds DTensors/ShardedTensors, which only DCP can save: "
                                    "use CheckpointManager(..., use_dcp=None or True)")
            return self.use_dcp
        return ts.has_tensor(state)

    def _exists(self, step: int) -> bool:
        return self.store.has_step(step)

    def _replaces(self, step: int) -> bool:
        """Whether an existing ``step`` is saved again: it is above the step this manager restored, or this
        manager restored none (the job started afresh over the tiers of an earlier run)."""
        return self._restored is None or step > self._restored

    def _before(self) -> str:
        return (f"before the restore of step {self._restored}" if self._restored is not None
                else "an earlier run (this one restored none)")

    # -- restoring ----------------------------------------------------------------------------------
    def restore(self, state: Mapping[str, Any] | None = None, step: int | None = None, *,
                loader: Any = None) -> Any:
        """Restore the newest step (or ``step``).

        With ``state``: loads in place and returns the step, or None when nothing was ever saved (no rank
        holds a step on any tier). Without: returns the restored state (a nested dict), or None. Ranks that
        hold steps none of which every rank can get (nodes lost with their replicas) are an error,
        :class:`~tierfs.errors.CheckpointLostError` naming the steps and the ranks lacking them, never None.
        Details are in ``last_restore_info``.
        Each step is read in the format it was saved in: steps saved through DCP with ``dcp.load`` and
        :class:`~tierfs.adapters.dcp.TieredReader` (DTensors are resharded to the target's placement;
        the job may have another world size), other steps by the store. When no tier holds a verified copy
        of the newest step, older steps are tried (not when ``step`` is given). A target that does not fit
        the checkpoint (a key it lacks, an array or tensor of another shape) is a
        :class:`~tierfs.errors.StateMismatchError` naming the key, raised before anything is loaded; on the
        DCP path a tensor of another dtype is converted, as ``dcp.load`` does. ``loader`` (as for
        :meth:`save`) gets the state saved with the step, this rank's own.
        """
        step = _args.optional_step(step)
        if state is not None:
            _check_state(state)
        loaders = loaderstate.objects(loader)
        with self.store._calls.lock:  # one restore at a time, none during another thread's save
            return self._restore_now(state, step, loader, bool(loaders))

    def _restore_now(self, state: Mapping[str, Any] | None, step: int | None, loader: Any, loaders: bool) -> Any:
        step = step if step is not None else self.restore_policy.step
        tiers = self.restore_policy.order([t.name for t in self.store.tiers])
        got = _restoring.restore(self.store, state, step, tiers, loaders)  # collective: one restore
        if got is None:
            return None
        out, info = got
        self.last_restore_info = info
        self._restored = info.step
        self.store.resume_from(info.step)  # DCP's reader restored it, not the store
        loaderstate.restored(self.store, info.step, tiers, state if state is not None else out, loader)
        return out

    # -- queries ------------------------------------------------------------------------------------
    def all_steps(self) -> list[int]:
        return sorted(self.store.steps())

    def latest_step(self) -> int | None:
        steps = self.all_steps()
        return steps[-1] if steps else None

    def metrics(self, step: int) -> dict[str, Any]:
        """The metrics saved with ``step``."""
        return dict(self.store.manifest(step).metrics)

    def best_step(self) -> int | None:
        """The best step by ``options.best_fn`` (or the first ``BestN`` among the tiers' keep policies)."""
        best = None
        if self.options.best_fn is not None:
            best = BestN(self.options.best_fn, 1, self.options.best_mode)
        else:
            for t in self.store.tiers:
                best = _find_best(t.keep_policy)
                if best is not None:
                    break
        if best is None:
            raise ArgumentError("best_step needs options.best_fn or a BestN keep policy on a tier")
        scored = [(v, s) for s in self.all_steps()
                  if (v := best.score(StepInfo(s, 0.0, self.metrics(s)))) is not None]
        if not scored:
            return None
        return (min if best.mode == "min" else max)(scored, key=lambda vs: (vs[0], -vs[1]))[1]

    # -- preemption ---------------------------------------------------------------------------------
    def reached_preemption(self, step: int) -> bool:
        """True once the job was told to stop (SIGTERM, on any rank): the loop saves (once more, to the
        preemption tiers, even if a save since the signal went there already) and stops; no exit is forced
        then. Collective on several ranks."""
        _args.step(step)
        with self.store._calls.lock:  # a collective: not amid another thread's save
            return self._preemption.asked()

    # -- life cycle ---------------------------------------------------------------------------------
    def delete(self, step: int) -> None:
        """Delete ``step`` from every tier."""
        self.store.delete(step)

    def wait_until_finished(self) -> None:
        self.store.wait_until_finished()

    def check_for_errors(self) -> None:
        """Raise the first error background work hit, if any."""
        self.store.raise_background_errors()

    def close(self) -> None:
        try:
            self.store.close()
        finally:
            self._preemption.uninstall()

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _check_state(state: Any) -> None:
    """A state to save or restore into: a mapping without the key reserved for the data loader's state."""
    _args.mapping(state, "state")
    if loaderstate.KEY in state:
        raise ArgumentError(f"state key {loaderstate.KEY!r} is reserved for the data loader's state (loader=); "
                            "rename it")


def _find_best(policy: PreservationPolicy) -> BestN | None:
    if isinstance(policy, BestN):
        return policy
    for p in getattr(policy, "policies", ()):
        found = _find_best(p)
        if found is not None:
            return found
    return None
