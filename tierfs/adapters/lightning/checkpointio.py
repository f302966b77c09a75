"""Lightning's ``CheckpointIO`` on tierfs: :class:`TieredCheckpointIO` (see :mod:`tierfs.adapters.lightning`)."""

from __future__ import annotations

import logging
import os
from typing import Any, Optional, Sequence

import lightning
import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO

from ...ranks.groups import SingleProcess
from ...errors import ArgumentError, RestoreError, StepNotFoundError, TierfsError
from ...store import TieredStore
from ...tiers.base import AnyTier
from . import codec
from .common import META_KEY, norm

log = logging.getLogger("tierfs")


def _global_rank() -> int:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return int(dist.get_rank())
    return int(os.environ.get("RANK", "0") or 0)


class TieredCheckpointIO(CheckpointIO):
    """A Lightning ``CheckpointIO`` that saves checkpoints to tierfs tiers.

    Parameters
    ----------
    tiers:
        The tiers, fastest first, each with its ``save=`` and ``keep=`` policies (as for ``TieredStore``).
        They are opened lazily, by the first save or load of the process.
    blocking:
        False (the default): ``save_checkpoint`` returns once the tensors are staged in the first tier;
        the commit and the copies run in the background. Their errors are raised by the next
        ``save_checkpoint`` or by ``teardown``.
    trust_pickle:
        False (the default): every Python object of the checkpoint that is neither a tensor nor JSON is
        stored as ``torch.save`` bytes and must load with ``torch.load(weights_only=True)``; one that
        would not is an error at save time. True: such objects are stored anyway and unpickled with
        ``weights_only=False`` on load (only if every writer of the tiers is trusted).
    remove_from:
        Which tiers ``remove_checkpoint`` (the callback's ``save_top_k``) deletes a step from: ``"all"``
        (the default), ``"first"`` (the RAM tier only: the slower tiers' keep policies decide), a list of
        tier names, or ``None`` (never: only the tiers' keep policies delete).
    **store_options:
        Passed to ``TieredStore`` (``max_in_flight``, ``when_busy``, ``background_bandwidth``, ...).
        ``group`` is not accepted: the store is always one process (only global rank 0 saves).
    """

    def __init__(self, tiers: Sequence[AnyTier], *, blocking: bool = False, trust_pickle: bool = False,
                 remove_from: str | Sequence[str] | None = "all", **store_options: Any) -> None:
        super().__init__()
        if "group" in store_options:
            raise ArgumentError("TieredCheckpointIO's store is one process (Lightning saves on global rank 0 "
                                "only); do not pass group=")
        if isinstance(remove_from, str) and remove_from not in ("all", "first"):
            raise ArgumentError(f"remove_from must be 'all', 'first', a list of tier names or None, "
                                f"got {remove_from!r}")
        if type(blocking) is not bool or type(trust_pickle) is not bool:
            raise ArgumentError("blocking and trust_pickle must be True or False")
        self.tiers = list(tiers)
        self.blocking = blocking
        self.trust_pickle = trust_pickle
        self.remove_from = remove_from
        self.store_options = dict(store_options)
        self._store: TieredStore | None = None
        self._paths: dict[str, int] = {}  # checkpoint path -> step (this process's saves and loads)
        self._saved: set[int] = set()  # steps this process saved (a second path for one is an alias)
        self._restored: int | None = None
        self._pending: list[int] = []  # steps the callback dropped, deleted once their save is finished
        self.last_restore_info: Any = None

    # -- the store ------------------------------------------------------------------------------------
    @property
    def store(self) -> TieredStore:
        """The store (opened on first use: global rank 0 cleans up interrupted saves, others only read)."""
        if self._store is None:
            reader_only = _global_rank() != 0
            self._store = TieredStore(self.tiers, group=SingleProcess(), cleanup=not reader_only,
                                      **self.store_options)
        return self._store

    def __getstate__(self) -> dict[str, Any]:  # ddp_spawn pickles the plugin: the store stays behind
        d = dict(self.__dict__)
        d["_store"] = None
        return d

    # -- CheckpointIO -----------------------------------------------------------------------------------
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Optional[Any] = None) -> None:
        if storage_options is not None:
            raise TypeError("TieredCheckpointIO.save_checkpoint takes no storage_options (tiers have theirs)")
        key = norm(path)
        step = checkpoint.get("global_step")
        if type(step) is not int or step < 0:
            raise ArgumentError(f"checkpoint for {key!r} has no global_step (an int >= 0): {step!r}")
        store = self.store
        store.raise_background_errors()
        self._flush_removals()
        if step in self._saved or (step == self._restored and store.has_step(step)):
            # e.g. last.ckpt right after epoch=0-step=50.ckpt, or the step this run resumed from
            log.debug("%s: step %d is already saved; recorded as another name of it", key, step)
            self._paths[key] = step
            return
        state, summary = codec.encode(checkpoint, self.trust_pickle)
        overwrite = store.has_step(step)
        if overwrite:
            log.info("step %d exists from an earlier run (this run restored %s); replacing it", step, self._restored)
        meta = {META_KEY: {"paths": [key], "format": codec.FORMAT, "global_step": step,
                           "epoch": checkpoint.get("epoch") if type(checkpoint.get("epoch")) is int else None,
                           "lightning_version": lightning.__version__, **summary}}
        saved = store.save(step, state, metadata=meta, overwrite=overwrite, blocking=self.blocking)
        if not saved:
            log.info("%s: no tier's save policy takes step %d; not saved", key, step)
            return
        self._saved.add(step)
        self._paths[key] = step

    def load_checkpoint(self, path: Any, map_location: Optional[Any] = None,
                        weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Load the checkpoint saved as ``path`` (or, for a ``last*.ckpt`` name no save recorded, the newest
        committed step) from the fastest tier holding a verified copy.

        ``weights_only=False`` passed explicitly (``trainer.fit(..., weights_only=False)``) allows full
        unpickling of stored Python objects, as does ``trust_pickle=True``; otherwise never.
        """
        store = self.store
        store.raise_background_errors()
        step = self.resolve(path)
        if store.has_step(step) and step in self._saved:
            store.wait_until_committed()
        state, info = store.restore(step)
        self.last_restore_info = info
        allow = self.trust_pickle or weights_only is False
        if weights_only is False and not self.trust_pickle:
            log.warning("loading step %d with weights_only=False: stored Python objects are fully unpickled", step)
        ckpt = codec.decode(state, allow_unpickle=allow, map_location=map_location)
        self._paths[norm(path)] = step
        self._restored = step
        return ckpt

    def remove_checkpoint(self, path: Any) -> None:
        """Drop ``path``; its step is deleted (from ``remove_from``) once no other path names it and its
        save is finished (never racing it: done by a later save or by ``teardown``)."""
        key = norm(path)
        step = self._paths.pop(key, None)
        if step is None or self.remove_from is None or step in self._paths.values():
            return
        self._saved.discard(step)
        self._pending.append(step)
        self._flush_removals()

    def teardown(self) -> None:
        """Wait for every save's background work, apply the pending removals, close the store; raise the
        first background error."""
        store, self._store = self._store, None
        if store is None:
            return
        try:
            store.wait_until_finished()
            self._flush_removals(store)
        finally:
            store.close()

    # -- paths and steps --------------------------------------------------------------------------------
    def last_checkpoint(self) -> str | None:
        """The checkpoint to resume from: the path saved as the newest committed step, or None when the tiers
        hold none. ``trainer.fit(model, ckpt_path=io.last_checkpoint())`` resumes when a checkpoint exists
        and starts afresh otherwise."""
        steps = sorted(self.store.steps(), reverse=True)
        if not steps:
            return None
        try:
            paths = self._step_paths(self.store, steps[0])
        except Exception as e:  # noqa: BLE001 - its load names the problem; a last* name resolves to it
            log.debug("step %d: no readable manifest (%s)", steps[0], e)
            paths = []
        return paths[0] if paths else "last.ckpt"

    def resolve(self, path: Any) -> int:
        """The step saved as ``path``: this process's record, else the newest step whose metadata names it
        (by full path, then by file name), else for a ``last*`` name the newest committed step. A newer step
        no tier can read (it may be the one saved as ``path`` last) is a RestoreError naming it, never a
        silent resume from an older one, unless ``path`` names its step (``epoch=1-step=200.ckpt``, as
        Lightning names checkpoints)."""
        key = norm(path)
        if key in self._paths:
            return self._paths[key]
        store = self.store
        steps = sorted(store.steps(), reverse=True)
        base = os.path.basename(key)
        by_name = unreadable = None
        for s in steps:
            try:
                paths = self._step_paths(store, s)
            except StepNotFoundError as e:  # deleted meanwhile (retention)
                log.debug("step %d: gone (%s)", s, e)
                continue
            except TierfsError as e:
                unreadable = unreadable or (s, e)
                continue
            if key in paths or (by_name is None and any(os.path.basename(p) == base for p in paths)):
                if unreadable is not None and f"step={s}" not in base:  # (a name of its step alone: that one)
                    raise RestoreError(f"checkpoint {key!r}: step {unreadable[0]} cannot be read ({unreadable[1]}) "
                                       f"and may be the one saved as it last; step {s} was saved as it before. "
                                       f"Load step {s} by a path only it was saved as (its ...step={s}.ckpt), or "
                                       f"repair step {unreadable[0]}")
                if unreadable is not None:
                    log.warning("checkpoint %s is step %d; step %d, newer, cannot be read (%s)", key, s,
                                unreadable[0], unreadable[1])
                if key in paths:
                    return s
                by_name = s
        if by_name is not None:
            return by_name
        if base.startswith("last") and steps:
            return steps[0]
        raise StepNotFoundError(f"no tier holds a checkpoint saved as {key!r}; committed steps: {sorted(steps)[-10:]}"
                                + (f"; step {unreadable[0]} cannot be read ({unreadable[1]}) and may be it"
                                   if unreadable is not None else ""))

    def _step_paths(self, store: TieredStore, step: int) -> list[str]:
        """The checkpoint paths recorded in ``step``'s metadata (raises when no tier can read it)."""
        meta = store.manifest(step).metadata.get(META_KEY) or {}
        return list(meta.get("paths", []))

    def _flush_removals(self, store: TieredStore | None = None) -> None:
        store = store or self._store
        if store is None or not self._pending:
            return
        names = [t.name for t in store.tiers if t.name in self._removal_tiers(store)]
        keep: list[int] = []
        for step in self._pending:
            if store.in_progress(step):  # its commit or a copy is under way: later
                keep.append(step)
                continue
            log.info("tiers %s: the checkpoint callback drops step %d", names, step)
            store.delete(step, names, wait=False)
        self._pending = keep

    def _removal_tiers(self, store: TieredStore) -> set[str]:
        if self.remove_from == "all":
            return {t.name for t in store.tiers}
        if self.remove_from == "first":
            return {store.tiers[0].name}
        return set(self.remove_from or ())

