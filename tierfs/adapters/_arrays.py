"""Leaves of a user's state as numpy arrays for array libraries (zarr, tensorstore), and back.

torch tensors keep their dtype through the round trip; dtypes numpy lacks (bfloat16, float8) travel as
unsigned integers of the same width, bit for bit. Nothing here pickles.
"""

from __future__ import annotations

from typing import Any, Iterator, Mapping

import numpy as np

from .. import state as st
from ..errors import ArgumentError, FormatError

#: bytes per chunk inside a shard (a read of part of an array fetches whole chunks)
DEFAULT_CHUNK_BYTES = 4 << 20

#: torch dtypes without a numpy counterpart -> the unsigned integer type of the same width
_AS_BITS = {"bfloat16": "uint16", "float8_e4m3fn": "uint8", "float8_e5m2": "uint8"}


def leaves(state: Mapping[str, Any]) -> Iterator[tuple[str, np.ndarray | None, dict[str, Any]]]:
    """``(name, array, info)`` per leaf of ``state`` (nested dicts joined with ``/``).

    ``array`` is a numpy array sharing memory with the leaf where possible, or None for a JSON value,
    which is then ``info["value"]``. ``info`` otherwise holds the leaf's library and dtype.
    """
    for name, v in st.flatten(state):
        parts = name.split(st.SEP)
        if any(p in ("", ".", "..") or p.startswith("__") for p in parts):
            raise ArgumentError(f"state name {name!r} cannot be an array path: no empty, '.', '..' or '__*' parts")
        if isinstance(v, (bytes, bytearray, memoryview)):
            raise ArgumentError(f"{name!r}: wrap bytes as an array, e.g. np.frombuffer(data, np.uint8)")
        leaf = st.to_leaf(name, v)  # the store's dtype allowlist; tensors are detached and on the CPU
        if leaf.kind == "json":
            yield name, None, {"value": leaf.value}
            continue
        dtype = leaf.dtype if leaf.lib == "numpy" else _AS_BITS.get(leaf.dtype, leaf.dtype)
        assert leaf.data is not None
        yield name, leaf.data.view(np.dtype(dtype)).reshape(leaf.shape), {"lib": leaf.lib, "dtype": leaf.dtype}


def restore(a: Any, info: Mapping[str, Any]) -> Any:
    """The user's leaf (numpy array or torch tensor, original dtype) from an array read back."""
    if info.get("lib") not in ("numpy", "torch"):
        raise FormatError(f"unknown array library {info.get('lib')!r} in the array index")
    src = np.asarray(a, order="C")  # (np.ascontiguousarray would make 0-d arrays 1-d)
    obj, raw = st.allocate(str(info.get("lib")), str(info.get("dtype")), src.shape)  # validates both
    if info.get("lib") == "numpy":
        src = src.astype(np.dtype(info["dtype"]), copy=False)  # byte order as saved
    data = src.reshape(-1).view(np.uint8)
    if data.size != raw.size:
        raise FormatError(f"array holds {data.size} bytes, expected {raw.size} for {info}")
    raw[...] = data
    return obj


def layout(shape: tuple[int, ...], itemsize: int, chunk_bytes: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(chunks, shard)``: chunks of about ``chunk_bytes`` split along the first axis, and one shard
    holding them all (a multiple of the chunk shape). Both are ``()`` for a 0-d array."""
    if not shape:
        return (), ()
    row = max(1, itemsize * int(np.prod(shape[1:], dtype=np.int64)))
    rows = max(1, min(max(shape[0], 1), chunk_bytes // row))
    chunks = (rows, *(max(1, n) for n in shape[1:]))
    return chunks, (-(-max(shape[0], 1) // rows) * rows, *chunks[1:])
