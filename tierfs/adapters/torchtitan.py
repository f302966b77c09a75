"""torchtitan on tierfs: a checkpoint manager whose DCP saves and loads go through tierfs tiers.

    # in a torchtitan config registry function (Python config)
    from tierfs.adapters.torchtitan import TieredCheckpointManager
    config.checkpoint = TieredCheckpointManager.Config(
        enable=True, interval=100,
        tiers=lambda: [MemoryTier("/dev/shm/ckpt", keep=LatestN(2)),
                       ObjectTier("s3://bucket/run", save=FixedIntervalPolicy(1000))])
    # or, from the command line / TOML: a tierfs tiers config file (format: tierfs.config)
    config.checkpoint = TieredCheckpointManager.Config(enable=True, tiers_config="tiers.json")

The trainer builds whatever ``config.checkpoint`` holds (``config.checkpoint.build(dataloader=...,
model_parts=..., ...)``), so nothing else in torchtitan changes. Supported: torchtitan 0.3.0 (installed
with ``pip install --no-deps torchtitan==0.3.0 tyro``, see ``docs/torchtitan.md``). Importing
:mod:`tierfs` never imports torchtitan; importing this module does.

What changes against torchtitan's ``CheckpointManager``
-------------------------------------------------------
* ``dcp_save`` writes step ``N`` (from the checkpoint id ``<folder>/step-N``) with
  :class:`~tierfs.adapters.dcp.TieredWriter`; every tier takes it (``force=True``) unless
  ``tier_policies=True`` lets each tier's save policy decide.
* ``async_mode="async"`` saves with ``TieredWriter(blocking=False)``: ``dcp.save`` returns once the
  tensors are copied into the RAM tier's buffers (the model may change right away, unlike DCP's thread
  async, torchtitan #930); the future torchtitan waits on completes when the step is committed on the
  first tier. ``"async_with_pinned_mem"`` is rejected (it needs DCP's process stager).
* ``_load`` finds the newest step every rank can get (``store.common_steps()``) or ``load_step``,
  and reads it with :class:`~tierfs.adapters.dcp.TieredReader` (fastest verified copy). When the store
  holds no step, torchtitan's own initial load runs unchanged (``initial_load_path``, HF assets).
* Retention is the tiers' ``keep`` policies; ``keep_latest_k`` is not used (no purge of ``folder``).
* HF exports (``last_save_in_hf``) and HF/initial loads stay torchtitan's: plain files under ``folder``
  or ``initial_load_path``.
* The data loader's state (``states["dataloader"]``) is kept out of DCP, which would store the bytes
  torchtitan's ``ParallelAwareDataloader`` pickles (and ``torch.load(weights_only=False)`` them back): each
  rank's ``StatefulDataLoader`` state goes into its own shard as JSON and arrays
  (:mod:`tierfs.adapters.loaderstate`) and is given back by ``load()``. Steps whose loader state DCP holds
  (saved before) load as before.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import re
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed.checkpoint as dcp
from torchtitan.components.checkpoint import (DATALOADER, MODEL, AsyncMode,  # lazy: this module only
                                              CheckpointManager)
from torchtitan.tools.utils import GarbageCollection

from ..errors import ArgumentError, StateMismatchError, StepNotFoundError
from ..store import TieredStore
from ..tiers.base import AnyTier
from . import loaderstate
from .dcp import TieredReader, TieredWriter
from .dcp.metadata import META_KEY

log = logging.getLogger("tierfs")

__all__ = ["TieredCheckpointManager", "SUPPORTED_TORCHTITAN"]

SUPPORTED_TORCHTITAN = "0.3.0"

_STEP = re.compile(r"step-(\d+)$")


def _tiers_of(config: Any) -> list[AnyTier]:
    """The tiers the config names: ``tiers`` (a list, or a function returning one) or ``tiers_config``."""
    if config.tiers is not None and config.tiers_config:
        raise ArgumentError("TieredCheckpointManager.Config: give tiers or tiers_config, not both")
    if config.tiers is not None:
        tiers = config.tiers() if callable(config.tiers) else config.tiers
        return list(tiers)
    if config.tiers_config:
        from ..config import tiers_from_config

        return list(tiers_from_config(config.tiers_config))
    raise ArgumentError("TieredCheckpointManager.Config needs tiers= (a list of tiers or a function "
                        "returning one) or tiers_config= (a tierfs tiers JSON file)")


class TieredCheckpointManager(CheckpointManager):
    """torchtitan's DCP ``CheckpointManager`` with its checkpoints in a :class:`~tierfs.TieredStore`.

    Built by torchtitan from ``config.checkpoint`` (``Config.build(...)``) with the same keyword
    arguments as ``CheckpointManager``; ``store=`` may pass an open store instead of the config's tiers
    (the manager then does not close it).

    Attributes
    ----------
    store : TieredStore
        The store (None while checkpointing is disabled).
    last_reader : TieredReader or None
        The reader of the last tiered load (``sources``: the tier that served each saving rank).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        tiers: Sequence[Any] | Callable[[], Sequence[Any]] | None = None
        """tierfs tiers, or a function returning them (called once per process, when the manager is
        built: tiers are opened by the store and cannot be shared)."""

        tiers_config: str = ""
        """A tierfs tiers config file (JSON, see ``tierfs.config``), instead of ``tiers``."""

        tier_policies: bool = False
        """Let each tier's save policy decide whether it takes a step (default: every tier takes every
        checkpoint torchtitan saves)."""

        store_timeout: float | None = None
        """Seconds the store waits for other ranks (default: the store's)."""

        def __post_init__(self) -> None:
            CheckpointManager.Config.__post_init__(self)
            if self.async_mode == "async_with_pinned_mem":
                raise ValueError("TieredCheckpointManager: async_mode='async_with_pinned_mem' is not "
                                 "supported; use 'async' (tierfs stages into its RAM tier itself)")

    def __init__(self, config: Config, *, store: TieredStore | None = None, **kwargs: Any) -> None:
        self.store: TieredStore | None = None
        self.last_reader: TieredReader | None = None
        self._own_store = False
        self._waiter: concurrent.futures.ThreadPoolExecutor | None = None
        super().__init__(config, **kwargs)
        if not self.enable:
            return
        self.force = not config.tier_policies
        if store is not None:
            self.store = store
        else:
            self.store = TieredStore(_tiers_of(config), timeout=config.store_timeout)
            self._own_store = True
        self._waiter = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tierfs-titan")

    # -- the step a checkpoint id names --------------------------------------------------------------
    def _tiered_step(self, checkpoint_id: str) -> int | None:
        """Step ``N`` when ``checkpoint_id`` is this manager's ``<folder>/step-N``; None otherwise (an
        initial load path, an HF directory)."""
        m = _STEP.search(str(checkpoint_id).rstrip("/"))
        if m is None or os.path.normpath(os.path.dirname(str(checkpoint_id).rstrip("/"))) != \
                os.path.normpath(self.folder):
            return None
        return int(m.group(1))

    # -- save ------------------------------------------------------------------------------------------
    @torch.no_grad()
    def dcp_save(self, state_dict: dict[str, Any], checkpoint_id: str, async_mode: Any,
                 enable_garbage_collection: bool = False, to_hf: bool = False) -> Any:
        step = None if to_hf else self._tiered_step(checkpoint_id)
        if step is None or self.store is None:
            return super().dcp_save(state_dict, checkpoint_id, async_mode, enable_garbage_collection, to_hf)
        store = self.store
        blocking = async_mode != AsyncMode.ASYNC
        extra = None
        if state_dict.get(DATALOADER) is not None:  # this rank's loader state: JSON and arrays, not DCP's pickle
            extra = loaderstate.dcp_extra({DATALOADER: _Unpickled(state_dict[DATALOADER])})
            state_dict = {k: v for k, v in state_dict.items() if k != DATALOADER}
        writer = TieredWriter(store, step, force=self.force, overwrite=True, blocking=blocking, extra=extra)
        dcp.save(state_dict, storage_writer=writer)
        if enable_garbage_collection:
            GarbageCollection.collect("GC collection invoked by checkpointer.")
        if blocking:
            return None

        def committed() -> None:
            store.wait_until_committed()
            store.raise_background_errors()

        assert self._waiter is not None
        return self._waiter.submit(committed)

    def _should_purge(self) -> bool:
        return False  # retention: the tiers' keep policies

    # -- load ------------------------------------------------------------------------------------------
    def _find_load_step(self, folder: str = "") -> int:
        if folder or self.store is None:
            return super()._find_load_step(folder)
        common = self.store.common_steps(raise_lost=True)  # steps only some ranks can get: CheckpointLostError
        return common[-1] if common else -1

    @torch.no_grad()
    def _load(self, step: int = -1) -> bool:
        assert self.store is not None
        load_step = self._find_load_step() if step == -1 else step
        if load_step == -1:  # nothing in the store: torchtitan's initial load (or a fresh start)
            return bool(super()._load(-1))
        if step != -1 and step not in self.store.common_steps():
            raise StepNotFoundError(f"--checkpoint.load_step={step} is not held by every rank in the tiers "
                                    f"{[t.name for t in self.store.tiers]} (steps: {list(self.store.steps())})")
        states = self._states_to_load(load_step == 0)
        self.dcp_load(states, checkpoint_id=self._create_checkpoint_id(load_step), from_hf=False,
                      from_quantized=False)
        GarbageCollection.collect("GC collection for checkpoint loading.")
        return True

    def dcp_load(self, state_dict: dict[str, Any], checkpoint_id: str, from_hf: bool,
                 from_quantized: bool) -> None:
        step = None if from_hf else self._tiered_step(checkpoint_id)
        if step is None or self.store is None:
            return super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
        loader = state_dict.get(DATALOADER)
        if loader is not None and not self._loader_in_dcp(step):
            state_dict = {k: v for k, v in state_dict.items() if k != DATALOADER}
        else:
            loader = None  # not saved, or saved inside DCP (before tierfs kept it out): DCP loads it
        reader = TieredReader(self.store, step)
        dcp.load(state_dict, storage_reader=reader)
        if loader is not None:
            saved = loaderstate.read_dcp(self.store, step)
            if saved is None:
                log.warning("tierfs: torchtitan step %d holds no data loader state; the loader starts afresh", step)
            else:
                loaderstate.load({DATALOADER: _Unpickled(loader)}, saved, step)
        self.last_reader = reader
        log.info("tierfs: loaded torchtitan step %d from %s", step, reader.sources)
        if MODEL in self.states:
            self.states[MODEL].load_state_dict(state_dict)
        return None

    def _loader_in_dcp(self, step: int) -> bool:
        """Whether ``step`` holds the data loader's state as DCP items (saved before tierfs kept it out)."""
        assert self.store is not None
        meta = self.store.read_manifest(step, 0)[0].metadata.get(META_KEY) or {}
        return any(str(k).startswith(DATALOADER + ".") for k in meta.get("state_dict_metadata", {}))

    # -- end -------------------------------------------------------------------------------------------
    def _close(self) -> None:
        try:
            super()._close()
            future: Any = getattr(self, "save_future", None)
            if future is not None:
                future.result()
                self.save_future = None
        finally:
            if self._waiter is not None:
                self._waiter.shutdown(wait=True)
                self._waiter = None
            if self.store is not None and self._own_store:
                self.store.close()
            self.store = None


class _Unpickled:
    """A torchtitan data loader's state without its pickle: ``ParallelAwareDataloader.state_dict()`` pickles
    the ``StatefulDataLoader`` state (``{"dp_rank_<r>": pickle bytes, "world_size": n}``); this takes that
    state from ``StatefulDataLoader`` itself, with the data-parallel world size it was saved with, and gives
    it back the same way (a loader of another kind: its own ``state_dict``/``load_state_dict``)."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def _plain(self) -> Any:
        from torchdata.stateful_dataloader import StatefulDataLoader

        is_titan = hasattr(self.loader, "dp_world_size") and hasattr(self.loader, "_rank_id")
        return StatefulDataLoader if is_titan and isinstance(self.loader, StatefulDataLoader) else None

    def state_dict(self) -> Any:
        base = self._plain()
        if base is None:
            return self.loader.state_dict()
        return {"world_size": self.loader.dp_world_size, "state": base.state_dict(self.loader)}

    def load_state_dict(self, sd: Any) -> None:
        base = self._plain()
        if base is None:
            self.loader.load_state_dict(sd)
            return
        if sd.get("world_size") != self.loader.dp_world_size:
            raise StateMismatchError(f"the data loader was saved with {sd.get('world_size')} data-parallel ranks, this "
                                f"job has {self.loader.dp_world_size}: torchtitan cannot reshard a loader's state")
        base.load_state_dict(self.loader, sd["state"])
