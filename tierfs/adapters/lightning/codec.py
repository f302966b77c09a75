"""Lightning checkpoint dicts to a tierfs state and back: tensors as array entries, the rest as JSON,
Python objects JSON cannot hold as ``torch.save`` bytes loaded with ``weights_only=True``.

The tierfs state of one checkpoint is flat::

    {"tree": "<JSON text>", "t0": tensor, "t1": tensor, ..., "n0": ndarray, ..., "p0": uint8 ndarray, ...}

``tree`` describes the dict: JSON scalars stand for themselves; every container and every non-JSON leaf is
a tagged list: ``["d", [[key, value], ...]]`` (dict; keys are encoded like values, so int keys survive),
``["o", ...]`` (OrderedDict), ``["l", [...]]`` (list), ``["u", [...]]`` (tuple), ``["t", i]`` (tensor
entry ``t<i>``), ``["n", i]`` (numpy entry ``n<i>``), ``["p", i]`` (pickled object ``p<i>``), ``["f", "nan"]``
(a float JSON cannot hold).
"""

from __future__ import annotations

import io
import json
import math
import pickle
from collections import OrderedDict
from typing import Any, Mapping

import numpy as np
import torch

from ...errors import TierfsError

FORMAT = 1
_TORCH_DTYPES = {
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex64, torch.complex128, torch.int64,
    torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
}
_NUMPY_KINDS = "biufc"


class UnsafePickleError(TierfsError):
    """A value of the checkpoint can only be loaded with ``weights_only=False`` (full unpickling)."""


def _plain_tensor(x: Any) -> bool:
    return (type(x) in (torch.Tensor, torch.nn.Parameter) and x.layout == torch.strided
            and x.dtype in _TORCH_DTYPES and not x.is_meta and not x.is_quantized)


class Encoder:
    """Splits one checkpoint dict into tensors, arrays, pickles and the JSON tree."""

    def __init__(self, trust_pickle: bool) -> None:
        self.trust_pickle = trust_pickle
        self.state: dict[str, Any] = {}
        self.counts = {"t": 0, "n": 0, "p": 0}
        self.unsafe: list[str] = []  # key paths of values only weights_only=False can load

    def _add(self, tag: str, value: Any) -> list[Any]:
        i = self.counts[tag]
        self.counts[tag] += 1
        self.state[f"{tag}{i}"] = value
        return [tag, i]

    def encode(self, obj: Any, where: str) -> Any:
        t = type(obj)
        if obj is None or t is bool or t is str or t is int:
            return obj
        if t is float:
            return obj if math.isfinite(obj) else ["f", repr(obj)]
        if isinstance(obj, torch.Tensor) and _plain_tensor(obj):
            x = obj.detach()
            if x.device.type != "cpu":
                x = x.cpu()
            return self._add("t", x.contiguous())
        if t is np.ndarray and obj.dtype.kind in _NUMPY_KINDS and obj.dtype.byteorder in "=|<":
            return self._add("n", np.ascontiguousarray(obj))
        if t is dict or t is OrderedDict:
            return ["d" if t is dict else "o",
                    [[self.encode(k, f"{where}[key]"), self.encode(v, f"{where}/{k}")] for k, v in obj.items()]]
        if t is list or t is tuple:
            return ["l" if t is list else "u", [self.encode(v, f"{where}/{i}") for i, v in enumerate(obj)]]
        return self._add("p", self._pickle(obj, where))

    def _pickle(self, obj: Any, where: str) -> np.ndarray:
        buf = io.BytesIO()
        torch.save(obj, buf)
        data = buf.getvalue()
        try:
            torch.load(io.BytesIO(data), weights_only=True)
        except (pickle.UnpicklingError, RuntimeError, AttributeError, TypeError, ValueError) as e:
            if not self.trust_pickle:
                raise UnsafePickleError(
                    f"checkpoint value {where!r} ({type(obj).__module__}.{type(obj).__qualname__}) can only be "
                    f"loaded back by full unpickling (torch.load(weights_only=False)): allow its type with "
                    f"torch.serialization.add_safe_globals([...]), or pass TieredCheckpointIO(..., "
                    f"trust_pickle=True) if every reader of the tiers trusts every writer "
                    f"({str(e).splitlines()[0][:200]})") from None
            self.unsafe.append(where)
        return np.frombuffer(data, dtype=np.uint8)


def encode(checkpoint: Mapping[str, Any], trust_pickle: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """The tierfs state of ``checkpoint`` and a summary for the step's metadata."""
    enc = Encoder(trust_pickle)
    tree = enc.encode(dict(checkpoint), "")
    enc.state["tree"] = json.dumps(tree, separators=(",", ":"))
    return enc.state, {"tensors": enc.counts["t"], "arrays": enc.counts["n"], "pickles": enc.counts["p"],
                       "unsafe_pickles": enc.unsafe}


def decode(state: Mapping[str, Any], *, allow_unpickle: bool, map_location: Any = None) -> dict[str, Any]:
    """The checkpoint dict back from the tierfs state ``encode`` made."""
    tree = json.loads(state["tree"])

    def leaf(tag: str, i: int) -> Any:
        v = state[f"{tag}{i}"]
        if tag == "t":
            return _move(v if isinstance(v, torch.Tensor) else torch.from_numpy(np.array(v)), map_location)
        if tag == "n":
            return np.array(v)
        data = bytes(np.asarray(v, dtype=np.uint8).tobytes())
        try:
            return torch.load(io.BytesIO(data), weights_only=True, map_location=map_location)
        except (pickle.UnpicklingError, RuntimeError, AttributeError, TypeError, ValueError):
            if not allow_unpickle:
                raise
            return torch.load(io.BytesIO(data), weights_only=False, map_location=map_location)

    def dec(x: Any) -> Any:
        if not isinstance(x, list):
            return x
        tag, body = x
        if tag == "d":
            return {dec(k): dec(v) for k, v in body}
        if tag == "o":
            return OrderedDict((dec(k), dec(v)) for k, v in body)
        if tag == "l":
            return [dec(v) for v in body]
        if tag == "u":
            return tuple(dec(v) for v in body)
        if tag == "f":
            return float(body)
        return leaf(tag, body)

    try:
        out = dec(tree)
    finally:
        del dec  # it refers to itself: a cycle that would hold the tensors until the garbage collector runs
    assert isinstance(out, dict)
    return out


def _move(t: torch.Tensor, map_location: Any) -> torch.Tensor:
    if map_location is None:
        return t
    if isinstance(map_location, (str, torch.device)):
        return t.to(map_location)
    if callable(map_location):  # torch's storage-level callables: the tensors stay on the CPU
        return t
    if isinstance(map_location, Mapping):
        dev = map_location.get("cpu")
        return t.to(dev) if dev is not None else t
    return t
