"""DCP's metadata as JSON, without pickle, and the names of DCP items as tierfs entries.

DCP's global ``Metadata`` is stored in the coordinator's manifest: every fqn's tensor properties (dtype,
layout, requires_grad, memory_format, pin_memory), size and chunks, or ``bytes``; the planner's data
(the default planner's flatten mappings: fqn -> key path of str/int); and the storage data,
``MetadataIndex -> {rank, entry}``. :func:`metadata_from_plans` derives it from the final save plans
exactly as DCP's default planner does; the helpers under "DCP's plan caching" find those plans, and the
dtypes actually written, when a caching planner hands the storage layer deltas.
"""

from __future__ import annotations

import logging
import os
import re
import warnings
from collections import ChainMap
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                   MetadataIndex, TensorProperties, TensorStorageMetadata)
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.futures import Future

from ... import state as st
from ...util import args as _args
from ...errors import ArgumentError, FormatError
from ...format import dcp_entry_name, user_key

log = logging.getLogger("tierfs")

META_FORMAT = "tierfs.dcp"
META_VERSION = 1
META_KEY = "dcp"  # key of the DCP metadata in the coordinator's manifest metadata

_STEP_ID_RE = re.compile(r"^(?:step_)?(\d{1,12})$")
_LAYOUTS = {"torch.strided": torch.strided, "torch.sparse_coo": torch.sparse_coo}
_MEMORY_FORMATS = {"torch.contiguous_format": torch.contiguous_format,
                   "torch.channels_last": torch.channels_last, "torch.preserve_format": torch.preserve_format}


def check_kwargs(where: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Log arguments DCP passes that this version of tierfs does not know."""
    if args or kwargs:
        log.warning("tierfs %s: ignoring arguments this version does not know: %r %r", where, args, sorted(kwargs))


def done(value: Any) -> Future:
    """A future that holds ``value`` already."""
    fut: Future = Future()
    fut.set_result(value)
    return fut


def entry_name(index: MetadataIndex, is_bytes: bool) -> str:
    """The tierfs entry name of a DCP write item (:func:`tierfs.format.dcp_entry_name`; messages show it by
    the user's key, :func:`tierfs.format.user_key`)."""
    return dcp_entry_name(index.fqn, index.offset, is_bytes)


def parse_step(checkpoint_id: Any, what: str = "checkpoint_id") -> int:
    """A step number from a step or a DCP ``checkpoint_id`` (``42``, ``"42"``, ``"step_000000000042"``)."""
    if isinstance(checkpoint_id, (str, os.PathLike)) and not isinstance(checkpoint_id, bytes):
        m = _STEP_ID_RE.match(os.fspath(checkpoint_id))
        if m is not None:
            return int(m.group(1))
        raise ArgumentError(f"{what} {checkpoint_id!r} is not a tierfs step: pass the step number "
                            "(e.g. 42, '42' or 'step_000000000042')")
    return _args.step(checkpoint_id, what)


def _props_to_json(p: TensorProperties, fqn: str) -> dict[str, Any]:
    dtype = dtype_name(p.dtype, fqn)
    if str(p.layout) not in _LAYOUTS or str(p.memory_format) not in _MEMORY_FORMATS:
        raise ArgumentError(f"{fqn!r}: tensor layout {p.layout} / memory format {p.memory_format} is not "
                            "supported by tierfs")
    return {"dtype": dtype, "layout": str(p.layout), "requires_grad": bool(p.requires_grad),
            "memory_format": str(p.memory_format), "pin_memory": bool(p.pin_memory)}


def _props_from_json(d: dict[str, Any]) -> TensorProperties:
    if d.get("dtype") not in st._TORCH_DTYPES or d.get("layout") not in _LAYOUTS \
            or d.get("memory_format") not in _MEMORY_FORMATS:
        raise FormatError(f"DCP metadata has unsupported tensor properties {d!r}")
    return TensorProperties(dtype=getattr(torch, d["dtype"]), layout=_LAYOUTS[d["layout"]],
                            requires_grad=bool(d["requires_grad"]), memory_format=_MEMORY_FORMATS[d["memory_format"]],
                            pin_memory=bool(d["pin_memory"]))


def _ints(xs: Any) -> list[int]:
    if not isinstance(xs, (list, tuple)) or not all(isinstance(x, int) and not isinstance(x, bool) for x in xs):
        raise FormatError(f"DCP metadata: expected a list of ints, got {xs!r}")
    return [int(x) for x in xs]


def _planner_data_to_json(pd: Any) -> Any:
    """The default planner's flatten mappings (fqn -> tuple of str/int keys) as JSON, or None."""
    if pd is None:
        return None
    ok = isinstance(pd, dict) and all(
        isinstance(k, str) and isinstance(v, (tuple, list)) and
        all(isinstance(x, (str, int)) and not isinstance(x, bool) for x in v) for k, v in pd.items())
    if not ok:
        raise ArgumentError("the save planner's planner_data is not the default planner's flatten mapping "
                        "(fqn -> tuple of str/int keys); tierfs stores DCP metadata without pickle and cannot "
                        "store it: use DefaultSavePlanner or a planner whose planner_data is such a mapping")
    return {k: list(v) for k, v in pd.items()}


def metadata_to_json(md: Metadata) -> dict[str, Any]:
    """DCP ``Metadata`` as JSON-able data (no pickle); ``storage_data`` must map MetadataIndex -> dict."""
    sdm: dict[str, Any] = {}
    for fqn, m in md.state_dict_metadata.items():
        if isinstance(m, BytesStorageMetadata):
            sdm[fqn] = {"type": "bytes"}
        elif isinstance(m, TensorStorageMetadata):
            sdm[fqn] = {"type": "tensor", "properties": _props_to_json(m.properties, fqn), "size": list(m.size),
                        "chunks": [{"offsets": list(c.offsets), "sizes": list(c.sizes)} for c in m.chunks]}
        else:
            raise ArgumentError(f"{fqn!r}: unknown DCP storage metadata {type(m).__name__}")
    storage = sorted(([idx.fqn, None if idx.offset is None else list(idx.offset), int(v["rank"]),
                       str(v["entry"])] for idx, v in (md.storage_data or {}).items()),
                     key=lambda r: (r[0], r[1] or [], r[2], r[3]))
    return {"format": META_FORMAT, "version": META_VERSION, "state_dict_metadata": sdm,
            "planner_data": _planner_data_to_json(md.planner_data), "storage_data": storage}


def metadata_from_json(d: Any) -> Metadata:
    """Rebuild DCP ``Metadata`` from :func:`metadata_to_json`'s output, validating as it goes."""
    if not isinstance(d, dict) or d.get("format") != META_FORMAT:
        raise FormatError("not tierfs DCP metadata")
    if d.get("version") != META_VERSION:
        raise FormatError(f"DCP metadata version {d.get('version')!r} is not supported; upgrade tierfs")
    try:
        sdm: dict[str, Any] = {}
        for fqn, m in d["state_dict_metadata"].items():
            if m["type"] == "bytes":
                sdm[fqn] = BytesStorageMetadata()
            elif m["type"] == "tensor":
                sdm[fqn] = TensorStorageMetadata(
                    properties=_props_from_json(m["properties"]), size=torch.Size(_ints(m["size"])),
                    chunks=[ChunkStorageMetadata(offsets=torch.Size(_ints(c["offsets"])),
                                                 sizes=torch.Size(_ints(c["sizes"]))) for c in m["chunks"]])
            else:
                raise FormatError(f"{fqn!r}: unknown kind {m['type']!r}")
        storage: dict[MetadataIndex, dict[str, Any]] = {}
        for fqn, offset, rank, entry in d["storage_data"]:
            if not isinstance(fqn, str) or not isinstance(rank, int) or not isinstance(entry, str):
                raise FormatError(f"bad storage record {[fqn, offset, rank, entry]!r}")
            idx = MetadataIndex(fqn, None if offset is None else _ints(offset))
            storage[idx] = {"rank": rank, "entry": entry}
        pd = d.get("planner_data")
        planner_data = None if pd is None else {k: tuple(v) for k, v in pd.items()}
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise FormatError(f"DCP metadata is damaged ({type(e).__name__}: {e})") from None
    return Metadata(state_dict_metadata=sdm, planner_data=planner_data, storage_data=storage)


def metadata_from_plans(plans: list[SavePlan], ranks: list[int]) -> Metadata:
    """The global metadata of final save plans, derived as DCP's default planner derives it."""
    sdm: dict[str, Any] = {}
    storage: dict[MetadataIndex, dict[str, Any]] = {}
    for plan, rank in zip(plans, ranks):
        for item in plan.items:
            is_bytes = item.type == WriteItemType.BYTE_IO
            if is_bytes:
                sdm[item.index.fqn] = BytesStorageMetadata()
            else:
                td = item.tensor_data
                if td is None or td.chunk is None:
                    raise ArgumentError(f"write item {item.index.fqn!r} has no tensor chunk")
                md = sdm.setdefault(item.index.fqn, TensorStorageMetadata(properties=td.properties, size=td.size,
                                                                          chunks=[]))
                md.chunks.append(td.chunk)
            storage[MetadataIndex(item.index.fqn, item.index.offset)] = {
                "rank": rank, "entry": entry_name(item.index, is_bytes)}
    pds = [p.planner_data for p in plans if p.planner_data is not None]
    planner_data = dict(ChainMap(*pds)) if pds else None
    return Metadata(state_dict_metadata=sdm, planner_data=planner_data, storage_data=storage)


# -- DCP's plan caching (DefaultSavePlanner(enable_plan_caching=True)) ---------------------------------
def caching(planner: SavePlanner) -> bool:
    """Whether ``planner`` caches plans; every rank's planner must agree, as DCP itself needs."""
    return bool(getattr(planner, "_enable_plan_caching", False))


def dtype_name(dtype: torch.dtype, fqn: str) -> str:
    """``dtype`` as the metadata JSON stores it (``"float32"``); ArgumentError for one tierfs cannot store."""
    name = str(dtype).removeprefix("torch.")
    if name not in st._TORCH_DTYPES:
        raise ArgumentError(f"{fqn!r}: torch dtype {dtype} is not supported by tierfs")
    return name


def cached_local_items(planner: SavePlanner) -> list[WriteItem] | None:
    """This rank's local plan items when a caching planner sent none (its plan equals the one DCP cached).

    DCP keeps the local plan in ``SavePlanner._cached_save_plan`` under the planner's cache key (the
    planner's class name, shared by every instance in the process); None where it is not there.
    """
    key = getattr(planner, "_cached_plans_key", None)
    plan = SavePlanner._cached_save_plan.get(key) if isinstance(key, str) else None
    return None if plan is None else list(plan.items)


def full_global_plan(planner: SavePlanner, deltas: list[SavePlan]) -> list[SavePlan]:
    """The coordinator's final global plan when DCP gave the storage layer deltas (``usable=False`` for a
    rank whose plan did not change): the one the planner keeps (``DefaultSavePlanner.global_plan``,
    cached or just made), checked against the deltas."""
    plans: Any = getattr(planner, "global_plan", None)
    ok = isinstance(plans, list) and len(plans) == len(deltas) and all(
        isinstance(p, SavePlan) and p.usable and (not d.usable or p is d or p.items == d.items)
        for p, d in zip(plans, deltas))
    if not ok:
        raise FormatError("the save planner caches plans but does not keep the global plan its deltas come "
                          "from (as DefaultSavePlanner does in .global_plan): TieredWriter cannot derive the "
                          "checkpoint's metadata; pass a planner without plan caching")
    return list(plans)


def with_dtypes(meta: dict[str, Any], plans: list[SavePlan], dtypes: dict[tuple[str, tuple[int, ...]], str]
                ) -> dict[str, Any]:
    """``meta`` (:func:`metadata_to_json` of ``plans``) with the dtypes the ranks wrote: ``dtypes`` maps
    ``(fqn, offsets)`` of a chunk to the dtype it was written with where the plan says another (DCP's
    plan cache does not compare dtypes). A tensor's dtype is its first chunk's, in plan order, as in
    :func:`metadata_from_plans`. Plain dict operations: nothing here can fail."""
    if not dtypes:
        return meta
    sdm, seen = dict(meta["state_dict_metadata"]), set()
    for plan in plans:
        for item in plan.items:
            fqn = item.index.fqn
            if item.type == WriteItemType.BYTE_IO or fqn in seen:
                continue
            seen.add(fqn)
            dtype = dtypes.get((fqn, tuple(item.index.offset or ())))
            if dtype is not None:
                sdm[fqn] = {**sdm[fqn], "properties": {**sdm[fqn]["properties"], "dtype": dtype}}
    return {**meta, "state_dict_metadata": sdm}


def as_tensor(entry: Any, raw: Any) -> torch.Tensor:
    """A torch view (no copy) of an entry's verified bytes; never written to."""
    if entry.lib != "torch" or entry.dtype not in st._TORCH_DTYPES:
        raise FormatError(f"{user_key(entry.name, dcp=True)} is not a torch tensor in the checkpoint ({entry.lib} "
                          f"{entry.dtype})")
    dtype = getattr(torch, entry.dtype)
    shape = tuple(int(s) for s in entry.shape)
    if raw.size == 0:
        return torch.empty(shape, dtype=dtype)
    with warnings.catch_warnings():  # read-only mappings: torch warns, but the view is only read
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(raw, dtype=dtype).reshape(shape)
