"""A :class:`~tierfs.CheckpointManager` step through PyTorch DCP: the state's tensors with ``dcp.save`` and
``dcp.load`` over :class:`~tierfs.adapters.dcp.TieredWriter` / ``TieredReader``, the rest of the state
(numbers, strings, numpy arrays, ...) stored beside them without pickle (:mod:`tierfs.adapters._torchstate`).

Every rank hears of a failure on any rank before DCP's collectives start, so none waits in them for a
rank that gave up; a target that does not fit the checkpoint (a key it lacks, a tensor of another shape)
is one :class:`~tierfs.errors.StateMismatchError` naming the user's key, raised on every rank before
anything is loaded.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Protocol, cast

import numpy as np

from ... import state as st
from ...util import nogc as _nogc
from ...core.layout import ReadViews
from ...core.restore.sinks import empty_target
from ...ranks import agree, outcomes, ranks_failed
from ...errors import ArgumentError, RestoreError, StateMismatchError, TierfsError
from ...format import DCP_EXTRA_PREFIX, dcp_entry_name
from ...store import RestoreInfo, TieredStore
from .. import _torchstate as ts

log = logging.getLogger("tierfs")


@dataclass
class Plan:
    """What a ``dcp.save`` of one structure wrote on this rank, to write the same again without DCP.

    DCP plans every save anew: a local plan per rank, a gather, a global plan, a scatter, and the same for
    the results, costing far more than the copies for a state of thousands of small tensors. When every
    rank's state has the structure of its previous save (names, dtypes, shapes, DTensor placements), the
    plan would be the same, so the manager writes this rank's entries straight through the store: the
    same entry names, the same tensors (a DTensor's local shard), the same DCP metadata in the
    coordinator's manifest. A structure change on any rank makes every rank save through DCP again.
    """

    structure: list[Any]
    entries: list[tuple[str, str, bool]]  # (entry name, fqn, whether it is a DTensor's local shard)
    metadata: st.Trusted  # this rank's manifest metadata (the coordinator's holds DCP's Metadata), checked once
    sharing: Any = None  # the items other ranks hold too (TieredWriter.sharing), the same object every save


class _Options(Protocol):
    @property
    def enable_async_checkpointing(self) -> bool: ...


class Manager(Protocol):
    """What :func:`save` uses of the :class:`~tierfs.CheckpointManager` it saves for."""

    _dcp_plan: Plan | None  # the last DCP save's plan, replayed for the same structure

    @property
    def store(self) -> TieredStore: ...

    @property
    def options(self) -> _Options: ...

    @property
    def overlap(self) -> Any: ...

    def _replaces(self, step: int) -> bool:
        """Whether an existing ``step`` is saved again."""

    def _before(self) -> str:
        """Which run saved the existing step, for the log."""


def structure(flat: Mapping[str, Any]) -> list[Any] | None:
    """The structure of a state's tensors (DCP's flattened keys), or None when it is not one a
    :class:`Plan` can replay (tensor subclasses other than DTensor, e.g. ShardedTensor)."""
    import torch

    out: list[Any] = []
    plain = (torch.Tensor, torch.nn.Parameter)
    for f, t in flat.items():
        if type(t) in plain:
            out.append((f, t.dtype, t.shape))
        elif type(t).__name__ == "DTensor":
            out.append((f, type(t), t.dtype, t.shape, tuple(t.placements), t.device_mesh))
        else:
            return None
    return out


def check_names(split: ts.Split) -> None:
    """Two keys of a state that DCP's flattened names make one (``1`` and ``'1'``, ``'a.b'`` beside ``'a'``
    holding ``'b'``) are an :class:`~tierfs.errors.ArgumentError` naming both. Costs a count of the tensors
    (each has one name unless two collide); the keys are looked for only then."""
    stack: list[Any] = [split.tensors]
    count = 0
    while stack:
        for v in stack.pop().values():
            if type(v) is dict:
                stack.append(v)
            else:
                count += 1
    if count == len(split.flat):
        return
    seen: dict[str, list[Any]] = {}
    walk: list[tuple[list[Any], Any]] = [([], split.tensors)]
    while walk:
        path, d = walk.pop(0)
        for k, v in d.items():
            if type(v) is dict:
                walk.append((path + [k], v))
                continue
            name = ts.fqn(path + [k])
            if name in seen:
                raise ArgumentError(f"{_shown(seen[name])} and {_shown(path + [k])} both become {name!r} in DCP's "
                                    "flattened names, which must be unique; rename one of the keys")
            seen[name] = path + [k]


def _shown(path: list[Any]) -> str:
    """A key path as the user indexes the state: ``state['a']['b']``, ``state[1]``."""
    return "state" + "".join(f"[{k!r}]" for k in path)


def save(mgr: Manager, step: int, state: Mapping[str, Any], metrics: Mapping[str, Any] | None,
         force: bool, preempted: bool) -> bool:
    """``dcp.save`` of the state's tensors through TieredWriter; the rest as JSON/arrays beside them.
    A state of the structure saved before is written with the previous save's plan (see :class:`Plan`).
    ``preempted``: this save goes to the preemption tiers."""
    import torch.distributed.checkpoint as dcp

    from .writer import TieredWriter

    store = mgr.store
    g = store.group
    err: BaseException | None = None
    tensors: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    shape: list[Any] | None = None
    flat: Mapping[str, Any] = {}
    plan: Plan | None = mgr._dcp_plan
    try:
        with _nogc.paused():
            split = ts.split(state)
            check_names(split)
            tensors, extra, flat = split.tensors, ts.extra(split), split.flat
            shape = structure(flat)
        store.raise_background_errors()
    except Exception as e:  # noqa: BLE001 - every rank must hear of it before DCP's collectives
        err = e
    known = plan is not None and shape is not None and plan.structure == shape
    exists = store.has_step(step)
    chosen = bool(store.should_save(step, force=force, preempted=preempted))
    if preempted and not force and not chosen:
        force, chosen = True, True  # no tier names a preemption policy: save everywhere
    # every rank must hear of a failure before DCP's collectives; rank 0 decides, as the store does
    views = agree(g, [exists, chosen, force, preempted, known], err, f"step {step}", outcome="nothing saved "
                  "(the state, or an earlier background failure)")
    exists = any(v[0] for v in views)
    _, chosen, force, preempted, _ = views[0]
    known = all(v[4] for v in views)
    if exists:
        if not mgr._replaces(step):
            return False
        log.info("step %d exists from %s; replacing it", step, mgr._before())
    if not chosen:
        return False
    blocking = not mgr.options.enable_async_checkpointing
    if known:
        assert plan is not None
        with _nogc.paused():
            entries: dict[str, Any] = st.Flat((name, flat[f].to_local() if local else flat[f])  # DCP's names
                                              for name, f, local in plan.entries)
            entries.update((DCP_EXTRA_PREFIX + k, v) for k, v in extra.items())
        return store.save(step, entries, metadata=cast(Mapping[str, Any], plan.metadata), metrics=metrics,
                          force=force, overwrite=exists, preempted=preempted, blocking=blocking,
                          replicated=plan.sharing, overlap=mgr.overlap)
    mgr._dcp_plan = None
    writer = TieredWriter(store, step, overwrite=exists, force=force, preempted=preempted,
                          metrics=metrics, blocking=blocking, extra=extra, overlap=mgr.overlap)
    ts.run_dcp(dcp.save, tensors, storage_writer=writer, process_group=g.process_group)
    if writer.saved and shape is not None and writer.written is not None:
        mgr._dcp_plan = Plan(shape, [(name, fqn, type(flat[fqn]).__name__ == "DTensor")
                                     for name, fqn in writer.written], st.Trusted(writer.shard_metadata),
                              writer.sharing)
    return bool(writer.saved)


def restore(store: TieredStore, state: Mapping[str, Any] | None, step: int, tiers: list[str],
            into: Callable[[Mapping[str, Any]], RestoreInfo]) -> tuple[Any, RestoreInfo]:
    """``dcp.load`` of a step saved by :func:`save`, in place when ``state`` is given. Returns the step (with
    ``state``) or the restored state, and what the restore did. ``into({entry: tensor})``: the store's
    restore of the step through the manager's plan, when every tensor of the target is a whole entry of the
    rank's own shard (no DCP planning then)."""
    import torch.distributed.checkpoint as dcp

    from .reader import TieredReader, check_target

    g = store.group
    t0 = time.perf_counter()
    reader = TieredReader(store, step, tiers=tiers)
    md = ts.run_dcp(reader.read_metadata, unusable=True)  # every rank gets it, or every rank raises
    err: BaseException | None = None
    saved: ts.Saved | None = None
    target: dict[str, Any] = {}
    direct: dict[str, Any] | None = None
    try:
        saved = _read_saved(store, step, tiers)
        if state is not None:
            with _nogc.paused():
                split = ts.split(state)
                check_names(split)
            have = {ts.key(p) for p, _ in saved.plain}
            missing = [ts.fqn(p) for p, _ in split.plain if ts.key(p) not in have]
            for k, v in ((ts.fqn(p), v) for p, v in split.plain if ts.key(p) not in have):
                under = [n for n in md.state_dict_metadata if n.startswith(k + ".")]
                if isinstance(v, Mapping) and not v and under:  # DCP flattens an empty mapping as a value
                    raise empty_target(repr(k), cast(int, reader.resolved_step), len(under), repr(under[0]))
            if missing:
                raise StateMismatchError(f"target state has entries the checkpoint lacks: "
                                         f"{', '.join(repr(k) for k in missing[:5])}; remove them from the target "
                                         "or restore another step")
            target = split.tensors
            direct = _direct(store, md, split.flat, step, tiers)
            if direct is None:
                check_target(md, split.flat)  # before DCP's planner: a StateMismatchError in the user's keys
    except Exception as e:  # noqa: BLE001 - every rank must hear of it before DCP's collectives
        err = e
    views = outcomes(g, direct is not None, err, classify=ts.failure_kind)
    failed = {r: (kind, why, where) for r, (kind, why, where) in enumerate(views) if kind is not None}
    if failed:  # every rank takes the same way out: raise, or try an older step
        if any(kind != RestoreError.__name__ for kind, _, _ in failed.values()):
            if err is not None:
                raise err
            raise ranks_failed(f"step {step}: loading", {r: v for r, v in failed.items()
                                                        if v[0] != RestoreError.__name__})
        raise ts.Unusable([(",".join(tiers), step, f"rank {r}: {why}") for r, (_, why, _) in failed.items()])
    assert saved is not None
    if direct is not None and all(v[1] for v in views):  # every rank's tensors are whole entries of its shard
        info = into(direct)  # collective; a RestoreError tries an older step
        for path, value in saved.plain:
            ts.assign(state, path, ts.decode(value, saved.arrays))
        info.metrics, info.seconds = dict(saved.metrics), time.perf_counter() - t0
        return step, info
    if state is None:
        target = ts.target_from(md, saved)
    try:
        ts.run_dcp(dcp.load, target, storage_reader=reader, process_group=g.process_group, unusable=True)
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


def _direct(store: TieredStore, md: Any, flat: Mapping[str, Any], step: int, tiers: list[str]
            ) -> dict[str, Any] | None:
    """``{entry: tensor}`` when every tensor of the target is a plain tensor that one entry of this rank's
    own shard holds whole, with its dtype and shape (the usual restore into the job that saved: DCP's
    planning would only find the same); None when DCP must plan the load (DTensors, resharding, another
    world size, dtype conversion)."""
    import torch

    try:
        own, _ = store.read_manifest(step, store.group.rank, tiers=tiers)
    except (TierfsError, OSError, ValueError):
        return None
    whole = _whole(md, own)
    plain = (torch.Tensor, torch.nn.Parameter)
    out: dict[str, Any] = {}
    with _nogc.paused():
        for fqn, t in flat.items():
            w = whole.get(fqn)
            if w is None or type(t) not in plain or w[1] != t.dtype or w[2] != t.shape:
                return None
            out[w[0]] = t
    return out


_wholes: "dict[tuple[int, int], tuple[Any, Any, dict[str, tuple[str, Any, Any]]]]" = {}


def _whole(md: Any, own: Any) -> dict[str, tuple[str, Any, Any]]:
    """``fqn -> (entry, dtype, size)`` of the tensors saved in one chunk that the shard ``own`` holds, made
    once per (metadata, manifest) pair (both are made once per step; see ``reader._metadata``)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    key = (id(md.state_dict_metadata), id(own))
    got = _wholes.get(key)
    if got is not None and got[0] is md.state_dict_metadata and got[1] is own:
        return got[2]
    names = ReadViews.of(own).expected  # the shard's array entries
    out: dict[str, tuple[str, Any, Any]] = {}
    for fqn, m in md.state_dict_metadata.items():
        if isinstance(m, TensorStorageMetadata) and len(m.chunks) == 1:
            name = dcp_entry_name(fqn, m.chunks[0].offsets, False)
            if name in names:
                out[fqn] = (name, m.properties.dtype, m.size)
    _wholes[key] = (md.state_dict_metadata, own, out)
    while len(_wholes) > 8:
        del _wholes[next(iter(_wholes))]
    return out


def _read_saved(store: TieredStore, step: int, tiers: list[str]) -> ts.Saved:
    """The non-tensor part of a DCP step: this rank's own (rank 0's for ranks the saving job lacked)."""
    g = store.group
    world = store.read_marker(step, tiers=tiers).world_size
    rank = g.rank if g.rank < world else 0
    manifest, _ = store.read_manifest(step, rank, tiers=tiers)
    names = [e.name for e in manifest.entries if e.name.startswith(DCP_EXTRA_PREFIX)]
    got: dict[str, Any] = {}

    def consume(found: Mapping[str, tuple[Any, Any]], tier: str) -> None:
        for name, (e, raw) in found.items():
            got[name[len(DCP_EXTRA_PREFIX):]] = e.value if e.kind == "json" else \
                np.array(st.view_as("numpy", e.dtype, e.shape, raw))

    store.read_entries(step, rank, names, tiers=tiers, consume=consume)
    index = got.get(ts.INDEX)
    if not (isinstance(index, list) and len(index) == 5 and index[:2] == [ts.INDEX_FORMAT, 1]):
        raise StateMismatchError(f"step {step} was saved by dcp.save directly, not by CheckpointManager: "
                                 "load it with dcp.load and TieredReader")
    arrays = {int(k[1:]): v for k, v in got.items() if k.startswith("a")}
    return ts.Saved([(list(p), v) for p, v in index[2]], [list(p) for p in index[3]],
                    {f: list(p) for f, p in index[4]}, arrays, dict(manifest.metrics))
