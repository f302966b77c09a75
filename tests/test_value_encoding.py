"""The one pickle-free encoding of a state's non-tensor values (``_torchstate.encode``/``decode``): the
manager's values beside the DCP items and a data loader's state both use it, and it still reads the
records of either form written before it was one (the manager's arrays without a dtype)."""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import pytest

from tierfs.adapters import _torchstate as ts
from tierfs.adapters import loaderstate
from tierfs.errors import ArgumentError, FormatError


def _older_form(v: Any, arrays: list[np.ndarray]) -> Any:
    """A record of the form the manager wrote before there was one encoder, from one of today's: arrays
    kept whole in their dtype (a 0-d one 1-d, as the store keeps it), no dtype in the JSON."""
    if isinstance(v, list):
        return [_older_form(x, arrays) for x in v]
    if not isinstance(v, dict):
        return v
    if "$a" in v:
        arrays[v["$a"]] = arrays[v["$a"]].reshape(v["shape"] or [1])
        return {"$a": v["$a"], "shape": v["shape"], "scalar": v["scalar"]}
    return {k: _older_form(x, arrays) for k, x in v.items()}


def _older_manager_encode(v: Any, arrays: list[np.ndarray], where: str) -> Any:
    return _older_form(_ENCODE(v, arrays, where), arrays)


_ENCODE = ts.encode


def test_records_of_the_older_manager_form_decode():
    value = {"m": np.arange(6, dtype=np.float32).reshape(2, 3), "s": np.int64(7), 3: ("x", math.inf, b"\x01"),
             "z": np.array(2.5)}
    arrays: list[np.ndarray] = []
    record = json.loads(json.dumps(_older_manager_encode(value, arrays, "state")))
    assert "dtype" not in json.dumps(record) and arrays[0].shape == (2, 3)  # the older form indeed
    back = ts.decode(record, dict(enumerate(arrays)))
    assert list(back) == list(value)
    assert back["m"].dtype == np.float32 and back["m"].tolist() == value["m"].tolist()
    assert type(back["s"]) is np.int64 and back["s"] == 7
    assert back[3][0] == "x" and math.isinf(back[3][1]) and back[3][2] == b"\x01"
    assert back["z"].shape == () and float(back["z"]) == 2.5


def test_records_of_the_loader_form_decode_and_are_what_the_encoder_writes():
    written = {"$d": [["a", {"$a": 0, "dtype": "<i2", "shape": [2], "scalar": False}],
                      ["b", {"$a": 1, "dtype": "<f4", "shape": [], "scalar": True}]]}  # as tierfs 1 wrote them
    arrays = {0: np.array([1, -2], dtype=np.int16), 1: np.array([0.5], dtype=np.float32)}
    for decode in (ts.decode, loaderstate.decode):
        back = decode(written, arrays)
        assert back["a"].dtype == np.int16 and back["a"].tolist() == [1, -2]
        assert type(back["b"]) is np.float32 and back["b"] == 0.5
    out: list[np.ndarray] = []
    assert ts.encode({"a": arrays[0], "b": np.float32(0.5)}, out, "state") == written
    assert loaderstate.encode is ts.encode


def test_the_manager_encoder_names_the_key_it_cannot_store():
    with pytest.raises(ArgumentError, match=r"^'opt.x': cannot store a value of type object without pickle"):
        ts.extra(ts.split({"opt": {"x": object()}}))
    with pytest.raises(FormatError, match="unknown value encoding"):
        ts.decode({"$new": 1}, {})
    with pytest.raises(FormatError, match="names array 4"):
        ts.decode({"$a": 4, "shape": [1]}, {})


def test_a_manager_step_written_in_the_older_form_restores(shm_dir, monkeypatch):
    torch = pytest.importorskip("torch")
    from tierfs import CheckpointManager
    from tierfs.policies import LatestN
    from tierfs.tiers import MemoryTier

    state = {"w": torch.ones(3), "opt": {"m": np.arange(4, dtype=np.int32), "lr": 0.1, "t": (1, "a")},
             "s": np.float32(1.5)}
    with CheckpointManager([MemoryTier(shm_dir, keep=LatestN(3))]) as mgr:
        with monkeypatch.context() as m:
            m.setattr(ts, "encode", _older_manager_encode)
            mgr.save(1, state)
            mgr.wait_until_finished()
        mgr.save(2, state)  # the one encoding's form
        mgr.wait_until_finished()
        for step in (1, 2):
            got = mgr.restore(step=step)
            assert got["w"].tolist() == [1.0, 1.0, 1.0]
            assert got["opt"]["m"].dtype == np.int32 and got["opt"]["m"].tolist() == [0, 1, 2, 3]
            assert got["opt"]["lr"] == 0.1 and got["opt"]["t"] == (1, "a")
            assert type(got["s"]) is np.float32 and got["s"] == 1.5
