"""Lightning's ``ModelParallelStrategy`` (FSDP2 ``fully_shard``, tensor parallelism) saving to tierfs.

Exported by :mod:`tierfs.adapters.lightning` as ``TieredModelParallelStrategy``; see ``docs/lightning.md``.

Lightning's strategy bypasses ``CheckpointIO``: every rank calls ``dcp.save`` into a directory and rank 0
``torch.save``s the rest to ``meta.pt``. This subclass saves the same sharded state (``{"state_dict": ...,
"optimizer_<i>": ...}``, as Lightning builds it) through :class:`~tierfs.adapters.dcp.TieredWriter` as step
``checkpoint["global_step"]`` of a collective store over the job's ranks, and the rest of global rank 0's
checkpoint dict with the ``TieredCheckpointIO`` codec (tensors as arrays, JSON, and ``torch.save`` bytes
that must load with ``weights_only=True``) as extra entries of rank 0's shard (``x|c/...``), beside the
path record (``x|lightning``). It loads through :class:`~tierfs.adapters.dcp.TieredReader` into the model
and the optimizers as Lightning's own ``load_checkpoint`` does.
"""

from __future__ import annotations

import datetime
import json
import logging
from typing import Any, Literal, Mapping, Optional, Sequence, Union

import lightning
import numpy as np
import torch.distributed.checkpoint as dcp
from lightning.pytorch.strategies import ModelParallelStrategy

from ... import state as st
from ...errors import ArgumentError, StepNotFoundError, TierfsError
from ...store import TieredStore
from ...tiers.base import AnyTier
from ..dcp import EXTRA_PREFIX, TieredReader, TieredWriter
from ..dcp.metadata import as_tensor
from . import codec
from .checkpointio import TieredCheckpointIO
from .common import norm

log = logging.getLogger("tierfs")

INFO = "lightning"  # extra entry of rank 0's shard: JSON text of {"paths": [...], "global_step": ..., ...}
REST = "c/"  # prefix of the codec's entries (the checkpoint without its sharded model and optimizer states)


class _ShardedBook(TieredCheckpointIO):
    """``TieredCheckpointIO``'s path bookkeeping (paths -> steps, aliases, deferred removals, teardown) over a
    collective store of the job's ranks. Never used as a ``CheckpointIO``."""

    @property
    def store(self) -> TieredStore:
        if self._store is None:  # the default group: torch.distributed's ranks (every rank cleans its part)
            self._store = TieredStore(self.tiers, **self.store_options)
        return self._store

    def _step_paths(self, store: TieredStore, step: int) -> list[str]:
        # the record is a JSON entry of rank 0's manifest (inline: no shard file is read)
        manifest, _ = store.read_manifest(step, 0)
        for e in manifest.entries:
            if e.name == EXTRA_PREFIX + INFO and e.kind == "json" and isinstance(e.value, str):
                return list(json.loads(e.value).get("paths", []))
        return []


class TieredModelParallelStrategy(ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` whose checkpoints go to tierfs tiers (see ``docs/lightning.md``).

    Parameters
    ----------
    tiers, blocking, trust_pickle, remove_from, **store_options:
        As for :class:`~tierfs.adapters.lightning.TieredCheckpointIO` (``group`` is not accepted: the store
        is over the job's ranks, torch.distributed's default group).
    data_parallel_size, tensor_parallel_size, process_group_backend, timeout:
        Passed to ``ModelParallelStrategy``. Checkpoints are always sharded (``save_distributed_checkpoint``
        is True).
    """

    def __init__(self, tiers: Sequence[AnyTier], *, blocking: bool = False, trust_pickle: bool = False,
                 remove_from: str | Sequence[str] | None = "all",
                 data_parallel_size: Union[Literal["auto"], int] = "auto",
                 tensor_parallel_size: Union[Literal["auto"], int] = "auto",
                 process_group_backend: Optional[str] = None,
                 timeout: Optional[datetime.timedelta] = None, **store_options: Any) -> None:
        if "group" in store_options:
            raise ArgumentError("TieredModelParallelStrategy's store is over all ranks of the job; do not pass group=")
        kwargs: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
        super().__init__(data_parallel_size=data_parallel_size, tensor_parallel_size=tensor_parallel_size,
                         save_distributed_checkpoint=True, process_group_backend=process_group_backend, **kwargs)
        self.tiered = _ShardedBook(tiers, blocking=blocking, trust_pickle=trust_pickle, remove_from=remove_from,
                                   **store_options)
        self.last_restore_info: Any = None  # after a load: {"step", "sources", "skipped"}

    @property
    def store(self) -> TieredStore:
        """The collective store (opened by the first save or load; every rank must reach it together)."""
        return self.tiered.store

    # -- saving ---------------------------------------------------------------------------------------
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any,
                        storage_options: Optional[Any] = None) -> None:
        if storage_options is not None:
            raise TypeError("TieredModelParallelStrategy.save_checkpoint takes no storage_options (tiers have theirs)")
        key = norm(self.broadcast(filepath))
        step = checkpoint.get("global_step")
        if type(step) is not int or step < 0:
            raise ArgumentError(f"checkpoint for {key!r} has no global_step (an int >= 0): {step!r}")
        book = self.tiered
        store = book.store
        store.raise_background_errors()
        book._flush_removals()
        rest = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        sharded = {"state_dict": checkpoint["state_dict"],
                   **{f"optimizer_{i}": o for i, o in enumerate(checkpoint.get("optimizer_states", []))}}
        # rank 0 decides (alias, overwrite) and encodes the rest; every rank learns the outcome at once
        decision: tuple[bool, bool, str | None] = (False, False, None)
        extra: dict[str, Any] = {}
        own_error: BaseException | None = None
        if self.global_rank == 0:
            try:
                alias = step in book._saved or (step == book._restored and store.has_step(step))
                overwrite = store.has_step(step)
                if not alias:
                    state, summary = codec.encode(rest, book.trust_pickle)
                    info = {"paths": [key], "format": codec.FORMAT, "global_step": step,
                            "epoch": rest.get("epoch") if type(rest.get("epoch")) is int else None,
                            "lightning_version": lightning.__version__, **summary}
                    extra = {INFO: json.dumps(info), **{REST + k: v for k, v in state.items()}}
                decision = (alias, overwrite, None)
            except Exception as e:
                decision, own_error = (False, False, f"{type(e).__name__}: {e}"), e
        alias, overwrite, failure = self.broadcast(decision)
        if failure is not None:
            if own_error is not None:
                raise own_error
            raise TierfsError(f"rank 0 could not save step {step} ({failure}); nothing saved")
        if alias:
            log.debug("%s: step %d is already saved; recorded as another name of it", key, step)
            book._paths[key] = step
            return
        if overwrite:
            log.info("step %d exists from an earlier run (this run restored %s); replacing it", step, book._restored)
        writer = TieredWriter(store, step, overwrite=overwrite, force=False, blocking=book.blocking, extra=extra)
        dcp.save(sharded, storage_writer=writer)
        if not writer.saved:
            log.info("%s: no tier's save policy takes step %d; not saved", key, step)
            return
        book._saved.add(step)
        book._paths[key] = step

    def remove_checkpoint(self, filepath: Any) -> None:
        """Every rank drops ``filepath`` (``ModelCheckpoint`` calls this on all ranks): each deletes its part
        of the step, as ``TieredCheckpointIO.remove_checkpoint`` says (deferred, never racing a save)."""
        self.tiered.remove_checkpoint(filepath)

    # -- loading --------------------------------------------------------------------------------------
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Load the step saved as ``checkpoint_path`` (resolved on rank 0 as ``TieredCheckpointIO.resolve``
        does) into the model and optimizers; return the rest of the checkpoint (loops, callbacks, ...)."""
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                             get_optimizer_state_dict, set_optimizer_state_dict)

        book = self.tiered
        store = book.store
        store.raise_background_errors()
        key = norm(self.broadcast(checkpoint_path))
        found: tuple[int | None, str | None] = (None, None)
        own_error: BaseException | None = None
        if self.global_rank == 0:
            try:
                found = (book.resolve(key), None)
            except Exception as e:
                found, own_error = (None, f"{type(e).__name__}: {e}"), e
        step, failure = self.broadcast(found)
        if failure is not None or step is None:
            if own_error is not None:
                raise own_error
            raise StepNotFoundError(f"rank 0 found no step for {key!r}: {failure}")
        if step in book._saved:
            store.wait_until_committed()
        self.barrier("tierfs load")  # every rank's part of a step this run saved is committed

        assert self.model is not None and self.lightning_module is not None
        module = self.model
        sources: dict[int, str] = {}
        skipped: list[Any] = []

        def load(state: dict[str, Any]) -> None:
            reader = TieredReader(store, step)
            dcp.load(state, storage_reader=reader)
            sources.update(reader.sources)
            skipped.extend(reader.skipped)

        # as Lightning's own sharded load (lightning.fabric.strategies.model_parallel._load_checkpoint)
        module_state = {"state_dict": get_model_state_dict(module)}
        load(module_state)
        module.load_state_dict(module_state["state_dict"], strict=self.lightning_module.strict_loading)
        for idx, optim in enumerate(self.optimizers):
            name = f"optimizer_{idx}"
            optim_state = {name: get_optimizer_state_dict(module, optim)}
            load(optim_state)
            set_optimizer_state_dict(module, optim, optim_state_dict=optim_state[name],
                                     options=StateDictOptions(cpu_offload=True))

        allow = book.trust_pickle or weights_only is False
        if weights_only is False and not book.trust_pickle:
            log.warning("loading step %d with weights_only=False: stored Python objects are fully unpickled", step)
        ckpt = codec.decode(_read_rest(store, step), allow_unpickle=allow)
        book._paths[key] = step
        book._restored = step
        store.resume_from(step)
        self.last_restore_info = {"step": step, "sources": sources, "skipped": skipped}
        return ckpt

    # -- life cycle -----------------------------------------------------------------------------------
    def teardown(self) -> None:
        """Lightning's teardown, then wait for every save's background work, apply pending removals and close
        the store (raising the first background error)."""
        try:
            super().teardown()
        finally:
            self.tiered.teardown()


def _read_rest(store: TieredStore, step: int) -> dict[str, Any]:
    """The codec's entries of rank 0's shard of ``step`` (from the fastest tier whose copy verifies)."""
    manifest, _ = store.read_manifest(step, 0)
    prefix = EXTRA_PREFIX + REST
    names = [e.name for e in manifest.entries if e.name.startswith(prefix)]
    if not names:
        raise TierfsError(f"step {step} was not saved by TieredModelParallelStrategy (no Lightning state in it)")
    got: dict[str, Any] = {}

    def consume(found: Mapping[str, tuple[Any, Any]], tier: str) -> None:
        for name, (e, raw) in found.items():
            if e.kind == "json":
                value = e.value
            elif e.lib == "torch":
                value = as_tensor(e, raw).clone()  # raw is lent for this call only
            else:
                value = np.array(st.view_as("numpy", e.dtype, e.shape, raw))
            got[name[len(prefix):]] = value

    store.read_entries(step, 0, names, consume=consume)
    return got

