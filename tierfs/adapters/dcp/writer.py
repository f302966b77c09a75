"""DCP's ``StorageWriter`` over a :class:`~tierfs.TieredStore`: a DCP save as one tierfs step (see
:mod:`tierfs.adapters.dcp` for what goes where and why the metadata is known before the write)."""

from __future__ import annotations

import dataclasses
import datetime
import io
import logging
import os
import uuid
from typing import Any, Mapping

import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from ... import state as st
from ...util import args as _args
from ...util import nogc as _nogc
from ...core.dataparallel import Sharing
from ...ranks import agree, seconds
from ...errors import ArgumentError, FormatError, TierfsError
from ...format import DCP_EXTRA_PREFIX, DCP_SHARD_KEY, entry_name_problem, shown_name, user_key
from ...store import TieredStore
from .metadata import (META_KEY, META_VERSION, cached_local_items, caching, check_kwargs, done, dtype_name,
                       entry_name, full_global_plan, metadata_from_plans, metadata_to_json, parse_step,
                       with_dtypes)
from .reader import TieredReader
from .sharing import HELD, SHARED, held, plan_sharing, sharing_of

log = logging.getLogger("tierfs")

SHARD_KEY = DCP_SHARD_KEY  # in every rank's manifest metadata: the shard was written by TieredWriter
EXTRA_PREFIX = DCP_EXTRA_PREFIX  # entries given by TieredWriter(extra=...); DCP's start with digits, "|" or "b|"


class TieredWriter(StorageWriter):
    """DCP ``StorageWriter`` that saves a checkpoint as step ``step`` of ``store`` (see
    :mod:`tierfs.adapters.dcp`).

    Parameters
    ----------
    store:
        The store; its ranks must be the ranks of the process group DCP saves with.
    step:
        The step number (``checkpoint_id`` given to ``dcp.save`` replaces it).
    overwrite:
        Replace a step that is already committed (without it, an existing step is an error).
    force:
        ``True`` (the default): every tier takes the step, its save policy is not asked (DCP saves when
        the caller says so). ``False``: each tier's save policy decides, as in ``store.save``; when no
        tier takes the step nothing is written and :attr:`saved` is False.
    preempted:
        Passed to the save policies (``PreemptionCheckpointingPolicy``).
    metrics:
        JSON metrics stored with the step (``BestN`` retention and ``CheckpointManager.best_step`` use them).
    blocking:
        ``True``: ``write_data`` returns once the step is committed on the first tier. ``False``: it
        returns once this rank's tensors are copied into the first tier's buffers; checksums and the
        commit follow in the store's background worker (the caller may change its tensors right away;
        ``store.wait_until_finished()`` waits for the commit and raises its failure).
    extra:
        Flat ``{name: value}`` of further entries for this rank's shard (numpy arrays, JSON values),
        stored under ``"x|" + name`` beside DCP's items and never seen by DCP (no pickle).
        ``CheckpointManager`` keeps non-tensor state here.
    replicated:
        ``"local"`` (the default): a tensor several ranks hold (replicated, e.g. data-parallel weights or
        Adam's step counts) is also kept in the shard of every rank that holds it, not only in the one
        rank's DCP picks, so each node's RAM tier holds all its ranks need to load again without reading
        other nodes' shards. Shared tiers still store it once (in the shard of the rank DCP planned it
        on, so the upload is spread as DCP spreads the items), peers do not replicate it (other nodes
        hold it), and a restore gets it from a rank that holds it. DCP's metadata is unchanged;
        ``TieredReader`` reads such items from the rank's own shard. ``"dedup"``: each item is written
        once, as DCP plans it (less RAM; a load on several nodes then reads replicated items from the
        durable tier).
    timeout:
        Seconds (or a ``timedelta``) the save waits for the other ranks (default: the store's timeout);
        past it a RankWaitError names the stage and the rank(s) waited for.
    overlap:
        ``store.save``'s: the optimizer(s) whose parameters and state may still be copying from GPU
        memory when the save returns (with ``blocking=False``); see the GPU guide.

    Notes
    -----
    Every argument is checked here, each a one-line :class:`~tierfs.errors.ArgumentError`. Failures inside
    ``dcp.save`` come out of it as DCP's ``CheckpointException`` (the original error in its ``failures``).
    """

    def __init__(self, store: TieredStore, step: int, *, overwrite: bool = False, force: bool = True,
                 preempted: bool = False, metrics: Mapping[str, Any] | None = None, blocking: bool = True,
                 extra: Mapping[str, Any] | None = None, replicated: str = "local",
                 timeout: float | datetime.timedelta | None = None, overlap: Any = None) -> None:
        super().__init__()
        self.overlap = overlap  # store.save's: the optimizers (or tensors) whose copies may run on
        self.store = _args.instance(store, "TieredWriter store", TieredStore, "a TieredStore")
        self.step = _args.step(step)
        self.timeout = None if timeout is None else seconds(timeout)
        self.replicated = _args.choice(replicated, "replicated", ("local", "dedup"))
        self.overwrite, self.force, self.preempted, self.blocking = (_args.flag(v, k) for k, v in (
            ("overwrite", overwrite), ("force", force), ("preempted", preempted), ("blocking", blocking)))
        self.metrics = _args.jsonable(metrics, "metrics") if metrics is not None else None
        if extra is not None:
            bad = [k for k in _args.mapping(extra, "extra") if not isinstance(k, str)][:3]
            if bad:
                raise ArgumentError(f"TieredWriter extra= needs str names, got {bad}")
            for k, v in extra.items():
                why = entry_name_problem(EXTRA_PREFIX + k)
                if why is not None:
                    raise ArgumentError(f"state key {shown_name(k)} cannot be saved: {why}; rename it")
                st.check_leaf(k, v)
        self.extra = {EXTRA_PREFIX + k: v for k, v in (extra or {}).items()}
        self.save_id = uuid.uuid4().hex
        self.is_coordinator = False
        self.saved: bool | None = None  # after write_data: whether any tier took the step
        #: after write_data: ``(entry name, fqn)`` of each tensor this rank wrote, in order (None when the
        #: shard holds anything else, e.g. bytes items), and the metadata of its manifest: what it takes
        #: to write the same shard again without DCP (CheckpointManager does, for an unchanged structure)
        self.written: list[tuple[str, str]] | None = None
        self.shard_metadata: dict[str, Any] = {}
        #: after write_data: which of this rank's items other ranks hold too, and who stores each
        self.sharing: Sharing | None = None
        self._clear()

    def _clear(self) -> None:
        """Forget the last save's plans and metadata."""
        self._local_items: list[Any] | None = []  # None: DCP's plan cache has them (see write_data)
        self._deltas: list[SavePlan] | None = None  # the coordinator's global plans from DCP, maybe deltas
        self._plans: list[SavePlan] | None = None  # the coordinator's full final global plans
        self._base_json: dict[str, Any] | None = None  # metadata derived from _plans: DCP's must equal it
        self._metadata_json: dict[str, Any] | None = None  # what is stored: _base_json with the dtypes written

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.step = parse_step(checkpoint_id)
        self.save_id = uuid.uuid4().hex
        self.saved = None
        self._clear()

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return TieredReader.validate_checkpoint_id(checkpoint_id)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=f"step_{self.step:012d}", save_id=self.save_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        rank = kwargs.pop("rank", None)
        if not kwargs.pop("use_collectives", True):
            raise ArgumentError("TieredWriter needs use_collectives=True: a tierfs step commits only once every "
                                "rank's shard is written")
        check_kwargs("TieredWriter.set_up_storage_writer", args, kwargs)
        g = self.store.group
        if rank is not None and rank != g.rank:
            raise ArgumentError(f"DCP rank {rank} is not the store's rank {g.rank}: save with a process group "
                                "over the same ranks as the store's (the default group)")
        self.is_coordinator = bool(is_coordinator)
        self._clear()  # a writer saved with again without reset() starts afresh

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        # the items before DCP drops replicated ones from all ranks but one; a caching planner's unchanged
        # plan comes without items (usable=False): write_data takes them from DCP's cache
        self._local_items = list(plan.items) if plan.usable else None
        data: dict[str, Any] = {"tierfs_rank": self.store.group.rank}
        if plan.usable and self.replicated == "local":  # for the coordinator: which items other ranks hold too
            data[HELD] = held(plan.items)
        return dataclasses.replace(plan, storage_data=data)

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        if len(plans) != self.store.group.world_size:
            raise ArgumentError(f"DCP planned {len(plans)} ranks, the store has {self.store.group.world_size}: "
                                "use a process group over the store's ranks (and use_collectives=True)")
        self._deltas = list(plans)
        if all(p.usable for p in plans):  # else deltas of a caching planner: write_data derives it
            # objects per item of every rank: at thousands of ranks, collections would walk them again and again
            with _nogc.paused():
                self._derive(self._deltas)  # fails now, before anything is written, if it cannot be stored
                # each rank's replicated items, by owner (a caching planner keeps this in its final plans)
                ranks = [p.storage_data["tierfs_rank"] for p in plans]
                shares = plan_sharing(plans, ranks, self.save_id)
                plans = [dataclasses.replace(p, storage_data={"tierfs_rank": r, SHARED: sh})
                         for p, r, sh in zip(plans, ranks, shares)]
        return plans

    def _derive(self, plans: list[SavePlan]) -> None:
        """The metadata of the full final global plans (coordinator)."""
        ranks = [p.storage_data["tierfs_rank"] if isinstance(p.storage_data, dict) else i
                 for i, p in enumerate(plans)]
        self._base_json = self._metadata_json = metadata_to_json(metadata_from_plans(plans, ranks))
        self._plans = plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        shared = plan.storage_data.get(SHARED) if isinstance(plan.storage_data, dict) else None
        if not caching(planner):
            state, results, _ = self._entries(plan, planner, False)
            self._metadata_of_plans(planner)
        else:  # the ranks agree first: a failure on one (e.g. no metadata) fails all before anything is written
            mine, failure = None, None
            try:
                state, results, dtypes = self._entries(plan, planner, True)
                self._metadata_of_plans(planner)
                mine = [dtypes, shared["sid"] if shared else None]
            except BaseException as e:  # noqa: BLE001 - raised on every rank by agree
                failure = e
            group = self.store.group if self.timeout is None else self.store.group.with_timeout(self.timeout)
            views = agree(group, mine, failure, f"DCP save of step {self.step}", outcome="nothing saved")
            if self.is_coordinator and self._plans is not None and self._base_json is not None:
                written = {(fqn, tuple(off)): dtype for v in views for fqn, off, dtype in v[0]}
                self._metadata_json = with_dtypes(self._base_json, self._plans, written)
            if len({v[1] for v in views}) != 1:  # a plan changed since its sharing was worked out
                log.info("step %d: a rank's DCP plan changed, not every rank has the same sharing: replicated "
                         "items are stored by every rank holding them", self.step)
                shared = None
        self.sharing = sharing_of(shared)
        meta: dict[str, Any] = {SHARD_KEY: META_VERSION}
        if self.is_coordinator:
            meta[META_KEY] = self._metadata_json
        tensors = [(name, _fqn_of(name)) for name in state if name not in self.extra]
        replayable = all(f is not None for _, f in tensors) and len({f for _, f in tensors}) == len(tensors)
        self.written = [(n, f) for n, f in tensors if f is not None] if replayable else None
        self.shard_metadata = meta
        # collective over the store's ranks: the marker is written once every rank's shard is
        self.saved = self.store.save(self.step, state, metadata=meta, metrics=self.metrics, force=self.force,
                                     overwrite=self.overwrite, preempted=self.preempted, blocking=self.blocking,
                                     timeout=self.timeout, replicated=self.sharing, overlap=self.overlap)
        return done(results)

    def _metadata_of_plans(self, planner: SavePlanner) -> None:
        """On the coordinator: the metadata, derived from the full global plan (the planner's, when DCP
        gave deltas)."""
        if not self.is_coordinator:
            return
        if self._deltas is None:
            raise TierfsError("TieredWriter: the coordinator has no global plan (prepare_global_plan was "
                              "not called); save with dcp.save / dcp.async_save")
        if self._base_json is None:
            self._derive(full_global_plan(planner, self._deltas))

    def _entries(self, plan: SavePlan, planner: SavePlanner, check: bool
                 ) -> tuple[dict[str, Any], list[WriteResult], list[list[Any]]]:
        """This rank's shard: ``{entry: value}``; DCP's write results; with ``check``, ``[fqn, offsets,
        dtype]`` of each planned tensor chunk whose dtype differs from the plan's (a cached plan)."""
        rank = self.store.group.rank
        state: dict[str, Any] = st.Flat()  # DCP's items by entry name: an fqn may hold '/'
        results: list[WriteResult] = []
        dtypes: list[list[Any]] = []
        planned = {(i.index.fqn, tuple(i.index.offset or ())) for i in plan.items}
        local = self._local_items
        if local is None and self.replicated == "local":
            local = cached_local_items(planner)
            if local is None:
                log.warning("step %d: DCP's cached local plan was not found: this rank keeps only the items "
                            "DCP planned for it (as replicated='dedup')", self.step)
        kept = [i for i in local or () if (i.index.fqn, tuple(i.index.offset or ())) not in planned
                ] if self.replicated == "local" else []
        for item in [*plan.items, *kept]:
            data = planner.resolve_data(item)
            is_bytes = item.type == WriteItemType.BYTE_IO
            name = entry_name(item.index, is_bytes)
            why = entry_name_problem(name)
            if why is not None:  # as a reader will check it: a step it cannot read is never written
                raise ArgumentError(f"state key {shown_name(item.index.fqn)} cannot be saved: {why}; rename it")
            if name in state:
                raise ArgumentError(f"the save plan has {user_key(name, dcp=True)} twice: use a planner that "
                                    "writes each chunk once")
            value: Any
            if is_bytes:
                value = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data)
                size = len(value)
            else:
                assert isinstance(data, torch.Tensor)
                st.check_tensor(item.index.fqn, data)  # (a meta or sparse tensor DCP passed on)
                value = data.detach()  # (a GPU tensor is copied once, straight into the RAM tier's pages)
                size = value.numel() * value.element_size()
                td = item.tensor_data
                if check and td is not None and td.properties.dtype != value.dtype and (
                        item.index.fqn, tuple(item.index.offset or ())) in planned:
                    dtypes.append([item.index.fqn, list(item.index.offset or ()),
                                   dtype_name(value.dtype, item.index.fqn)])
            state[name] = value
            if (item.index.fqn, tuple(item.index.offset or ())) in planned:  # DCP hears only of its own items
                results.append(WriteResult(index=item.index, size_in_bytes=size,
                                           storage_data={"rank": rank, "entry": name}))
        for name, value in self.extra.items():
            if name in state:
                raise ArgumentError(f"extra= {user_key(name, dcp=True)} is also a DCP item: rename it")
            state[name] = value
        return state, results, dtypes

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        storage = {r.index: r.storage_data for rs in results for r in rs}
        theirs = dataclasses.replace(metadata, storage_data=storage, storage_meta=None, version=None)
        if self._base_json is None or self._base_json != metadata_to_json(theirs):
            log.error("step %d: DCP metadata differs from the one tierfs stored; removing the step", self.step)
            if self.saved:
                self.store.delete(self.step)
            raise FormatError(f"step {self.step}: the save planner's global metadata differs from the metadata "
                              "derived from its plans (a custom planner?); the step was removed. TieredWriter "
                              "supports planners whose metadata follows DefaultSavePlanner's rules")
        if self._metadata_json != self._base_json:
            log.info("step %d: stored the dtypes written where DCP's cached plan has older ones", self.step)
        metadata.storage_data = storage


def _fqn_of(name: str) -> str | None:
    """The fqn of a tensor item's entry name (``"<offsets>|<fqn>"``); None for a bytes item."""
    if name.startswith("b|"):
        return None
    return name.split("|", 1)[1]

