"""Turning a user's state into named byte buffers and back, without pickle.

Leaves are numpy arrays, CPU torch tensors (any dtype, bfloat16 included), or JSON-able scalars and
strings. Nested dicts are flattened with ``/`` between keys. torch is imported only when a tensor is seen.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

import numpy as np

from .errors import ArgumentError, FormatError, StateMismatchError

SEP = "/"
_NUMPY_DTYPE_RE = re.compile(r"^[<>|=]?(b1|[iu][1248]|f[248]|c(8|16))$")
_TORCH_DTYPES = {
    "float64", "float32", "float16", "bfloat16", "complex64", "complex128", "int64", "int32", "int16",
    "int8", "uint8", "uint16", "uint32", "uint64", "bool", "float8_e4m3fn", "float8_e5m2",
}


def _torch():
    return sys.modules.get("torch")


def is_tensor(x: Any) -> bool:
    t = _torch()
    return t is not None and isinstance(x, t.Tensor)


def flatten(state: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Yield ``(name, leaf)`` pairs of a nested mapping, depth first, keys joined by ``/``."""
    if not isinstance(state, Mapping):
        raise ArgumentError(f"state must be a mapping of names to arrays, got {type(state).__name__}")
    for k, v in state.items():
        if not isinstance(k, str):
            if not isinstance(k, int) or isinstance(k, bool):
                raise ArgumentError(f"state keys must be strings or ints, got {k!r} under {prefix or 'the root'!r}")
        name = f"{prefix}{k}"
        if isinstance(v, Mapping):
            yield from flatten(v, name + SEP)
        else:
            yield name, v


def unflatten(flat: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, v in flat.items():
        d = out
        *parents, last = name.split(SEP)
        for p in parents:
            d = d.setdefault(p, {})
        d[last] = v
    return out


class Trusted:
    """A JSON value tierfs built itself, valid by construction (the manager's index of a torch state, DCP's
    metadata it replays): saved as the value it wraps, without serialising it once more to check it."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


@dataclass
class Leaf:
    """A leaf reduced to what the format stores: flat bytes (arrays) or a JSON value."""

    name: str
    kind: str  # "array" or "json"
    lib: str = "numpy"
    dtype: str = ""
    shape: tuple[int, ...] = ()
    data: np.ndarray | None = None  # 1-D uint8 view sharing memory with the source
    value: Any = None

    @property
    def nbytes(self) -> int:
        return 0 if self.data is None else self.data.nbytes


def check_state(state: Mapping[str, Any]) -> None:
    """Check every key and leaf of a state as :func:`to_leaf` would, copying nothing (a save checks its
    state first, so that a bad leaf fails before anything is written or replaced)."""
    for name, v in flatten(state):
        check_leaf(name, v)


def check_leaf(name: str, v: Any) -> None:
    """Raise ArgumentError, naming the leaf, unless :func:`to_leaf` can store ``v``; copies nothing."""
    if type(v) is Trusted:
        return
    if isinstance(v, np.ndarray):
        if not _NUMPY_DTYPE_RE.match(v.dtype.str):
            raise ArgumentError(f"{name!r}: numpy dtype {v.dtype} is not supported (object/structured arrays "
                                "would need pickle); convert it to a numeric dtype")
    elif is_tensor(v):
        if str(v.dtype).removeprefix("torch.") not in _TORCH_DTYPES:
            raise ArgumentError(f"{name!r}: torch dtype {v.dtype} is not supported")
    elif isinstance(v, np.generic) or v is None or isinstance(v, (bool, int, float, str, list, tuple)):
        try:
            json.dumps(v.item() if isinstance(v, np.generic) else v, allow_nan=False)
        except (TypeError, ValueError):
            raise ArgumentError(f"{name!r}: value is not JSON-serialisable without loss; store it as an array "
                                "or a string") from None
    elif not isinstance(v, (bytes, bytearray, memoryview)):
        raise ArgumentError(f"{name!r}: unsupported leaf type {type(v).__name__}; use numpy arrays, torch "
                            "tensors, numbers, strings or nested dicts of them")


def to_leaf(name: str, v: Any) -> Leaf:
    """Describe one leaf; arrays become a uint8 view of their bytes (a copy only if non-contiguous)."""
    check_leaf(name, v)
    if isinstance(v, np.ndarray):
        a = np.asarray(v, order="C")  # (np.ascontiguousarray would turn a 0-d array into shape (1,))
        return Leaf(name, "array", "numpy", a.dtype.str, tuple(a.shape), a.reshape(-1).view(np.uint8))
    if is_tensor(v):
        t = v.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.contiguous()
        dt = str(t.dtype).removeprefix("torch.")
        flat = t.reshape(-1)
        data = flat.view(_torch().uint8).numpy() if flat.numel() else np.empty(0, np.uint8)
        return Leaf(name, "array", "torch", dt, tuple(t.shape), data)
    if isinstance(v, np.generic):
        v = v.item()
    if type(v) is Trusted:
        return Leaf(name, "json", value=v.value)
    if isinstance(v, (bytes, bytearray, memoryview)):
        a = np.frombuffer(v, dtype=np.uint8)
        return Leaf(name, "array", "numpy", "|u1", (a.size,), a)
    return Leaf(name, "json", value=v)


def allocate(lib: str, dtype: str, shape: list[int] | tuple[int, ...]) -> tuple[Any, np.ndarray]:
    """A fresh array/tensor for an entry and a writable 1-D uint8 view of its bytes."""
    shape = tuple(int(s) for s in shape)
    if lib == "torch":
        torch = _require_torch()
        if dtype not in _TORCH_DTYPES:
            raise FormatError(f"unknown torch dtype {dtype!r} in manifest")
        t = torch.empty(shape, dtype=getattr(torch, dtype))
        flat = t.reshape(-1)
        return t, (flat.view(torch.uint8).numpy() if flat.numel() else np.empty(0, np.uint8))
    if not _NUMPY_DTYPE_RE.match(dtype):
        raise FormatError(f"unknown numpy dtype {dtype!r} in manifest")
    a = np.empty(shape, dtype=np.dtype(dtype))
    return a, a.reshape(-1).view(np.uint8)


def view_as(lib: str, dtype: str, shape, raw: np.ndarray) -> Any:
    """A typed, zero-copy view of raw bytes (read-only if ``raw`` is)."""
    shape = tuple(int(s) for s in shape)
    if lib == "torch":
        torch = _require_torch()
        return torch.frombuffer(raw, dtype=getattr(torch, dtype)).reshape(shape) if raw.size else \
            torch.empty(shape, dtype=getattr(torch, dtype))
    return raw.view(np.dtype(dtype)).reshape(shape)


def dtype_name(lib: str, dtype: str) -> str:
    """A dtype as messages name it, the same for numpy and torch when the bytes are the same
    (``"<f8"`` and torch's ``"float64"`` are both ``"float64"``)."""
    if lib == "torch":
        return dtype
    try:
        d = np.dtype(dtype)
    except TypeError:
        return dtype
    return d.name if d.byteorder in ("=", "|") or d.byteorder == ("<" if sys.byteorder == "little" else ">") \
        else d.str


def check_target(label: str, target: Any, lib: str, dtype: str, shape: Any) -> None:
    """Raise StateMismatchError (naming the entry by ``label``) when an array/tensor ``target`` cannot take
    an entry of this dtype and shape in place; other targets are replaced, not checked."""
    if isinstance(target, np.ndarray):
        have = (dtype_name("numpy", target.dtype.str), tuple(target.shape))
    elif is_tensor(target):
        have = (str(target.dtype).removeprefix("torch."), tuple(target.shape))
    else:
        return
    want = (dtype_name(lib, dtype), tuple(int(s) for s in shape))
    if have != want:
        raise StateMismatchError(f"{label}: the target has dtype {have[0]} and shape {have[1]}, the checkpoint "
                                 f"{want[0]} and shape {want[1]}; give a target of the checkpoint's dtype and shape")
    if isinstance(target, np.ndarray) and not target.flags.writeable:
        raise StateMismatchError(f"{label}: the target array is read-only; give a writable array (or restore "
                                 "into new arrays with restore())")


def target_view(name: str, target: Any, lib: str, dtype: str, shape: Any) -> np.ndarray | None:
    """A writable uint8 view of a preallocated target, or None when it cannot be written in place."""
    check_target(repr(name), target, lib, dtype, shape)
    if isinstance(target, np.ndarray):
        if target.flags.c_contiguous and target.flags.writeable:
            return target.reshape(-1).view(np.uint8)
        return None
    if is_tensor(target):
        if target.device.type == "cpu" and target.is_contiguous() and target.numel():
            return target.detach().reshape(-1).view(_torch().uint8).numpy()
        return None
    return None


def _require_torch():
    t = _torch()
    if t is None:
        try:
            import torch as t  # noqa: F811
        except ImportError:
            raise FormatError("this checkpoint holds torch tensors: install tierfs[torch]") from None
    return t
