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
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from .. import state as st
from ..dist import agree, outcomes, ranks_failed
from . import _torchstate as ts
from ..errors import (RestoreError, StateMismatchError, StepNotFoundError,
                      TierfsError)
from ..policies import (AnyPreservationPolicy, BestN, EveryNSteps, FixedIntervalPolicy, LatestN,
                        PreservationPolicy, PreserveAll, RestorePolicy, StepInfo)
from ..store import RestoreInfo, TieredStore
from ..tiers import ObjectTier
from ..tiers.base import Holder

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
    use_dcp:
        How torch state is saved. ``None`` (the default): a state holding at least one ``torch.Tensor``
        (DTensor and other subclasses included) goes through PyTorch Distributed Checkpoint (``dcp.save``
        with :class:`~tierfs.adapters.dcp.TieredWriter`), so sharded states (FSDP2, DTensor) work and load
        with another world size; a state without tensors (numpy, JSON) goes to the store directly.
        ``True``: every state through DCP (needs torch). ``False``: never (tensors are saved whole per
        rank; DTensors are rejected). Restores read each step in the format it was saved in.
    **store_options:
        Passed to ``TieredStore`` (``max_in_flight``, ``when_busy``, ``background_bandwidth``, ...).
    """

    def __init__(self, tiers: Sequence[Holder] | None = None, *, directory: str | None = None,
                 options: CheckpointManagerOptions | None = None,
                 storage_options: Mapping[str, Any] | None = None,
                 restore_policy: RestorePolicy | None = None, handle_sigterm: bool = False,
                 use_dcp: bool | None = None, **store_options: Any) -> None:
        if use_dcp not in (None, True, False):
            raise ValueError(f"use_dcp must be None (torch states through DCP), True or False, got {use_dcp!r}")
        self.use_dcp = use_dcp
        self.options = options or CheckpointManagerOptions()
        if (tiers is None) == (directory is None):
            raise ValueError("give CheckpointManager either a list of tiers or directory=URL, not both")
        if directory is not None:
            url = directory if "://" in directory else f"file://{directory}"
            tiers = [ObjectTier(url, storage_options, save=FixedIntervalPolicy(self.options.save_interval_steps),
                                keep=self.options.keep_policy())]
        assert tiers is not None
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
        earlier step replaces the steps it is redoing). Torch state goes through DCP (see ``use_dcp``);
        every rank of a job must call ``save`` with the same step.
        """
        if self._through_dcp(state):
            return self._save_dcp(step, state, metrics, force)
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

    def _through_dcp(self, state: Mapping[str, Any]) -> bool:
        if self.use_dcp is not None:
            if not self.use_dcp and ts.has_tensor(state, sharded_only=True):
                raise TypeError("the state holds DTensors/ShardedTensors, which only DCP can save: "
                                "use CheckpointManager(..., use_dcp=None or True)")
            return self.use_dcp
        return ts.has_tensor(state)

    def _save_dcp(self, step: int, state: Mapping[str, Any], metrics: Mapping[str, Any] | None,
                  force: bool) -> bool:
        """``dcp.save`` of the state's tensors through TieredWriter; the rest as JSON/arrays beside them."""
        import torch.distributed.checkpoint as dcp

        from .dcp import TieredWriter

        g = self.store.group
        err: BaseException | None = None
        tensors: dict[str, Any] = {}
        extra: dict[str, Any] = {}
        try:
            split = ts.split(state)
            tensors, extra = split.tensors, ts.extra(split)
            self.store.raise_background_errors()
        except Exception as e:  # noqa: BLE001 - every rank must hear of it before DCP's collectives
            err = e
        preempted = self._preempted.is_set()
        exists = self._exists(step)
        chosen = bool(self.store.should_save(step, force=force, preempted=preempted))
        if preempted and not force and not chosen:
            force, chosen = True, True  # no tier names a preemption policy: save everywhere
        # every rank must hear of a failure before DCP's collectives; rank 0 decides, as the store does
        views = agree(g, [exists, chosen, force, preempted], err, f"step {step}", outcome="nothing saved (the "
                      "state, or an earlier background failure)")
        exists = any(v[0] for v in views)
        _, chosen, force, preempted = views[0]
        if exists:
            if not self._replaces(step):
                return False
            log.info("step %d exists from before the restore of step %s; replacing it", step, self._restored)
        if not chosen:
            return False
        writer = TieredWriter(self.store, step, overwrite=exists, force=force, preempted=preempted,
                              metrics=metrics, blocking=not self.options.enable_async_checkpointing, extra=extra)
        ts.run_dcp(dcp.save, tensors, storage_writer=writer, process_group=g.process_group)
        return bool(writer.saved)

    def _exists(self, step: int) -> bool:
        return self.store.has_step(step)

    def _replaces(self, step: int) -> bool:
        return self._restored is not None and step > self._restored

    # -- restoring ----------------------------------------------------------------------------------
    def restore(self, state: Mapping[str, Any] | None = None, step: int | None = None) -> Any:
        """Restore the newest step (or ``step``).

        With ``state``: loads in place and returns the step, or None when there is nothing to restore.
        Without: returns the restored state (a nested dict), or None. Details are in ``last_restore_info``.
        Each step is read in the format it was saved in: steps saved through DCP with ``dcp.load`` and
        :class:`~tierfs.adapters.dcp.TieredReader` (DTensors are resharded to the target's placement;
        the job may have another world size), other steps by the store. When no tier holds a verified copy
        of the newest step, older steps are tried (not when ``step`` is given).
        """
        step = step if step is not None else self.restore_policy.step
        tiers = self.restore_policy.order([t.name for t in self.store.tiers])
        rep = self.store.replicator
        if rep is not None and rep.name in tiers:
            # collective: a rank whose RAM lacks its shard (a replaced node) gets it from a peer into RAM,
            # where DCP's reader (which reads tiers directly) and the store find it
            try:
                self.store.localize(step, tiers=tiers)
            except (StepNotFoundError, RestoreError) as e:
                log.warning("no step could be brought into RAM from peers (%s); restoring from the tiers", e)
        common = sorted(self.store.common_steps(tiers), reverse=True)
        if step is not None:
            if step not in common:
                raise StepNotFoundError(f"step {step} is not committed on {tiers} for every rank; available: "
                                        f"{sorted(common)[-10:]}")
            common = [step]
        if not common:
            return None
        skipped: list[tuple[str, int, str]] = []
        for s in common:
            try:
                if self._is_dcp_step(s, tiers):
                    out, info = self._restore_dcp(state, s, tiers)
                elif state is not None:
                    info = self.store.restore_into(state, s, tiers=tiers)
                    out = info.step
                else:
                    out, info = self.store.restore(s, tiers=tiers)
            except ts.Unusable as e:
                skipped += e.skipped
                continue
            except RestoreError as e:
                skipped.append((",".join(tiers), s, str(e)))
                continue
            info.skipped = skipped + [x for x in info.skipped if x not in skipped]
            self.last_restore_info = info
            self._restored = info.step
            return out
        reasons = "; ".join(f"{t} step {s}: {w}" for t, s, w in skipped)
        raise RestoreError(f"no tier holds a verified copy ({reasons})")

    def _is_dcp_step(self, step: int, tiers: list[str]) -> bool:
        """Whether ``step`` was saved through TieredWriter (every rank gets the same answer)."""
        from .dcp import SHARD_KEY

        g = self.store.group
        try:
            mine: bool | None = SHARD_KEY in self.store.read_manifest(step, g.rank, tiers=tiers)[0].metadata
        except (TierfsError, OSError, ValueError, KeyError):
            mine = None  # e.g. a rank beyond the saving job's world size
        views = g.all_gather(mine) if g.world_size > 1 else [mine]
        return any(v is True for v in views)

    def _restore_dcp(self, state: Mapping[str, Any] | None, step: int, tiers: list[str]) -> tuple[Any, RestoreInfo]:
        """``dcp.load`` of a step saved by :meth:`_save_dcp`, in place when ``state`` is given."""
        import torch.distributed.checkpoint as dcp

        from .dcp import TieredReader

        g = self.store.group
        t0 = time.perf_counter()
        err: BaseException | None = None
        saved: ts.Saved | None = None
        target: dict[str, Any] = {}
        try:
            saved = self._read_saved(step, tiers)
            if state is not None:
                split = ts.split(state)
                have = {ts.key(p) for p, _ in saved.plain}
                missing = [".".join(map(str, p)) for p, _ in split.plain if ts.key(p) not in have]
                if missing:
                    raise StateMismatchError(f"target state has entries the checkpoint lacks: {missing[:5]}")
                target = split.tensors
        except Exception as e:  # noqa: BLE001 - every rank must hear of it before DCP's collectives
            err = e
        views = outcomes(g, None, err, classify=ts.failure_kind)
        failed = {r: (kind, why, where) for r, (kind, why, where) in enumerate(views) if kind is not None}
        if failed:  # every rank takes the same way out: raise, or try an older step
            if any(kind != RestoreError.__name__ for kind, _, _ in failed.values()):
                if err is not None:
                    raise err
                raise ranks_failed(f"step {step}: loading", {r: v for r, v in failed.items()
                                                            if v[0] != RestoreError.__name__})
            raise ts.Unusable([(",".join(tiers), step, f"rank {r}: {why}") for r, (_, why, _) in failed.items()])
        assert saved is not None
        reader = TieredReader(self.store, step, tiers=tiers)
        pg = g.process_group
        if state is None:
            target = ts.target_from(ts.run_dcp(reader.read_metadata, unusable=True), saved)
        try:
            ts.run_dcp(dcp.load, target, storage_reader=reader, process_group=pg, unusable=True)
        except ts.Unusable as e:
            raise ts.Unusable(reader.skipped + [(",".join(tiers), step, w) for _, _, w in e.skipped]) from None
        root: Any = state if state is not None else target
        for path, value in saved.plain:
            ts.assign(root, path, ts.decode(value, saved.arrays))
        if state is None:
            root = ts.lists(root, saved.lists)
        tier = reader.sources.get(g.rank) or next(iter(reader.sources.values()), tiers[0])
        info = RestoreInfo(step, tier, ts.local_bytes(target), time.perf_counter() - t0, list(reader.skipped),
                           {}, dict(saved.metrics))
        return (step if state is not None else root), info

    def _read_saved(self, step: int, tiers: list[str]) -> "ts.Saved":
        """The non-tensor part of a DCP step: this rank's own (rank 0's for ranks the saving job lacked)."""
        from .dcp import EXTRA_PREFIX

        g = self.store.group
        world = self.store.read_marker(step, tiers=tiers).world_size
        rank = g.rank if g.rank < world else 0
        manifest, _ = self.store.read_manifest(step, rank, tiers=tiers)
        names = [e.name for e in manifest.entries if e.name.startswith(EXTRA_PREFIX)]
        got: dict[str, Any] = {}

        def consume(found: Mapping[str, tuple[Any, Any]], tier: str) -> None:
            for name, (e, raw) in found.items():
                got[name[len(EXTRA_PREFIX):]] = e.value if e.kind == "json" else \
                    np.array(st.view_as("numpy", e.dtype, e.shape, raw))

        self.store.read_entries(step, rank, names, tiers=tiers, consume=consume)
        index = got.get(ts.INDEX)
        if not (isinstance(index, list) and len(index) == 5 and index[:2] == [ts.INDEX_FORMAT, 1]):
            raise StateMismatchError(f"step {step} was saved by dcp.save directly, not by CheckpointManager: "
                                     "load it with dcp.load and TieredReader")
        arrays = {int(k[1:]): v for k, v in got.items() if k.startswith("a")}
        return ts.Saved([(list(p), v) for p, v in index[2]], [list(p) for p in index[3]],
                      {f: list(p) for f, p in index[4]}, arrays, dict(manifest.metrics))

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
