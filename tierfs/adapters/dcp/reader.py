"""DCP's ``StorageReader`` over a :class:`~tierfs.TieredStore` (see :mod:`tierfs.adapters.dcp`), and the check
of a target state against a DCP step's metadata."""

from __future__ import annotations

import copy
import datetime
import hashlib
import io
import json
import threading
import os
import uuid
from collections import defaultdict
from typing import Any, Mapping

from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from ...util import args as _args
from ...ranks import seconds
from ...errors import ArgumentError, FormatError, StateMismatchError, StepNotFoundError, TierfsError
from ...store import TieredStore
from .collective import broadcast
from .metadata import META_KEY, as_tensor, check_kwargs, done, metadata_from_json, parse_step


def check_target(metadata: Metadata, tensors: Mapping[str, Any], partial: bool = False) -> None:
    """Raise StateMismatchError, naming the user's keys, when ``tensors`` (DCP's flattened keys -> the
    target's values) do not fit a checkpoint: a key the checkpoint lacks (unless ``partial``), a tensor
    whose (global) shape differs, a tensor where the checkpoint holds bytes. dtypes may differ: DCP
    converts them."""
    sdm = metadata.state_dict_metadata
    missing = [k for k in tensors if k not in sdm]
    if missing and not partial:
        more = ", ..." if len(missing) > 5 else ""
        raise StateMismatchError(f"target state has entries the checkpoint lacks: "
                                 f"{', '.join(repr(k) for k in missing[:5])}{more}; remove them from the target "
                                 "or restore another step")
    for k, v in tensors.items():
        md = sdm.get(k)
        size = getattr(v, "size", None)
        if md is None or not callable(size):
            continue
        if not isinstance(md, TensorStorageMetadata):
            raise StateMismatchError(f"{k!r}: the checkpoint holds bytes there, the target a tensor")
        if tuple(md.size) != tuple(size()):
            raise StateMismatchError(f"{k!r}: the target has shape {tuple(size())}, the checkpoint "
                                     f"{tuple(md.size)}; give a target of the checkpoint's shape")


_made_lock = threading.Lock()
_made: "dict[int, tuple[Any, Metadata]]" = {}
_sent: "dict[int, tuple[Any, bytes]]" = {}  # id(raw) -> (raw, its JSON bytes) on the rank that reads it
_received: "dict[bytes, Any]" = {}  # digest of received JSON bytes -> the JSON, on the ranks it is sent to
_KEEP = 8


def _kept(cache: "dict[Any, Any]", key: Any, value: Any) -> None:
    """``cache[key] = value``, the oldest dropped beyond ``_KEEP`` (under ``_made_lock``)."""
    cache[key] = value
    while len(cache) > _KEEP:
        del cache[next(iter(cache))]


def _metadata(raw: Any) -> Metadata:
    """DCP's Metadata of a step's stored JSON, made once per parsed manifest (manifests are parsed once,
    see :func:`tierfs.format.manifest_from_marker`, so a step restored again finds it here) or per JSON
    received (:func:`_decoded`)."""
    with _made_lock:
        got = _made.get(id(raw))
        if got is not None and got[0] is raw:
            return got[1]
    md = metadata_from_json(raw)
    with _made_lock:
        _kept(_made, id(raw), (raw, md))
    return md


def _encoded(raw: Any) -> bytes:
    """The JSON bytes of metadata this rank read, to send (made once per parsed manifest)."""
    with _made_lock:
        got = _sent.get(id(raw))
        if got is not None and got[0] is raw:
            return got[1]
    data = json.dumps(raw).encode()
    with _made_lock:
        _kept(_sent, id(raw), (raw, data))
    return data


def _decoded(data: bytes) -> Any:
    """The JSON of received metadata bytes; the same object for the same bytes (so :func:`_metadata` is
    not made again when a step is loaded again)."""
    key = hashlib.blake2b(data, digest_size=16).digest()
    with _made_lock:
        got = _received.get(key)
    if got is None:
        try:
            got = json.loads(data)
        except ValueError as e:
            raise FormatError(f"DCP metadata received from another rank is damaged ({e})") from None
        with _made_lock:
            _kept(_received, key, got)
    return got


class TieredReader(StorageReader):
    """DCP ``StorageReader`` that loads step ``step`` (default: the newest common one) from ``store``.

    ``tiers`` restricts the tiers read from. After a load, ``sources`` maps each saving rank read to
    the tier that served it, ``skipped`` lists ``(tier, step, reason)`` of copies that failed checks and
    ``resolved_step`` is the step loaded. ``collective=False`` lets one process read alone (no
    collective over the store's ranks, e.g. an export after the job); the step must then be given.
    ``timeout`` (seconds or a ``timedelta``) bounds the load's waits on the other ranks (default: the
    store's). Every argument is checked here, each a one-line :class:`~tierfs.errors.ArgumentError`.

    ``dcp.load`` raises DCP's ``CheckpointException`` for any failure inside it, the reader's included
    (the original error is in its ``failures``); :meth:`check_target` raises a target that does not fit
    the checkpoint as one :class:`~tierfs.errors.StateMismatchError` before the load, and
    ``CheckpointManager.restore`` does so itself.
    """

    def __init__(self, store: TieredStore, step: int | None = None, *, tiers: list[str] | None = None,
                 collective: bool = True, timeout: float | datetime.timedelta | None = None) -> None:
        super().__init__()
        _args.instance(store, "TieredReader store", TieredStore, "a TieredStore")
        self.timeout = None if timeout is None else seconds(timeout)
        self.store = store
        self.tiers = _args.names(tiers, "TieredReader tiers", [t.name for t in store.tiers])
        self.step = _args.optional_step(step)
        self._collective = _args.flag(collective, "collective")
        self.load_id = uuid.uuid4().hex
        self.metadata: Metadata | None = None
        self.sources: dict[int, str] = {}
        self.skipped: list[tuple[str, int, str]] = []
        self._resolved_step: int | None = None
        #: with a peer tier: where each rank's own shard came from into its RAM tier before the load
        self.localized: Any = None

    @property
    def resolved_step(self) -> int | None:
        """The step this reader loads (known once DCP read the metadata)."""
        return self._resolved_step

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.step = parse_step(checkpoint_id)
        self.load_id = uuid.uuid4().hex
        self.metadata, self._resolved_step = None, None
        self.sources, self.skipped = {}, []

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        try:
            parse_step(checkpoint_id)
        except ArgumentError:
            return False
        return True

    def _own_entries(self, step: int) -> set[str]:
        """Entry names in this rank's own shard of ``step`` (empty when no tier holds it)."""
        try:
            manifest, _ = self.store.read_manifest(step, self.store.group.rank, tiers=self.tiers)
        except (TierfsError, OSError):
            return set()
        return {e.name for e in manifest.entries}

    def _pick_step(self) -> int:
        rep = self.store.replicator
        if self._collective and self.tiers is None and rep is not None:
            # collective: every rank's shard of the step into its RAM tier (a replaced node's from a peer)
            self.localized = self.store.localize(self.step, timeout=self.timeout)
            return self.localized.step
        if self.step is not None:
            return self.step
        # every rank loads the same step, one it reads itself: not one a peer's copy would bring (this reads
        # the tiers of files directly)
        files = [n for n in (self.tiers or [t.name for t in self.store.tiers]) if rep is None or n != rep.name]
        step = self.store.latest_common_step(files, timeout=self.timeout)
        if step is None:
            raise StepNotFoundError("nothing to load: no step is committed for every rank")
        return step

    def check_target(self, state_dict: Mapping[str, Any]) -> None:
        """Raise :class:`~tierfs.errors.StateMismatchError` when ``dcp.load(state_dict, ...)`` with this
        reader would fail on the target: a key the checkpoint lacks, a tensor of another (global) shape.

        Reads the metadata as the load does (collective unless ``collective=False``); call it on every rank.
        dtypes may differ: DCP converts, as it does with any storage reader.
        """
        from torch.distributed.checkpoint._nested_dict import flatten_state_dict

        _args.mapping(state_dict, "state_dict")
        flat, _ = flatten_state_dict(dict(state_dict))
        check_target(self.read_metadata(), flat)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            raise FormatError("tierfs DCP steps have only global metadata (no rank-local metadata)")
        check_kwargs("TieredReader.read_metadata", args, kwargs)
        step = self._pick_step()
        g = self.store.group if self.timeout is None else self.store.group.with_timeout(self.timeout)
        if self._collective and g.world_size > 1:
            raw, err = self._shared_metadata_json(g, step)
        else:
            raw, err = self._try_metadata_json(step)
        if raw is None:
            raise err if err is not None else FormatError(f"step {step}: no DCP metadata")
        md = copy.copy(_metadata(raw))  # DCP's objects, shared between loads of the step; the envelope is ours
        md.storage_meta = StorageMeta(checkpoint_id=f"step_{step:012d}", load_id=self.load_id)
        self.metadata, self._resolved_step = md, step
        return md

    def _try_metadata_json(self, step: int) -> tuple[Any, BaseException | None]:
        """:meth:`_read_metadata_json`, or None and why not."""
        try:
            return self._read_metadata_json(step), None
        except (TierfsError, OSError) as e:
            return None, e

    def _shared_metadata_json(self, g: Any, step: int) -> tuple[Any, BaseException | None]:
        """The JSON DCP metadata of ``step`` on every rank (collective), or None and why not.

        DCP reads the metadata on every rank; here rank 0 reads it and broadcasts it (what each rank
        moves does not grow with the job, and shared tiers are asked once, not by every rank). When rank 0
        cannot read it (its tiers lack the coordinator's manifest: a RAM-only store whose node 0 lost its
        RAM), every rank tries its own tiers and the first rank that has it sends it to the others; a rank
        that has none of it keeps its own reason."""
        raw, err = self._try_metadata_json(step) if g.rank == 0 else (None, None)
        got = broadcast(g, None if raw is None else _encoded(raw), 0)
        if got is not None:
            return (raw if g.rank == 0 else _decoded(got)), None
        if g.rank != 0:
            raw, err = self._try_metadata_json(step)
        have = g.all_gather(raw is not None)
        if any(have) and not all(have):
            src = have.index(True)
            got = broadcast(g, _encoded(raw) if g.rank == src else None, src)
            if raw is None and got is not None:
                raw, err = _decoded(got), None
        return raw, err

    def _read_metadata_json(self, step: int) -> Any:
        """The JSON DCP metadata of ``step`` from the coordinator's manifest (verified against the marker)."""
        marker = self.store.read_marker(step, tiers=self.tiers)
        ranks = sorted(int(n.split("_")[1].split(".")[0]) for n in marker.manifests)
        for r in ranks:  # the coordinator is usually rank 0
            manifest, _ = self.store.read_manifest(step, r, tiers=self.tiers)
            if META_KEY in manifest.metadata:
                return manifest.metadata[META_KEY]
        raise FormatError(f"step {step} was not written by TieredWriter (no DCP metadata in its manifests)")

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        kwargs.pop("rank", None)
        kwargs.pop("use_collectives", None)
        check_kwargs("TieredReader.set_up_storage_reader", args, kwargs)
        self.metadata = metadata
        if self._resolved_step is None:
            self._resolved_step = self._pick_step()

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        if self.metadata is None or self._resolved_step is None:
            raise TierfsError("TieredReader: read_metadata/set_up_storage_reader were not called; load with dcp.load")
        storage = self.metadata.storage_data
        by_rank: dict[int, dict[str, list]] = defaultdict(lambda: defaultdict(list))
        own = self._own_entries(self._resolved_step)
        for item in plan.items:
            where = storage.get(item.storage_index)
            if where is None:
                raise FormatError(f"step {self._resolved_step} has no data for {item.storage_index.fqn!r}")
            # a replicated item this rank kept too (TieredWriter replicated="local"): read it from its own shard
            rank = self.store.group.rank if where["entry"] in own else int(where["rank"])
            by_rank[rank][where["entry"]].append(item)

        for rank, wanted in sorted(by_rank.items()):
            def consume(found: Mapping[str, tuple[Any, Any]], tier: str,
                        wanted: dict[str, list[Any]] = wanted) -> None:
                for name, items in wanted.items():
                    entry, raw = found[name]
                    for item in items:
                        if item.type == LoadItemType.BYTE_IO:
                            planner.load_bytes(item, io.BytesIO(raw.tobytes()))
                            continue
                        src = as_tensor(entry, raw)
                        for dim, (off, n) in enumerate(zip(item.storage_offsets, item.lengths)):
                            src = src.narrow(dim, off, n)
                        target = planner.resolve_tensor(item).detach()
                        if target.size() != src.size():
                            raise StateMismatchError(
                                f"{item.storage_index.fqn!r}: the checkpoint's slice of shape {tuple(src.size())}"
                                f" does not fit the target's of shape {tuple(target.size())}")
                        target.copy_(src)
                        planner.commit_tensor(item, target)

            tier, skipped = self.store.read_entries(self._resolved_step, rank, list(wanted), tiers=self.tiers,
                                                    consume=consume)
            self.sources[rank] = tier
            self.skipped += skipped
        return done(None)
