"""Arrays through tensorstore (zarr3 driver, sharded), stored as tierfs steps or on any kvstore.

tensorstore cannot call into fsspec; it reaches storage through its own kvstore drivers. So:

- :func:`save_tensorstore` writes the arrays with tensorstore into its ``memory`` kvstore, collects every
  key (``KvStore.list``/``read``) and saves them as the byte entries of an ordinary step with
  ``TieredStore.save``: committed with the marker, copied to slower tiers, retained, verified with
  crc32c. :func:`restore_tensorstore` reads the step back, writes the keys into a fresh ``memory``
  kvstore and opens the arrays there.
- :func:`write_arrays` / :func:`read_arrays` do the same against any kvstore spec: ``file`` on a RAM
  directory (e.g. ``TieredFileSystem.ram_path(...)``, then ``adopt`` so the drain uploads it), or
  ``s3`` / ``gcs`` on object storage.

Every array gets one shard (``sharding_indexed`` codec) of chunks of about 4 MiB; an index key
``tierfs.json`` records each entry's library and dtype so torch tensors come back as they were.
"""

from __future__ import annotations

import json
from typing import Any, Mapping, Sequence

import numpy as np

from .. import state as st
from ..errors import FormatError
from ..store import TieredStore
from . import _arrays

#: the step metadata key that marks a step written by :func:`save_tensorstore`
ADAPTER_KEY = "tierfs.adapter"
#: the key, next to the arrays, that lists them
INDEX_KEY = "tierfs.json"


def _ts():
    try:
        import tensorstore
    except ImportError:
        raise ImportError("the tensorstore adapter needs tensorstore: pip install tierfs[tensorstore]") from None
    return tensorstore


def _sub(kvstore: Mapping[str, Any], name: str) -> dict[str, Any]:
    """``kvstore`` with ``name/`` appended to its path."""
    base = str(kvstore.get("path", ""))
    if base and not base.endswith("/"):
        base += "/"
    return {**kvstore, "path": f"{base}{name}/" if name else base}


def _array_spec(kvstore: Mapping[str, Any], name: str, a: np.ndarray, chunk_bytes: int) -> dict[str, Any]:
    chunks, shard = _arrays.layout(a.shape, a.itemsize, chunk_bytes)
    inner = [{"name": "bytes", "configuration": {"endian": "little"}}]
    codecs = inner if not a.shape else [{"name": "sharding_indexed", "configuration": {
        "chunk_shape": list(chunks), "codecs": inner,
        "index_codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}]}}]
    return {"driver": "zarr3", "kvstore": _sub(kvstore, name), "store_data_equal_to_fill_value": True,
            "metadata": {
        "shape": list(a.shape), "data_type": a.dtype.newbyteorder("=").name,
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(shard)}},
        "codecs": codecs, "fill_value": False if a.dtype.kind == "b" else 0}}


def write_arrays(kvstore: Mapping[str, Any], arrays: Mapping[str, Any], *, context: Any = None,
                 chunk_bytes: int = _arrays.DEFAULT_CHUNK_BYTES, delete_existing: bool = False) -> None:
    """Write ``arrays`` with tensorstore under the kvstore spec ``kvstore``, one sharded zarr3 array each.

    Parameters
    ----------
    kvstore:
        A tensorstore kvstore spec, e.g. ``{"driver": "file", "path": "/dev/shm/.../ts/"}``,
        ``{"driver": "s3", "bucket": ..., "path": ..., "endpoint": ...}`` or ``{"driver": "gcs", ...}``.
    arrays:
        Names to numpy arrays or CPU torch tensors (nested dicts become ``a/b`` paths); numbers and
        strings go into the index.
    context:
        A ``tensorstore.Context`` (credentials, shared ``memory`` kvstore, concurrency).
    chunk_bytes:
        Bytes per chunk inside each array's shard.
    delete_existing:
        Delete each array's existing keys first (needed when an array's shape or dtype changed; by
        default an existing array of the same layout is overwritten in place, every chunk written). Do
        not use it against gcp-storage-emulator: it ignores the key range of a listing, so tensorstore's
        range delete removes other arrays' keys too (real GCS honours the range).
    """
    ts = _ts()
    context = context if context is not None else ts.Context()
    index: dict[str, Any] = {"version": 1, "arrays": {}, "values": {}}
    writes = []
    for name, a, info in _arrays.leaves(arrays):
        if a is None:
            index["values"][name] = info["value"]
            continue
        t = ts.open(_array_spec(kvstore, name, a, chunk_bytes), create=True, open=not delete_existing,
                    delete_existing=delete_existing, context=context).result()
        writes.append(t.write(a.astype(a.dtype.newbyteorder("="), copy=False)))
        index["arrays"][name] = info
    for w in writes:
        w.result()
    kv = ts.KvStore.open(_sub(kvstore, ""), context=context).result()
    kv.write(INDEX_KEY, json.dumps(index).encode()).result()  # last: the arrays are complete


def read_arrays(kvstore: Mapping[str, Any], *, context: Any = None) -> dict[str, Any]:
    """Read what :func:`write_arrays` wrote under ``kvstore`` into (nested) numpy arrays / torch tensors."""
    ts = _ts()
    context = context if context is not None else ts.Context()
    kv = ts.KvStore.open(_sub(kvstore, ""), context=context).result()
    raw = kv.read(INDEX_KEY).result()
    if raw.state != "value":
        raise FormatError(f"no {INDEX_KEY} under {kvstore}: not written by tierfs.adapters.tensorstore")
    try:
        index = json.loads(raw.value)
        arrays, values = dict(index["arrays"]), dict(index["values"])
    except (ValueError, KeyError, TypeError) as e:
        raise FormatError(f"{INDEX_KEY} is damaged ({e})") from None
    if index.get("version") != 1:
        raise FormatError(f"{INDEX_KEY} version {index.get('version')!r} is not supported; upgrade tierfs")
    opened = {n: ts.open({"driver": "zarr3", "kvstore": _sub(kvstore, _safe(n))}, open=True, context=context)
              for n in arrays}
    reads = {n: f.result().read() for n, f in opened.items()}
    out: dict[str, Any] = dict(values)
    for n, r in reads.items():
        out[n] = _arrays.restore(r.result(), arrays[n])
    return st.unflatten(out)


def _safe(name: str) -> str:
    """An array name read from an index, checked before it becomes a kvstore path."""
    if not isinstance(name, str) or any(p in ("", ".", "..") for p in name.split("/")):
        raise FormatError(f"unsafe array name {name!r} in {INDEX_KEY}")
    return name


def save_tensorstore(store: TieredStore, step: int, arrays: Mapping[str, Any],
                     metadata: Mapping[str, Any] | None = None, *,
                     chunk_bytes: int = _arrays.DEFAULT_CHUNK_BYTES, **save_kwargs: Any) -> bool:
    """Save ``arrays`` through tensorstore as tierfs step ``step`` of ``store``.

    Returns what ``store.save`` returns. ``save_kwargs`` (``metrics``, ``force``, ``overwrite``,
    ``blocking``, ...) go to ``store.save``.
    """
    ts = _ts()
    ctx = ts.Context()  # its own memory kvstore
    write_arrays({"driver": "memory"}, arrays, context=ctx, chunk_bytes=chunk_bytes)
    kv = ts.KvStore.open({"driver": "memory"}, context=ctx).result()
    keys = kv.list().result()
    reads = [kv.read(k) for k in keys]
    entries = st.Flat((k.decode(), np.frombuffer(r.result().value, dtype=np.uint8)) for k, r in zip(keys, reads))
    meta = {**dict(metadata or {}), ADAPTER_KEY: "tensorstore"}
    return store.save(step, entries, meta, **save_kwargs)


def restore_tensorstore(store: TieredStore, step: int | None = None, *, tiers: Sequence[str] | None = None
                        ) -> dict[str, Any]:
    """Restore a step written by :func:`save_tensorstore` (default: the newest) from the fastest tier
    whose copy verifies."""
    ts = _ts()
    state, info = store.restore(step, tiers=tiers)
    if info.metadata.get(ADAPTER_KEY) != "tensorstore":
        raise FormatError(f"step {info.step} was not saved by save_tensorstore (restore it with store.restore)")
    ctx = ts.Context()
    kv = ts.KvStore.open({"driver": "memory"}, context=ctx).result()
    writes = [kv.write(k, np.asarray(v).tobytes()) for k, v in st.flatten(state)]
    for w in writes:
        w.result()
    return read_arrays({"driver": "memory"}, context=ctx)
