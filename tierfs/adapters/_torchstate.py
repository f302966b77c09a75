"""The torch state of a :class:`~tierfs.CheckpointManager` step, through PyTorch DCP and without pickle.

A state's tensors (``torch.Tensor``, DTensor, ...) go to ``dcp.save``; every other leaf (numbers,
strings, lists, tuples, dicts, bytes, numpy arrays) is kept out of DCP, which would pickle it, and stored
per rank beside the rank's DCP items: one JSON entry (the index) plus one array entry per numpy array.
:func:`split` separates the two, :func:`extra` encodes the rest and :func:`decode`/:func:`assign` put it
back; :func:`run_dcp` calls DCP so that a rank's failure comes out as the original exception.

:func:`encode` and :func:`decode` are tierfs's one encoding of such values as JSON and arrays; a data
loader's state (:mod:`tierfs.adapters.loaderstate`) is stored with them too.
"""

from __future__ import annotations

import base64
import math
import sys
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from .. import state as st
from ..errors import (ArgumentError, ChecksumError, FormatError, RestoreError, StateMismatchError, StepNotFoundError,
                      TierfsError)

INDEX = "index"
INDEX_FORMAT = "tierfs.manager"
UNUSABLE = (RestoreError, ChecksumError, FormatError, StepNotFoundError, OSError)


class Unusable(TierfsError):
    """No tier holds a verified copy of a step for some rank: the restore tries an older step."""

    def __init__(self, skipped: list[tuple[str, int, str]]) -> None:
        super().__init__("; ".join(f"{t} step {s}: {w}" for t, s, w in skipped))
        self.skipped = skipped


@dataclass
class Split:
    tensors: dict[Any, Any] = field(default_factory=dict)  # nested, the caller's own tensor objects
    plain: list[tuple[list[Any], Any]] = field(default_factory=list)  # (key path, value) of other leaves
    lists: list[list[Any]] = field(default_factory=list)  # key paths of lists that hold tensors
    paths: dict[str, list[Any]] = field(default_factory=dict)  # DCP fqn -> key path of each tensor
    flat: dict[str, Any] = field(default_factory=dict)  # DCP fqn -> each tensor (as DCP's planner flattens)


@dataclass
class Saved:
    plain: list[tuple[list[Any], Any]]  # (key path, encoded value)
    lists: list[list[Any]]
    paths: dict[str, list[Any]]
    arrays: dict[int, np.ndarray]
    metrics: dict[str, Any]


def _torch() -> Any:
    return sys.modules.get("torch")


def has_tensor(x: Any, sharded_only: bool = False, depth: int = 0) -> bool:
    """Whether ``x`` holds a tensor (``sharded_only``: a DTensor or ShardedTensor) in its dicts, lists and
    tuples; ArgumentError when they nest deeper than a state may."""
    torch = _torch()
    if torch is None:
        return False
    if isinstance(x, torch.Tensor):
        return not sharded_only or type(x) is not torch.Tensor and type(x).__name__ in ("DTensor", "ShardedTensor")
    if isinstance(x, (Mapping, list, tuple)):
        st.check_depth(depth, "")
        return any(has_tensor(v, sharded_only, depth + 1) for v in (x.values() if isinstance(x, Mapping) else x))
    return False


def split(state: Mapping[str, Any]) -> Split:
    """Separate a state's tensors (for DCP) from its other leaves (stored without pickle)."""
    if not isinstance(state, Mapping):
        raise ArgumentError(f"state must be a mapping, got {type(state).__name__}")
    torch = _torch()
    out = Split()

    tensor = torch.Tensor if torch is not None else ()
    paths, flat = out.paths, out.flat

    def walk(x: Any, path: list[Any], prefix: str, into: dict[Any, Any]) -> None:
        st.check_depth(len(path), prefix)
        for k, v in (x.items() if isinstance(x, Mapping) else enumerate(x)):
            if type(k) is not str and type(k) is not int:
                if isinstance(k, bool) or not isinstance(k, (str, int)):
                    raise ArgumentError(f"state key {k!r} under {fqn(path) or 'the root'!r} is not a string or an "
                                        "int")
            if isinstance(v, tensor):
                into[k] = v
                f = prefix + str(k)  # DCP's flattened key, as fqn() joins it
                paths[f] = path + [k]
                flat[f] = v
            elif (type(v) is dict and v) or (type(v) is not dict and (isinstance(v, Mapping) and v)) or (
                    isinstance(v, list) and has_tensor(v)):
                p = path + [k]
                if isinstance(v, list):
                    out.lists.append(p)
                sub: dict[Any, Any] = {}
                walk(v, p, prefix + str(k) + ".", sub)
                if sub:
                    into[k] = sub
            elif has_tensor(v):
                raise ArgumentError(f"{fqn(path + [k])!r}: tensors inside a {type(v).__name__} are not supported; "
                                    "put them in a list or a dict")
            else:
                out.plain.append((path + [k], v))

    try:
        walk(state, [], "", out.tensors)
    finally:
        del walk  # it refers to itself: a cycle that would hold the tensors until the garbage collector runs
    return out


def fqn(path: Sequence[Any]) -> str:
    return ".".join(str(k) for k in path)  # DCP's flattened key


def key(path: Sequence[Any]) -> tuple[tuple[str, str], ...]:
    return tuple((type(k).__name__, str(k)) for k in path)


#: the tags of the JSON objects :func:`encode` makes for what JSON alone would lose
_TAGS = ("$f", "$t", "$d", "$b", "$a", "$T")


def encode(v: Any, arrays: list[np.ndarray], where: str) -> Any:
    """A JSON value :func:`decode` turns back into ``v``, types included, without pickle.

    Parameters
    ----------
    v : object
        None, bool, int, float, str, bytes, a numpy array or scalar, a torch tensor, or a list, tuple or
        dict (any keys, in order) of them.
    arrays : list of numpy.ndarray
        Where the arrays and tensors in ``v`` go (appended, each contiguous and 1-d; a tensor as its
        bytes, ``uint8``); the JSON value names them by their index in it.
    where : str
        How errors name ``v``; an element's name adds its index or key.

    Returns
    -------
    object
        A JSON value: tuples as ``{"$t": [...]}``, dicts as ``{"$d": [[key, value], ...]}``, non-finite
        floats as ``{"$f": "nan"}``, bytes as ``{"$b": base64}``, arrays as ``{"$a": i, "dtype": ...,
        "shape": ..., "scalar": ...}``, tensors as ``{"$T": i, "dtype": ..., "shape": ...}``.

    Raises
    ------
    ArgumentError
        ``v`` holds a value of another type (named by ``where``), a tensor subclass, or an array of a
        dtype the store cannot hold.
    """
    if v is None or isinstance(v, (bool, str)):
        return v
    if isinstance(v, int):
        return int(v)
    if isinstance(v, float):
        return float(v) if math.isfinite(v) else {"$f": repr(float(v))}
    torch = _torch()
    if torch is not None and isinstance(v, torch.Tensor):
        if type(v) not in (torch.Tensor, torch.nn.Parameter):
            raise ArgumentError(f"{where}: a {type(v).__name__} cannot be stored without pickle; give plain "
                                "tensors")
        leaf = st.to_leaf(where, v)  # the store's dtype allowlist; detached, on the CPU, contiguous
        assert leaf.data is not None
        arrays.append(leaf.data)
        return {"$T": len(arrays) - 1, "dtype": leaf.dtype, "shape": list(leaf.shape)}
    if isinstance(v, (bytes, bytearray, memoryview)):
        return {"$b": base64.b64encode(bytes(v)).decode("ascii")}
    if isinstance(v, (np.ndarray, np.generic)):  # (numpy's bytes_ is bytes, above)
        a = np.asarray(v)
        st.check_leaf(where, a)  # numeric dtypes only
        arrays.append(np.ascontiguousarray(a).reshape(-1))
        return {"$a": len(arrays) - 1, "dtype": a.dtype.str, "shape": list(a.shape),
                "scalar": isinstance(v, np.generic)}
    if isinstance(v, list):
        return [encode(x, arrays, f"{where}[{i}]") for i, x in enumerate(v)]
    if isinstance(v, tuple):
        return {"$t": [encode(x, arrays, f"{where}[{i}]") for i, x in enumerate(v)]}
    if isinstance(v, Mapping):
        return {"$d": [[encode(k, arrays, f"{where} (a key)"), encode(x, arrays, f"{where}[{k!r}]")]
                       for k, x in v.items()]}
    raise ArgumentError(f"{where}: cannot store a value of type {type(v).__name__} without pickle; use tensors, "
                        "numpy arrays, numbers, strings, bytes, None, or lists, tuples and dicts of them")


def decode(v: Any, arrays: Mapping[int, np.ndarray], what: str = "a saved state") -> Any:
    """The value :func:`encode` encoded (tensors as new torch tensors, arrays as new numpy arrays).

    Also reads the arrays of the older record form, ``{"$a": i, "shape": ..., "scalar": ...}`` without a
    dtype, whose array ``i`` is the array itself (in its dtype; a 0-d one kept 1-d): the manager's values
    beside the DCP items were written so before there was one encoder.

    Parameters
    ----------
    v : object
        The JSON value (after a round trip through JSON or not).
    arrays : mapping of int to numpy.ndarray
        The arrays ``v`` names, by index.
    what : str
        How errors name the saved state.

    Raises
    ------
    FormatError
        ``v`` is damaged, names an array ``arrays`` lacks, or uses an encoding this version does not read.
    """
    if isinstance(v, list):
        return [decode(x, arrays, what) for x in v]
    if not isinstance(v, dict):
        return v
    tag = next((t for t in _TAGS if t in v), None)
    try:
        if tag == "$f":
            return float(v["$f"])
        if tag == "$t":
            return tuple(decode(x, arrays, what) for x in v["$t"])
        if tag == "$d":
            return {_hashable(decode(k, arrays, what)): decode(x, arrays, what) for k, x in v["$d"]}
        if tag == "$b":
            return base64.b64decode(v["$b"])
        if tag == "$a" and "dtype" not in v:  # the older form: the array itself
            a = _array(arrays, v["$a"], what).reshape(tuple(v["shape"]))  # the store keeps 0-d arrays as 1-d
            return a[()] if v.get("scalar") else a
        if tag == "$a":
            a = _bits(arrays, v["$a"], what).view(np.dtype(str(v["dtype"]))).reshape(tuple(v["shape"])).copy()
            st.check_leaf(f"an array of {what}", a)
            return a[()] if v.get("scalar") else a
        if tag == "$T":
            t, raw = st.allocate("torch", str(v["dtype"]), v["shape"])  # validates the dtype
            bits = _bits(arrays, v["$T"], what)
            if bits.size != raw.size:
                raise FormatError(f"a tensor of {what} holds {bits.size} bytes, its dtype and shape need {raw.size}")
            raw[...] = bits
            return t
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise FormatError(f"{what} is damaged ({type(e).__name__}: {e})") from None
    raise FormatError(f"unknown value encoding {sorted(v)!r} in {what}")


def _array(arrays: Mapping[int, np.ndarray], i: Any, what: str) -> np.ndarray:
    if int(i) not in arrays:
        raise FormatError(f"{what} names array {i!r}, which the step lacks")
    return arrays[int(i)]


def _bits(arrays: Mapping[int, np.ndarray], i: Any, what: str) -> np.ndarray:
    return np.ascontiguousarray(_array(arrays, i, what)).reshape(-1).view(np.uint8)


def _hashable(k: Any) -> Any:
    return tuple(_hashable(x) for x in k) if isinstance(k, (list, tuple)) else k


def extra(parts: Split) -> dict[str, Any]:
    """The entries TieredWriter(extra=...) stores for this rank: the index and the numpy arrays."""
    arrays: list[np.ndarray] = []
    plain = [[p, encode(v, arrays, repr(fqn(p)))] for p, v in parts.plain]
    index = [INDEX_FORMAT, 1, plain, parts.lists, [[f, p] for f, p in parts.paths.items()]]
    for i, a in enumerate(arrays):
        st.to_leaf(f"a{i}", a)  # numeric dtypes only
    # JSON by construction (encode makes only JSON values; keys are str or int): not serialised to check it
    return {INDEX: st.Trusted(index), **{f"a{i}": a for i, a in enumerate(arrays)}}


def assign(root: Any, path: Sequence[Any], value: Any) -> None:
    """Set a leaf; a numpy array of the same dtype and shape is overwritten in place, as tensors are."""
    d = root
    for k in path[:-1]:
        if isinstance(d, list):
            d = d[k]
        else:
            d = d.setdefault(k, {})
    old = d[path[-1]] if isinstance(d, list) or path[-1] in d else None
    if isinstance(old, np.ndarray) and isinstance(value, np.ndarray) and old.dtype == value.dtype \
            and old.shape == value.shape and old.flags.writeable:
        np.copyto(old, value)
    else:
        d[path[-1]] = value


def target_from(md: Any, saved: Saved) -> dict[Any, Any]:
    """Empty tensors for every tensor of a DCP checkpoint, nested by their saved key paths."""
    import torch
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    root: dict[Any, Any] = {}
    for fqn, m in md.state_dict_metadata.items():
        if not isinstance(m, TensorStorageMetadata):
            raise StateMismatchError(f"{fqn!r} in the checkpoint is not a tensor (saved by dcp.save directly?)")
        path = saved.paths.get(fqn) or list((md.planner_data or {}).get(fqn, (fqn,)))
        assign(root, path, torch.empty(tuple(m.size), dtype=m.properties.dtype))
    return root


def lists(root: Any, paths: list[list[Any]]) -> Any:
    """Turn the dicts at ``paths`` (keyed 0..n-1) back into lists, innermost first."""
    for path in sorted(paths, key=len, reverse=True):
        parent: Any = None
        d = root
        for k in path:
            parent, d = d, d[k]
        if isinstance(d, dict) and sorted(d) == list(range(len(d))):
            parent[path[-1]] = [d[i] for i in range(len(d))]
    return root


def local_bytes(x: Any) -> int:
    torch = _torch()
    if isinstance(x, Mapping):
        return sum(local_bytes(v) for v in x.values())
    if torch is not None and isinstance(x, torch.Tensor):
        local = x.to_local() if hasattr(x, "to_local") else x
        return local.numel() * local.element_size()
    return 0


def failure_kind(e: BaseException) -> type[TierfsError]:
    """How a restore treats a rank's failure: a mismatch (StateMismatchError), a bad argument (ArgumentError)
    and anything else that is not about the copies (TierfsError) are raised; a RestoreError (no verified
    copy) skips to an older step."""
    for cls in (StateMismatchError, ArgumentError):
        if isinstance(e, cls):
            return cls
    return RestoreError if isinstance(e, (TierfsError, OSError)) else TierfsError


def run_dcp(fn: Callable[..., Any], *args: Any, unusable: bool = False, **kwargs: Any) -> Any:
    """Call a DCP function; a rank's failure comes out as the original exception, not DCP's wrapper.

    With ``unusable``, failures to read a verified copy on any rank (RestoreError, ChecksumError,
    FormatError, I/O errors) come out as :class:`Unusable`, so a restore can try an older step.
    """
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with warnings.catch_warnings():  # "torch.distributed ... uninitialized": single process, as intended
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            return fn(*args, **kwargs)
    except CheckpointException as ce:
        failures = {r: e for r, (e, _) in ce.failures.items()}
        if not failures:
            raise
        if unusable and all(isinstance(e, UNUSABLE) for e in failures.values()):
            raise Unusable([("", -1, f"rank {r}: {type(e).__name__}: {e}") for r, e in failures.items()]) from ce
        raise next(iter(failures.values())) from ce
    except UNUSABLE as e:  # raised outside DCP's collectives (TieredReader.read_metadata called directly)
        if not unusable:
            raise
        raise Unusable([("", -1, f"{type(e).__name__}: {e}")]) from e
