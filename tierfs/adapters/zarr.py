"""A state (named numpy arrays / torch tensors, nested dicts) as a zarr v3 group, stored as a tierfs step.

One zarr array per entry, each in one shard (the sharding codec packs its chunks into one object, with
an index), so an object store moves one object per entry. The group is encoded in memory
(``zarr.storage.MemoryStore``) and its keys are saved as the byte entries of an ordinary step with
``TieredStore.save``: the step is committed with the marker, copied to slower tiers, retained and
verified with crc32c like any other. Restoring reads the step back and opens the group from those bytes.

``write_state``/``read_state`` do the encoding against any zarr store, e.g. on ``tiered::`` URLs::

    store = zarr.storage.FsspecStore.from_url("tiered::s3://bucket/run/arrays",
                                              storage_options={"tiered": {...}, "s3": {...}})
    write_state(store, state)
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from .. import state as st
from ..errors import FormatError
from ..store import TieredStore
from . import _arrays

#: the step metadata key that marks a step written by :func:`save_zarr`
ADAPTER_KEY = "tierfs.adapter"
DEFAULT_CHUNK_BYTES = _arrays.DEFAULT_CHUNK_BYTES


def _zarr():
    try:
        import zarr
    except ImportError:
        raise ImportError("the zarr adapter needs zarr 3: pip install tierfs[zarr]") from None
    return zarr


def write_state(zstore: Any, state: Mapping[str, Any], *, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                compressors: Any = None) -> None:
    """Write ``state`` as a zarr v3 group into ``zstore`` (any zarr store), one sharded array per entry.

    Parameters
    ----------
    zstore:
        A zarr store: ``MemoryStore``, ``LocalStore``, ``FsspecStore`` (e.g. on ``tiered::s3://...``).
        Its contents are replaced.
    state:
        Names to numpy arrays or CPU torch tensors; nested dicts become subgroups; numbers and strings
        go into the group's attributes.
    chunk_bytes:
        Bytes per chunk inside each array's shard.
    compressors:
        zarr compressors (default none: checkpoints rarely compress and the copy stays at memory speed).
    """
    zarr = _zarr()
    root = zarr.open_group(store=zstore, mode="w", zarr_format=3)
    arrays: dict[str, dict[str, Any]] = {}
    values: dict[str, Any] = {}
    for name, a, info in _arrays.leaves(state):
        if a is None:
            values[name] = info["value"]
            continue
        chunks, shards = _arrays.layout(a.shape, a.itemsize, chunk_bytes)
        z = root.create_array(name, shape=a.shape, dtype=a.dtype, chunks=chunks or "auto",
                              shards=shards or None, compressors=compressors, fill_value=0)
        z[...] = a
        arrays[name] = info
    root.attrs["tierfs"] = {"version": 1, "arrays": arrays, "values": values}


def read_state(zstore: Any) -> dict[str, Any]:
    """Read a group written by :func:`write_state` back into (nested) numpy arrays / torch tensors."""
    zarr = _zarr()
    root = zarr.open_group(store=zstore, mode="r", zarr_format=3)
    index = root.attrs.get("tierfs")
    if not isinstance(index, dict) or index.get("version") != 1:
        raise FormatError("this zarr group was not written by tierfs.adapters.zarr.write_state")
    out: dict[str, Any] = dict(index.get("values", {}))
    for name, info in index["arrays"].items():
        out[name] = _arrays.restore(root[name][...], info)
    return st.unflatten(out)


def save_zarr(store: TieredStore, step: int, state: Mapping[str, Any], metadata: Mapping[str, Any] | None = None,
              *, chunk_bytes: int = DEFAULT_CHUNK_BYTES, compressors: Any = None, **save_kwargs: Any) -> bool:
    """Save ``state`` as a zarr group that is tierfs step ``step`` of ``store``.

    Returns what ``store.save`` returns (False when no tier's policy takes the step). ``save_kwargs``
    (``metrics``, ``force``, ``overwrite``, ``blocking``, ...) go to ``store.save``.
    """
    zarr = _zarr()
    keys: dict[str, Any] = {}
    write_state(zarr.storage.MemoryStore(store_dict=keys), state, chunk_bytes=chunk_bytes,
                compressors=compressors)
    entries = st.Flat((k, v.as_numpy_array()) for k, v in keys.items())  # zero-copy views of the encoded bytes
    meta = {**dict(metadata or {}), ADAPTER_KEY: "zarr"}
    return store.save(step, entries, meta, **save_kwargs)


def restore_zarr(store: TieredStore, step: int | None = None, *, tiers: Sequence[str] | None = None
                 ) -> dict[str, Any]:
    """Restore a step written by :func:`save_zarr` (default: the newest step) from the fastest tier whose
    copy verifies; returns the state as saved (nested dicts of numpy arrays / torch tensors)."""
    zarr = _zarr()
    from zarr.buffer import default_buffer_prototype

    state, info = store.restore(step, tiers=tiers)
    if info.metadata.get(ADAPTER_KEY) != "zarr":
        raise FormatError(f"step {info.step} was not saved by save_zarr (restore it with store.restore)")
    buf = default_buffer_prototype().buffer
    keys = {k: buf.from_array_like(np.asarray(v).reshape(-1).view(np.uint8)) for k, v in st.flatten(state)}
    return read_state(zarr.storage.MemoryStore(store_dict=keys))
