"""Turning a user's state into named byte buffers and back, without pickle.

Leaves are numpy arrays, dense torch tensors (any dtype, bfloat16 included), or JSON-able scalars and
strings. Nested dicts are flattened with ``/`` between keys, so a key is a non-empty string (or an int)
without ``/``, and every name a state gives is one a reader takes back (:func:`tierfs.format.entry_name_problem`:
at most 4,096 characters, no control characters); anything else is refused at save. torch is imported only
when a tensor is seen.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

import numpy as np

from .errors import ArgumentError, FormatError, StateMismatchError, TierfsError

SEP = "/"
#: how deep a state's dicts may nest (a deeper one is a mistake, e.g. a dict that contains itself)
MAX_DEPTH = 200
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


class Flat(dict):
    """A state whose keys are whole entry names, nested keys already joined by ``/`` (what the adapters save:
    DCP's items, a zarr store's keys, a checkpoint directory's files): its keys may hold ``/``. A user's
    state is a plain mapping, whose keys may not (:func:`check_key`)."""


def check_key(k: str, prefix: str) -> None:
    """Raise ArgumentError unless the string ``k`` can be a key of a user's state under ``prefix``: not empty
    and without ``/`` (which joins nested keys: ``{"a/b": x}`` would come back as ``{"a": {"b": x}}``)."""
    if not k or SEP in k:
        where = f" under {prefix[:-1]!r}" if prefix else ""
        why = "an empty key" if not k else f"key {k!r}"
        raise ArgumentError(f"state has {why}{where}: keys must be non-empty and without {SEP!r}, which joins "
                            f"nested keys ({{'a': {{'b': x}}}} is saved as 'a{SEP}b'); rename it or nest it as a dict")


def check_depth(depth: int, prefix: str) -> None:
    """Raise ArgumentError when a state's dicts nest deeper than :data:`MAX_DEPTH` (at ``prefix``)."""
    if depth > MAX_DEPTH:
        where = f" (under {prefix[:60]!r}...)" if prefix else ""
        raise ArgumentError(f"state nests dicts more than {MAX_DEPTH} deep{where}: a dict that contains itself, "
                            "or a structure to store as arrays or a JSON string")


def flatten(state: Mapping[str, Any], prefix: str = "", depth: int = 0) -> Iterator[tuple[str, Any]]:
    """Yield ``(name, leaf)`` pairs of a nested mapping, depth first, keys joined by ``/``."""
    if not isinstance(state, Mapping):
        raise ArgumentError(f"state must be a mapping of names to arrays, got {type(state).__name__}")
    check_depth(depth, prefix)
    for k, v in state.items():
        if not isinstance(k, str):
            if not isinstance(k, int) or isinstance(k, bool):
                raise ArgumentError(f"state keys must be strings or ints, got {k!r} under {prefix or 'the root'!r}")
        elif type(state) is not Flat:
            check_key(k, prefix)
        name = f"{prefix}{k}"
        if isinstance(v, Mapping):
            yield from flatten(v, name + SEP, depth + 1)
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
    size: int = 0  # the bytes of an array described without its data (``to_leaf(..., data=False)``)

    @property
    def nbytes(self) -> int:
        return self.size if self.data is None else self.data.nbytes


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
        check_tensor(name, v)
    elif isinstance(v, np.generic) or v is None or isinstance(v, (bool, int, float, str, list, tuple)):
        try:
            json.dumps(v.item() if isinstance(v, np.generic) else v, allow_nan=False)
        except (TypeError, ValueError):
            raise ArgumentError(f"{name!r}: value is not JSON-serialisable without loss; store it as an array "
                                "or a string") from None
    elif not isinstance(v, (bytes, bytearray, memoryview)):
        raise ArgumentError(f"{name!r}: unsupported leaf type {type(v).__name__}; use numpy arrays, torch "
                            "tensors, numbers, strings or nested dicts of them")


def check_tensor(name: str, v: Any, label: str | None = None) -> None:
    """Raise ArgumentError, naming the leaf (``label``, else ``repr(name)``), for a tensor whose values cannot
    be read as flat bytes: a sparse or other non-strided layout, or a meta tensor (which holds no values)."""
    torch = _torch()
    name = label or repr(name)
    if v.layout != torch.strided:
        raise ArgumentError(f"{name}: a tensor of layout {v.layout} is not supported; save a dense tensor "
                            "(.to_dense()), or its parts (indices and values) as tensors of their own")
    if v.is_meta:
        raise ArgumentError(f"{name}: a meta tensor holds no values to save; materialise it first (e.g. "
                            "model.to_empty(device=...) and initialise it)")


def to_leaf(name: str, v: Any, data: bool = True) -> Leaf:
    """Describe one leaf; arrays become a uint8 view of their bytes (a copy only if non-contiguous, or on a
    device). ``data=False``: a tensor is described without its bytes (nothing copied, from a device either)."""
    check_leaf(name, v)
    if not data and is_tensor(v) and type(v) in (_torch().Tensor, _torch().nn.Parameter):
        return Leaf(name, "array", "torch", str(v.dtype).removeprefix("torch."), tuple(v.shape),
                    size=v.numel() * v.element_size())
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
        u8 = flat.view(_torch().uint8).numpy() if flat.numel() else np.empty(0, np.uint8)
        return Leaf(name, "array", "torch", dt, tuple(t.shape), u8)
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


def read_only_view(lib: str, dtype: str, shape: Any, raw: np.ndarray, label: str) -> Any:
    """A typed, zero-copy view of ``raw`` (a copy-on-write mapping) that refuses writes: a numpy array
    with ``writeable=False``, or a torch tensor whose in-place operations (and ``out=``) raise TierfsError
    naming ``label``; its views stay read-only, other results are plain tensors."""
    if lib != "torch":
        view = view_as(lib, dtype, shape, raw)
        view.flags.writeable = False
        return view
    t = view_as(lib, dtype, shape, raw)
    cls = _read_only_class()
    t = t.as_subclass(cls)
    t._tierfs_label = label
    return t


#: in-place tensor operations that change no value (autograd's flags), allowed on a read-only view
_FLAGS_ONLY = frozenset({"requires_grad_", "retain_grad", "detach_", "rename_"})
#: Python's in-place operators and item assignment
_IN_PLACE_DUNDERS = frozenset({
    "__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__", "__ipow__",
    "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__", "__imatmul__"})
_read_only: Any = None


def _read_only_class() -> Any:
    """The torch.Tensor subclass of zero-copy views (made once torch is imported)."""
    global _read_only
    if _read_only is not None:
        return _read_only
    torch = _require_torch()
    tensor: Any = torch.Tensor

    class ReadOnlyTensor(tensor):
        """A read-only, zero-copy view of a checkpoint in the RAM tier (``restore(zero_copy=True)``):
        in-place operations and ``out=`` raise; ``clone()`` gives a tensor of your own."""

        _tierfs_label = "a zero-copy view"

        @classmethod
        def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            for t in _written(getattr(func, "__name__", ""), args, kwargs):
                if isinstance(t, cls):
                    raise TierfsError(
                        f"{t._tierfs_label} is a read-only, zero-copy view of a checkpoint in the RAM tier "
                        f"({getattr(func, '__name__', func)} would write into it); clone() it to change it, "
                        "or restore without zero_copy=True")
            with torch._C.DisableTorchFunctionSubclass():
                out = func(*args, **kwargs)
            return _shared(out, _storages(cls, args), cls)

        def __reduce_ex__(self, protocol: Any) -> Any:  # pickled (torch.save) as a plain tensor
            with torch._C.DisableTorchFunctionSubclass():
                return torch.Tensor.__reduce_ex__(self.as_subclass(torch.Tensor), protocol)

        def __deepcopy__(self, memo: dict[int, Any]) -> Any:  # a copy of one's own
            with torch._C.DisableTorchFunctionSubclass():
                copy = torch.Tensor.clone(self.detach()).requires_grad_(self.requires_grad)
            memo[id(self)] = copy
            return copy

    ReadOnlyTensor.__qualname__ = ReadOnlyTensor.__name__
    _read_only = ReadOnlyTensor
    return _read_only


def _written(name: str, args: Any, kwargs: Mapping[str, Any]) -> Iterator[Any]:
    """The tensors a torch operation called ``name`` writes into: the first argument of an in-place one,
    and ``out=``."""
    targets: list[Any] = []
    first = args[0] if args else kwargs.get("tensor", kwargs.get("input", kwargs.get("self")))
    if (name.endswith("_") and not name.endswith("__") and name not in _FLAGS_ONLY) or name in _IN_PLACE_DUNDERS \
            or kwargs.get("inplace") is True:
        targets.append(first)
    if kwargs.get("out") is not None:
        targets.append(kwargs["out"])
    for t in targets:
        yield from (t if isinstance(t, (list, tuple)) else [t])


def _storage(t: Any) -> int | None:
    try:
        return int(t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):  # no storage (meta, sparse)
        return None


def _storages(cls: Any, args: Any) -> dict[int, str]:
    """The storages of the read-only views among ``args`` (and in the lists among them), with their labels."""
    out: dict[int, str] = {}
    for a in args:
        for t in a if isinstance(a, (list, tuple)) else [a]:
            if isinstance(t, cls):
                ptr = _storage(t)
                if ptr:
                    out[ptr] = t._tierfs_label
    return out


def _shared(out: Any, storages: dict[int, str], cls: Any) -> Any:
    """``out`` with every tensor that shares a storage in ``storages`` read-only again (a view of a view),
    and numpy arrays of a tensor's memory read-only."""
    if isinstance(out, np.ndarray):
        out.flags.writeable = False  # (``numpy()``, ``__array__``: never written through a tensor's memory)
        return out
    if not storages:
        return out
    torch = _torch()
    if isinstance(out, torch.Tensor):
        label = None if isinstance(out, cls) else storages.get(_storage(out) or 0)
        if label is not None:
            out = out.as_subclass(cls)
            out._tierfs_label = label
        return out
    if isinstance(out, (tuple, list)):
        items = [_shared(o, storages, cls) for o in out]
        try:
            return type(out)(items)
        except TypeError:  # a named tuple
            return type(out)(*items)
    return out


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
    if _read_only is not None and isinstance(target, _read_only):
        raise StateMismatchError(f"{label}: the target tensor is a read-only, zero-copy view of a checkpoint; give "
                                 "a tensor of your own (clone() it), or restore into new tensors with restore()")


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
