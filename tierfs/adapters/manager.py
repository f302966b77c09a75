"""CheckpointManager: Orbax's manager interface over a TieredStore, with asynchronous save and preemption.

    with CheckpointManager([MemoryTier(...), ObjectTier(...)]) as mgr:
        start = mgr.restore(state)                    # None, or the step loaded in place
        for step in range((start or -1) + 1, total):
            train_step(state)
            mgr.save(step, state, metrics={"loss": loss})
"""

from __future__ import annotations

import logging
import signal
import threading
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from ..errors import StepNotFoundError
from ..policies import (AnyPreservationPolicy, BestN, EveryNSteps, FixedIntervalPolicy, LatestN,
                        PreservationPolicy, PreserveAll, RestorePolicy, StepInfo)
from ..store import RestoreInfo, TieredStore
from ..tiers import ObjectTier, Tier

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
        Install a SIGTERM handler: ``reached_preemption`` turns true and the next ``save`` goes to every
        tier whose save policy includes ``PreemptionCheckpointingPolicy`` (to every tier if none does).
    **store_options:
        Passed to ``TieredStore`` (``max_in_flight``, ``when_busy``, ``background_bandwidth``, ...).
    """

    def __init__(self, tiers: Sequence[Tier] | None = None, *, directory: str | None = None,
                 options: CheckpointManagerOptions | None = None,
                 storage_options: Mapping[str, Any] | None = None,
                 restore_policy: RestorePolicy | None = None, handle_sigterm: bool = False,
                 **store_options: Any) -> None:
        self.options = options or CheckpointManagerOptions()
        if (tiers is None) == (directory is None):
            raise ValueError("give CheckpointManager either a list of tiers or directory=URL, not both")
        if directory is not None:
            url = directory if "://" in directory else f"file://{directory}"
            tiers = [ObjectTier(url, storage_options, save=FixedIntervalPolicy(self.options.save_interval_steps),
                                keep=self.options.keep_policy())]
        self.store = TieredStore(tiers, **store_options)
        self.restore_policy = restore_policy or RestorePolicy()
        self.last_restore_info: RestoreInfo | None = None
        self._restored: int | None = None
        self._preempted = threading.Event()
        self._old_handler: Any = None
        if handle_sigterm:
            self._old_handler = signal.signal(signal.SIGTERM, self._on_sigterm)

    # -- saving -------------------------------------------------------------------------------------
    def should_save(self, step: int) -> bool:
        """Whether ``save(step, ...)`` would write anything."""
        if self._exists(step) and not self._replaces(step):
            return False
        return bool(self.store.should_save(step, preempted=self._preempted.is_set()))

    def save(self, step: int, state: Mapping[str, Any], metrics: Mapping[str, Any] | None = None,
             force: bool = False) -> bool:
        """Save ``state`` at ``step`` to the tiers whose policies take it; returns whether it saved.

        Returns after the state is copied into the RAM tier's buffers; the rest runs in the background
        (``enable_async_checkpointing=False`` waits for the commit). A step that already exists is not
        saved again, unless it is newer than the step this manager restored (a run that resumed from an
        earlier step replaces the steps it is redoing).
        """
        overwrite = False
        if self._exists(step):
            if not self._replaces(step):
                return False
            log.info("step %d exists from before the restore of step %s; replacing it", step, self._restored)
            overwrite = True
        preempted = self._preempted.is_set()
        if preempted and not force and not self.store.should_save(step, preempted=True):
            force = True  # no tier names a preemption policy: save everywhere
        return self.store.save(step, state, metrics=metrics, force=force, overwrite=overwrite,
                               preempted=preempted, blocking=not self.options.enable_async_checkpointing)

    def _exists(self, step: int) -> bool:
        with self.store._lock:  # noqa: SLF001 - the manager is the store's own adapter
            return step in self.store._in_flight or any(step in s for s in self.store._index.values())

    def _replaces(self, step: int) -> bool:
        return self._restored is not None and step > self._restored

    # -- restoring ----------------------------------------------------------------------------------
    def restore(self, state: Mapping[str, Any] | None = None, step: int | None = None) -> Any:
        """Restore the newest step (or ``step``).

        With ``state``: loads in place and returns the step, or None when there is nothing to restore.
        Without: returns the restored state (a nested dict), or None. Details are in ``last_restore_info``.
        """
        step = step if step is not None else self.restore_policy.step
        tiers = self.restore_policy.order([t.name for t in self.store.tiers])
        try:
            if state is not None:
                info = self.store.restore_into(state, step, tiers=tiers)
                out: Any = info.step
            else:
                out, info = self.store.restore(step, tiers=tiers)
        except StepNotFoundError:
            if step is not None:
                raise
            return None
        self.last_restore_info = info
        self._restored = info.step
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
            raise ValueError("best_step needs options.best_fn or a BestN keep policy on a tier")
        scored = [(v, s) for s in self.all_steps()
                  if (v := best.score(StepInfo(s, 0.0, self.metrics(s)))) is not None]
        if not scored:
            return None
        return (min if best.mode == "min" else max)(scored, key=lambda vs: (vs[0], -vs[1]))[1]

    # -- preemption ---------------------------------------------------------------------------------
    def _on_sigterm(self, signum, frame) -> None:
        log.warning("SIGTERM received: the next save goes to the preemption tiers")
        self._preempted.set()

    def reached_preemption(self, step: int) -> bool:
        """True once the job was told to stop (SIGTERM, on any rank)."""
        flag = self._preempted.is_set()
        if self.store.group.world_size > 1:
            flag = any(self.store.group.all_gather(flag))
            if flag:
                self._preempted.set()
        return flag

    # -- life cycle ---------------------------------------------------------------------------------
    def delete(self, step: int) -> None:
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
            if self._old_handler is not None:
                signal.signal(signal.SIGTERM, self._old_handler)
                self._old_handler = None

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _find_best(policy: PreservationPolicy) -> BestN | None:
    if isinstance(policy, BestN):
        return policy
    for p in getattr(policy, "policies", ()):
        found = _find_best(p)
        if found is not None:
            return found
    return None
