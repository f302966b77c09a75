"""tierfs's JSON (orjson where it gives what the standard library gives): every value reads back as the
standard library's JSON of it reads back, and what the standard library refuses is refused alike."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from tierfs.format import Entry, Manifest, jsonio


def _std(obj):
    return json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()


VALUES = [
    {"a": 1, "b": [1.5, -0.0, 1e-05, 1e300, None, True, False], "c": "ü→😀"},
    {"big": 2**70, "neg": -(2**64) - 1, "edge": 2**63, "u64": 2**64 - 1},  # past 64 bits: exact
    {1: "int key", 2.5: "float key", None: "none key", True: "bool key"},  # keys the standard library turns into text
    {"np": np.float64(0.1), "f32": float(np.float32(0.1))},  # a float subclass
    {"lone": "\ud800", "escaped": "\x00\x1f\"\\"},  # a lone surrogate: escaped, as the standard library does
    {"nested": [[[{"x": [1, [2, [3]]]}]]], "tuple": (1, 2)},
    "text", 7, 0.5, None, [],
]


@pytest.mark.parametrize("value", VALUES, ids=range(len(VALUES)))
def test_dumps_reads_back_as_the_standard_librarys_json(value):
    got = jsonio.dumps(value)
    assert json.loads(got) == json.loads(_std(value))
    assert jsonio.loads(got) == json.loads(_std(value))


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, np.float64("nan"), [1, {"x": math.inf}]])
def test_non_finite_floats_are_refused_as_by_the_standard_library(bad):
    with pytest.raises(ValueError, match="Out of range float values are not JSON compliant"):
        jsonio.dumps({"v": bad})
    with pytest.raises(ValueError):  # where the caller names the parts that may hold floats
        jsonio.dumps({"v": bad, "n": 1}, [{"v": bad}])


def test_unserialisable_values_raise_the_standard_librarys_error():
    for bad in (np.int64(3), object(), {1, 2}, b"bytes"):
        with pytest.raises(TypeError, match="is not JSON serializable"):
            jsonio.dumps({"v": bad})


@pytest.mark.parametrize("text", [
    b'{"a":123456789012345678901234567890,"b":-9223372036854775809}',  # past 64 bits: exact ints
    b'{"n":NaN,"i":Infinity,"m":-Infinity}',  # the standard library's extensions
    b'"\\ud800"', '{"s":"\u00fc"}', '{"s":"\u00fc"}'.encode("utf-16"), b"[1, 2.5e-3, true, null]",
    b'{"a":1,"a":2}',  # the last of a repeated key
])
def test_loads_gives_what_the_standard_library_gives(text):
    got, want = jsonio.loads(text), json.loads(text)
    assert json.dumps(got, sort_keys=True) == json.dumps(want, sort_keys=True)
    if isinstance(want, dict) and "a" in want:
        assert got["a"] == want["a"] and type(got["a"]) is type(want["a"])


@pytest.mark.parametrize("text", [b"", b"{", b"\x80garbage", b"[1,]", b'{"a":1}x', b"nan"])
def test_loads_refuses_what_the_standard_library_refuses(text):
    with pytest.raises(ValueError):
        json.loads(text)
    with pytest.raises(ValueError):
        jsonio.loads(text)


def test_a_manifest_round_trips_the_users_values_exactly():
    entries = [Entry("x", dtype="float32", shape=[2], file="rank_00000.0000.bin", length=8, crc32c=[5]),
               Entry("seed", kind="json", value={"seed": 2**70, "lr": 3e-4, "name": "ü", "keys": [1, -0.0]})]
    m = Manifest(3, 0, 1, entries, {"rank_00000.0000.bin": 8}, metadata={"run": "r", "big": -(2**80)},
                 metrics={"loss": np.float64(1.25), "step": 3})
    back = Manifest.from_bytes(m.to_bytes())
    assert back.entries[1].value == entries[1].value and back.metadata == m.metadata
    assert back.metrics == {"loss": 1.25, "step": 3} and back.entries[0] == entries[0]
    assert isinstance(back.metadata["big"], int) and isinstance(back.entries[1].value["seed"], int)


@pytest.mark.parametrize("where", ["metadata", "metrics", "value"])
def test_a_manifest_with_a_non_finite_float_is_refused_as_before(where):
    e = Entry("v", kind="json", value={"x": math.nan} if where == "value" else 1)
    m = Manifest(1, 0, 1, [e], {}, metadata={"x": math.inf} if where == "metadata" else {},
                 metrics={"x": -math.inf} if where == "metrics" else {})
    with pytest.raises(ValueError, match="Out of range float"):
        m.to_bytes()


def test_values_orjson_would_write_its_own_way_go_through_the_standard_library():
    import dataclasses
    import datetime
    import enum
    from collections import OrderedDict

    class Color(enum.Enum):
        RED = 1

    class Level(enum.IntEnum):
        HIGH = 3

    @dataclasses.dataclass
    class Point:
        x: int

    for bad in (Color.RED, Point(1), datetime.datetime(2026, 1, 1)):
        with pytest.raises(TypeError, match="is not JSON serializable"):
            jsonio.dumps({"v": bad})
        with pytest.raises(TypeError, match="is not JSON serializable"):
            jsonio.dumps({"v": bad, "n": [1]}, [{"v": bad}])
    for odd in (Level.HIGH, OrderedDict(b=1, a=2), np.float64(2.5)):
        assert jsonio.dumps({"v": odd}) == _std({"v": odd})


def test_without_orjson_the_standard_library_does_it_all():
    """A process that imports tierfs from its sources without its dependencies installed (the GPU check
    on a bare torch environment) still writes and reads manifests."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['orjson'] = None\n"
            "from tierfs.format import Entry, Manifest, jsonio\n"
            "assert jsonio.orjson is None\n"
            "m = Manifest(1, 0, 1, [Entry('v', kind='json', value={'big': 2**70, 'x': 0.5})], {}, metadata={'k': 'ü'})\n"
            "raw = m.to_bytes()\n"
            "assert b'\\\\u00fc' in raw  # (json escapes what orjson writes as UTF-8)\n"
            "assert Manifest.from_bytes(raw).entries[0].value == {'big': 2**70, 'x': 0.5}\n"
            "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_orjson_writes_what_it_can_and_json_the_rest():
    """Which encoder wrote a manifest shows in its bytes: orjson writes non-ASCII text as UTF-8, json escapes it."""
    pytest.importorskip("orjson")
    plain = Manifest(1, 0, 1, [], {}, metadata={"k": "ü"})
    assert "ü".encode() in plain.to_bytes()  # orjson
    for odd in (2**70, np.float64(0.5), math.nan):
        m = Manifest(1, 0, 1, [], {}, metadata={"k": "ü", "v": odd})
        if isinstance(odd, float) and math.isnan(odd):
            with pytest.raises(ValueError):
                m.to_bytes()
        else:
            assert b"\\u00fc" in m.to_bytes()  # json, for the value orjson would write otherwise or not at all
