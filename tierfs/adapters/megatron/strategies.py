"""Megatron's ``torch_dist`` save and load strategies with the checkpoint in a :class:`~tierfs.TieredStore`
(see :mod:`tierfs.adapters.megatron`)."""

from __future__ import annotations

import dataclasses
import datetime
import functools
import logging
from typing import Any, Union, cast

import torch
import torch.distributed.checkpoint as dcp
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedStateDict, ShardedTensor, StateDict
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
from megatron.core.dist_checkpointing.strategies.base import StrategyAction, register_default_strategy
from megatron.core.dist_checkpointing.strategies.torch import (
    MCoreLoadPlanner,
    MCoreSavePlanner,
    TorchDistLoadShardedStrategy,
    TorchDistSaveShardedStrategy,
    _replace_sharded_keys_with_state_dict_keys,
    _replace_state_dict_keys_with_sharded_keys,
    _restore_dict_types,
    _unwrap_pyt_sharded_tensor,
    mcore_to_pyt_state_dict,
)
from torch.distributed.checkpoint import BytesStorageMetadata, Metadata, SavePlan

from ...util import args as _args
from ...errors import FormatError, TierfsError
from ...store import TieredStore
from .._torchstate import run_dcp
from ..dcp import TieredReader, TieredWriter
from ._files import FILES, read_side, side_items, step_of, write_dir

log = logging.getLogger("tierfs")

#: the sharded backend a TieredSaveStrategy's checkpoint names in its ``metadata.json``
BACKEND = "tierfs"
VERSION = 1

Timeout = Union[float, datetime.timedelta, None]


def _store(store: Any, who: str) -> TieredStore:
    return cast(TieredStore, _args.instance(store, f"{who} store", TieredStore, "a TieredStore"))


def _committed(store: TieredStore) -> None:
    """The finalize function of an asynchronous save: the step is committed in the first tier (else its
    failure, or any other of the store's background work, is raised here, on every rank)."""
    store.wait_until_committed()
    store.raise_background_errors()


class _SavePlanner(MCoreSavePlanner):
    """Megatron's save planner, its local plans without planner data when it has none: it flattens nothing,
    so DCP's global metadata has none (Megatron's plans carry an empty mapping, which TieredWriter's copy of
    the metadata would keep)."""

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        if not plan.planner_data:
            self.plan = plan = dataclasses.replace(plan, planner_data=None)
        return plan


class TieredSaveStrategy(TorchDistSaveShardedStrategy):
    """Megatron's ``torch_dist`` save strategy writing each checkpoint as a step of ``store``.

    ``dist_checkpointing.save(state, checkpoint_dir, sharded_strategy=TieredSaveStrategy(store))`` saves step
    ``N`` of the store, ``N`` being the number ``checkpoint_dir``'s name ends with (``iter_0000100``: 100).
    The sharded state is turned into DCP's as Megatron's own strategy turns it and saved with
    :class:`~tierfs.adapters.dcp.TieredWriter`; ``common.pt`` and ``metadata.json`` go into the step too.

    Parameters
    ----------
    store:
        The store; its ranks are the job's (the default process group).
    backend, version:
        What the checkpoint's ``metadata.json`` names; :class:`TieredLoadStrategy` loads what it wrote.
    keep_only_main_replica:
        As in Megatron's strategy, but off by default. ``False``: every replica reaches DCP, which plans each
        shard once, and with ``replicated="local"`` every rank also keeps the replicas it holds (data-parallel
        weights, tensors every tensor-parallel rank holds) in its own shard, so each node's RAM tier holds
        all its ranks need to load again; shared tiers still store each shard once. ``True`` (Megatron's
        default): only the main replica (``replica_id`` 0) is saved; a rank then loads the others' replicas
        from their shards, which after losing a node only a shared tier (object storage) still has.
    cached_metadata:
        As in Megatron's strategy (``use_cached_ckpt_structure``, which Megatron-LM sets from
        ``--ckpt-assume-constant-structure``): DCP's plan caching, one small exchange per save once the
        structure repeats.
    tier_policies:
        ``False`` (the default): every tier takes every checkpoint Megatron saves. ``True``: each tier's save
        policy decides (every ``N`` steps to RAM and peers, every ``M`` to object storage).
    replicated:
        Passed to :class:`~tierfs.adapters.dcp.TieredWriter` (``"local"`` or ``"dedup"``).
    timeout:
        Seconds (or a ``timedelta``) a save waits for the other ranks (default: the store's).

    Attributes
    ----------
    last_writer : TieredWriter or None
        The writer of the last save (``saved``: whether any tier took it).

    Notes
    -----
    ``async_save`` (``dist_checkpointing.save(..., async_sharded_save=True)``) returns Megatron's
    ``AsyncRequest`` once the tensors are copied into the first tier's buffers (training may change them at
    once); checksums and the commit run on the store's background thread, so the request carries no
    function for Megatron's worker process. Its finalize function waits for the commit in the first tier and
    raises a failure on every rank; copies to peers and object storage go on in the background.
    """

    def __init__(self, store: TieredStore, backend: str = BACKEND, version: int = VERSION, *,
                 keep_only_main_replica: bool = False, cached_metadata: bool = False, tier_policies: bool = False,
                 replicated: str = "local", timeout: Timeout = None) -> None:
        super().__init__(_args.name(backend, "backend"), _args.integer(version, "version"),
                         keep_only_main_replica=_args.flag(keep_only_main_replica, "keep_only_main_replica"),
                         cached_metadata=_args.flag(cached_metadata, "cached_metadata"))
        self.store = _store(store, "TieredSaveStrategy")
        self.tier_policies = _args.flag(tier_policies, "tier_policies")
        self.replicated = _args.choice(replicated, "replicated", ("local", "dedup"))
        self.timeout = timeout
        self.last_writer: TieredWriter | None = None

    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Any) -> None:
        """Save and return once the step is committed in the first tier (collective)."""
        self._write(sharded_state_dict, checkpoint_dir, blocking=True)

    def async_save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Any) -> AsyncRequest:
        """Stage the step and return the request whose finalize function waits for its commit (collective)."""
        self._write(sharded_state_dict, checkpoint_dir, blocking=False)
        return AsyncRequest(None, (), [functools.partial(_committed, self.store)])

    def _write(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Any, blocking: bool) -> TieredWriter:
        """Megatron's conversion (as ``TorchDistSaveShardedStrategy.async_save``), then ``dcp.save``."""
        step = step_of(checkpoint_dir)
        flat, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, self.keep_only_main_replica)
        state: dict[str, Any] = dict(mcore_to_pyt_state_dict(flat, False))
        if torch.distributed.get_rank() == 0:  # the rank that wrote common.pt
            state.update(side_items(checkpoint_dir, self.backend, self.version))
        writer = TieredWriter(self.store, step, overwrite=True, force=not self.tier_policies, blocking=blocking,
                              replicated=self.replicated, timeout=self.timeout)
        planner = _SavePlanner(dedup_replicated_tensors=not self.keep_only_main_replica, flatten_state_dict=False,
                               can_run_decentralized_global_plan=False,
                               enable_plan_caching=bool(self.use_cached_ckpt_structure))
        run_dcp(dcp.save, state, storage_writer=writer, planner=planner)
        self.last_writer = writer
        return writer


class TieredLoadStrategy(TorchDistLoadShardedStrategy):
    """Megatron's ``torch_dist`` load strategy reading checkpoints that :class:`TieredSaveStrategy` saved.

    ``dist_checkpointing.load(sharded_state_dict, checkpoint_dir, sharded_strategy=TieredLoadStrategy(store))``
    loads step ``N`` (the number ``checkpoint_dir``'s name ends with) from the fastest tier holding a verified
    copy, resharded to the layout of ``sharded_state_dict`` as Megatron's own strategy reshards.
    ``dist_checkpointing.load`` reads ``common.pt`` and ``metadata.json`` from ``checkpoint_dir`` first:
    :meth:`materialize` writes them there.

    Parameters
    ----------
    store:
        The store (the job's ranks).
    backend, version:
        The backend this strategy loads (what :class:`TieredSaveStrategy` wrote in ``metadata.json``).
    tiers:
        Read only from these tiers (default: all, fastest first).
    timeout:
        Seconds (or a ``timedelta``) a load waits for the other ranks (default: the store's).

    Attributes
    ----------
    last_reader : TieredReader or None
        The reader of the last load (``sources``: the tier that served each saving rank).
    """

    def __init__(self, store: TieredStore, backend: str = BACKEND, version: int = VERSION, *,
                 tiers: list[str] | None = None, timeout: Timeout = None) -> None:
        super().__init__()
        self.store = _store(store, "TieredLoadStrategy")
        self.backend = _args.name(backend, "backend")
        self.version = _args.integer(version, "version")
        self.tiers = _args.names(tiers, "TieredLoadStrategy tiers", [t.name for t in self.store.tiers])
        self.timeout = timeout
        self.last_reader: TieredReader | None = None

    def register(self) -> "TieredLoadStrategy":
        """Make this strategy Megatron's default for its backend: code that asks Megatron for the strategy a
        checkpoint needs (``get_default_load_sharded_strategy(checkpoint_dir)``, Megatron-LM's
        ``load_checkpoint``) then gets it. Returns the strategy."""
        register_default_strategy(StrategyAction.LOAD_SHARDED, self.backend, self.version, self)
        return self

    def materialize(self, root: Any, step: int | None = None) -> str | None:
        """Write step ``step`` (default: the newest every rank can get) as a checkpoint directory Megatron can load.

        Collective. Writes ``<root>/iter_<step>/`` with the step's ``common.pt`` and ``metadata.json`` and the
        tracker file ``<root>/latest_checkpointed_iteration.txt`` (Megatron-LM's layout) on every rank's
        machine; the tensors stay in the tiers. Returns the directory for ``dist_checkpointing.load``, or None
        when the store holds no step.
        """
        step = _args.optional_step(step)
        if step is None and not self.store.common_steps(self.tiers, timeout=self.timeout, raise_lost=True):
            return None
        reader = self._reader(step)
        md = reader.read_metadata()
        resolved = reader.resolved_step
        assert resolved is not None
        files = read_side(self.store, resolved, md.storage_data, self.tiers, self.timeout)
        return write_dir(root, resolved, files)

    def load(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Any) -> StateDict:
        """Load the sharded part (collective); Megatron's conversion, as ``TorchDistLoadShardedStrategy.load``."""
        step = step_of(checkpoint_dir)
        values = list(nested_values(sharded_state_dict))
        flexible = [t for t in values if isinstance(t, ShardedTensor) and not t.allow_shape_mismatch]
        mismatch = {t.key: t for t in values if isinstance(t, ShardedTensor) and t.allow_shape_mismatch}
        orig = sharded_state_dict
        flat, flat_mapping, rename_mapping = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict)
        state = mcore_to_pyt_state_dict(flat, True)
        reader = self._reader(step)
        planner = MCoreLoadPlanner(shapes_validation_sharded_tensors=flexible,
                                   allow_shape_mismatch_sharded_tensors=mismatch)
        run_dcp(dcp.load, state, storage_reader=reader, planner=planner)
        self.last_reader, self.cached_global_metadata = reader, reader.metadata
        self.store.resume_from(step)  # the next save supersedes the steps after it (the timeline rule)
        log.info("tierfs: loaded Megatron step %d from %s", step, reader.sources)
        unwrapped = {k: _unwrap_pyt_sharded_tensor(v) for k, v in state.items()}
        loaded = _replace_sharded_keys_with_state_dict_keys(unwrapped, flat_mapping, rename_mapping)
        _restore_dict_types(loaded, orig)
        return cast(StateDict, loaded)

    def load_tensors_metadata(self, checkpoint_dir: Any, metadata: Metadata | None = None) -> Any:
        """The checkpoint's tensors (shape and dtype, no data), as Megatron's strategy gives them (collective)."""
        return super().load_tensors_metadata(checkpoint_dir, metadata or self._metadata(checkpoint_dir))

    def load_sharded_metadata(self, checkpoint_dir: Any) -> Any:
        """The checkpoint's tensors and ``ShardedObject`` s, without data (collective)."""
        md = self._metadata(checkpoint_dir)
        out: dict[str, Any] = {}
        for key, what in md.state_dict_metadata.items():
            if isinstance(what, BytesStorageMetadata) and key not in FILES:
                obj = ShardedObject.empty_from_unique_key(key)
                out[obj.unique_key] = obj
        out.update(self.load_tensors_metadata(checkpoint_dir, md))
        return out

    def remove_sharded_tensors(self, checkpoint_dir: Any, key_prefix: str) -> None:
        """Not supported: raises :class:`~tierfs.errors.TierfsError` (a committed step never changes)."""
        raise TierfsError("remove_sharded_tensors: a committed tierfs step is never changed; load it and save "
                          "the state without those tensors as a new step")

    def check_backend_compatibility(self, loaded_version: Any) -> None:
        """Raise :class:`~tierfs.errors.FormatError` unless the backend a checkpoint's ``metadata.json`` names
        (Megatron passes it under this parameter name) is this strategy's."""
        if loaded_version != self.backend:
            raise FormatError(f"the checkpoint was saved by Megatron's {loaded_version!r} strategy, not "
                              f"TieredSaveStrategy ({self.backend!r}): load it with Megatron's own strategy")

    def check_version_compatibility(self, loaded_version: Any) -> None:
        """Raise :class:`~tierfs.errors.FormatError` for a format version newer than this strategy's."""
        if not isinstance(loaded_version, int) or loaded_version > self.version:
            raise FormatError(f"the checkpoint has format version {loaded_version!r}; this tierfs reads "
                              f"version {self.version} and older: upgrade tierfs")

    def _reader(self, step: int | None) -> TieredReader:
        return TieredReader(self.store, step, tiers=self.tiers, timeout=self.timeout)

    def _metadata(self, checkpoint_dir: Any) -> Metadata:
        return self._reader(step_of(checkpoint_dir)).read_metadata()


__all__ = ["TieredSaveStrategy", "TieredLoadStrategy", "BACKEND", "VERSION"]
