"""Bit-exact comparison of checkpoint states, for tests.

    from tierfs.testing import assert_states_equal

    out, _ = store.restore()
    assert_states_equal(out, state)   # AssertionError: states differ at ['model']['w']: ...

torch is imported only when a state holds a tensor (tierfs works without it).
"""

from __future__ import annotations

import math
import sys
from typing import Any, NoReturn

import numpy as np

__all__ = ["assert_states_equal"]


def assert_states_equal(a: Any, b: Any, *, key_order: bool = False) -> None:
    """Raise AssertionError unless ``a`` and ``b`` are the same state, bit for bit.

    Parameters
    ----------
    a, b:
        States: nested dicts, lists and tuples of leaves (torch tensors, numpy arrays, bytes, scalars).
    key_order:
        Also require every dict's keys in the same order (by default, as for ``==`` on dicts, the order
        does not matter).

    Raises
    ------
    AssertionError
        At the first difference, naming its key path (e.g. ``['model']['w']``) and what differs.

    Notes
    -----
    Two states are equal when they have the same structure and equal leaves:

    * dicts (``dict``, ``OrderedDict`` and other ``dict`` subclasses alike): the same keys (in the same
      order with ``key_order``), equal values;
    * lists and tuples: the same type and length, equal items in order;
    * torch tensors: the same dtype and shape and the same raw bytes (bfloat16 and empty tensors included;
      the device is not compared);
    * numpy arrays: the same dtype and shape and the same raw bytes (object arrays: equal items);
    * every other leaf (bytes, str, numbers, None, numpy scalars, ...): the same type and equal; floats
      also in the sign of zero, and NaN equals NaN.

    Raw bytes compare NaNs by their bits, so a tensor holding NaNs equals its exact copy.
    """
    _Compare(key_order).compare(a, b, "")


def _fail(path: str, why: str) -> NoReturn:
    raise AssertionError(f"states differ at {path or 'the top level'}: {why}")


class _Compare:
    def __init__(self, key_order: bool) -> None:
        self.key_order = key_order

    def compare(self, a: Any, b: Any, path: str) -> None:
        if isinstance(a, dict) or isinstance(b, dict):
            if not (isinstance(a, dict) and isinstance(b, dict)):
                _fail(path, f"{_type_name(a)} != {_type_name(b)}")
            self.dicts(a, b, path)
            return
        if type(a) is not type(b):
            _fail(path, f"{_type_name(a)} != {_type_name(b)}")
        if isinstance(a, (list, tuple)):
            if len(a) != len(b):
                _fail(path, f"length {len(a)} != {len(b)}")
            for i, (x, y) in enumerate(zip(a, b)):
                self.compare(x, y, f"{path}[{i}]")
        elif isinstance(a, np.ndarray):
            self.arrays(a, b, path)
        elif _is_tensor(a):
            _compare_tensors(a, b, path)
        else:
            _compare_scalars(a, b, path)

    def dicts(self, a: dict, b: dict, path: str) -> None:
        missing = [k for k in a if k not in b]
        extra = [k for k in b if k not in a]
        if missing or extra:
            _fail(path, f"keys only in the first: {missing}, only in the second: {extra}")
        if self.key_order and list(a) != list(b):
            _fail(path, f"keys in a different order: {list(a)} != {list(b)}")
        for k in a:
            self.compare(a[k], b[k], f"{path}[{k!r}]")

    def arrays(self, a: np.ndarray, b: np.ndarray, path: str) -> None:
        if a.dtype != b.dtype:
            _fail(path, f"dtype {a.dtype} != {b.dtype}")
        if a.shape != b.shape:
            _fail(path, f"shape {a.shape} != {b.shape}")
        if a.dtype.hasobject:
            for i, (x, y) in enumerate(zip(a.reshape(-1).tolist(), b.reshape(-1).tolist())):
                self.compare(x, y, f"{path}.flat[{i}]")
            return
        _compare_bytes(np.ascontiguousarray(a).reshape(-1).view(np.uint8),
                       np.ascontiguousarray(b).reshape(-1).view(np.uint8), a.dtype.itemsize, path)


def _compare_tensors(a: Any, b: Any, path: str) -> None:
    if a.dtype != b.dtype:
        _fail(path, f"dtype {a.dtype} != {b.dtype}")
    if a.shape != b.shape:
        _fail(path, f"shape {tuple(a.shape)} != {tuple(b.shape)}")
    _compare_bytes(_tensor_bytes(a), _tensor_bytes(b), a.element_size(), path)


def _tensor_bytes(t: Any) -> np.ndarray:
    """A tensor's raw bytes, as a 1-D uint8 array."""
    import torch

    t = t.detach().cpu().contiguous().reshape(-1)
    if t.numel() == 0:
        return np.zeros(0, dtype=np.uint8)
    return t.view(torch.uint8).numpy()


def _compare_bytes(x: np.ndarray, y: np.ndarray, itemsize: int, path: str) -> None:
    if x.size != y.size:
        _fail(path, f"{x.size} bytes != {y.size} bytes")
    if not np.array_equal(x, y):
        i = int(np.flatnonzero(x != y)[0])
        _fail(path, f"raw bytes differ, first at byte {i} of element {i // max(1, itemsize)} (flat index): "
                    f"{x[i]:#04x} != {y[i]:#04x}")


def _compare_scalars(a: Any, b: Any, path: str) -> None:
    if isinstance(a, float):
        same = _same_float(a, b)
    elif isinstance(a, complex):
        same = _same_float(a.real, b.real) and _same_float(a.imag, b.imag)
    elif isinstance(a, np.generic):
        nan = np.issubdtype(a.dtype, np.floating) and bool(np.isnan(a)) and bool(np.isnan(b))
        same = nan or np.asarray(a).tobytes() == np.asarray(b).tobytes()
    else:
        try:
            same = bool(a == b)
        except Exception as e:  # noqa: BLE001 - a leaf whose == cannot give one answer
            _fail(path, f"cannot compare {_type_name(a)} values ({type(e).__name__}: {e})")
    if not same:
        _fail(path, f"{_short(a)} != {_short(b)}")


def _same_float(x: float, y: float) -> bool:
    if math.isnan(x) or math.isnan(y):
        return math.isnan(x) and math.isnan(y)
    return x == y and math.copysign(1.0, x) == math.copysign(1.0, y)


def _is_tensor(x: Any) -> bool:
    torch = sys.modules.get("torch")  # a tensor exists only if torch was imported
    return torch is not None and isinstance(x, torch.Tensor)


def _type_name(x: Any) -> str:
    t = type(x)
    return t.__name__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def _short(x: Any, limit: int = 80) -> str:
    r = repr(x)
    return r if len(r) <= limit else r[:limit - 3] + "..."
