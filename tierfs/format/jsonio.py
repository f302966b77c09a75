"""tierfs's records as JSON: through orjson where it gives what the standard library gives, else through
the standard library.

A save encodes its manifest and every peer that keeps a copy decodes it, on background threads that hold
the GIL meanwhile (a training loop's thread waits for it). A GPT's manifest of 213 entries encodes in a
sixth of the standard library's time and parses, its entries checked, in 85% of it
(``benchmarks/bench_manifest.py``). Both functions keep the standard library's results:

- :func:`dumps` gives what ``json.dumps(obj, separators=(",", ":"), allow_nan=False)`` gives, read back
  (not its bytes: orjson writes non-ASCII characters as UTF-8 rather than escapes, and some floats in
  another shortest form, ``0.00001`` for ``1e-05``). Values of other types than text, numbers, booleans,
  None, lists, tuples and dicts (subclasses, numpy scalars, enums, dataclasses), floats that are not
  finite (orjson would write ``null`` where the standard library raises ValueError) and what orjson cannot
  write (integers past 64 bits, keys that are not strings, lone surrogates) go through the standard
  library, with its errors.
- :func:`loads` gives what ``json.loads`` gives. Text orjson refuses (``NaN``, lone surrogates, encodings
  other than UTF-8) and any with a run of 19 digits or more (orjson reads an integer past 64 bits as a
  float) go through the standard library, with its errors.

Without orjson (a dependency of tierfs, but a process that imports tierfs from its sources may lack it)
both are the standard library's.
"""

from __future__ import annotations

import json
import math
from typing import Any, Iterable

try:
    import orjson
except ImportError:  # (a dependency of tierfs; without it, as where tierfs runs from its sources alone: json)
    orjson = None  # type: ignore[assignment]

#: every digit as ``0``, every other byte as a space: 19 digits in a row (possibly an integer past 64 bits,
#: which orjson would read as a float) are then one ``bytes.find`` away (a regular expression takes 10x longer)
_DIGITS = bytes(48 if 48 <= b <= 57 else 32 for b in range(256))
_LONG = b"0" * 19


#: orjson's own ways with dataclasses, datetimes and subclasses of str, int, dict and list, left to the
#: standard library (which refuses the first two and writes subclasses its own way)
_OPTIONS = (orjson.OPT_PASSTHROUGH_DATACLASS | orjson.OPT_PASSTHROUGH_DATETIME | orjson.OPT_PASSTHROUGH_SUBCLASS
            if orjson is not None else 0)
#: the types whose JSON orjson writes as the standard library does (a finite float's, read back)
_PLAIN = frozenset({str, int, float, bool, type(None), dict, list, tuple})


def dumps(obj: Any, values: Iterable[Any] | None = None) -> bytes:
    """Compact JSON of ``obj`` (see the module docstring). ``values``: the parts of ``obj`` that may hold
    other values than text, integers, lists and dicts of them (None: all of it); a caller that knows where
    its users' values are (the rest being of those plain types) spares the walk over the rest."""
    if orjson is not None and _plain(obj if values is None else values, whole=values is None):
        try:
            return orjson.dumps(obj, option=_OPTIONS)
        except TypeError:  # (orjson.JSONEncodeError) what the standard library says, or writes
            pass
    return json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()


def loads(data: bytes | bytearray | memoryview | str) -> Any:
    """The value of JSON text ``data`` (see the module docstring); ValueError (``json.JSONDecodeError``)
    when it is not JSON."""
    raw = data.encode() if isinstance(data, str) else bytes(data)
    if orjson is not None and raw.translate(_DIGITS).find(_LONG) < 0:
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:
            pass
    return json.loads(raw)


def _plain(obj: Any, whole: bool) -> bool:
    """Whether ``obj`` (or, with ``whole`` False, each item of the iterable ``obj``) holds values of
    :data:`_PLAIN` types alone (subclasses not), and no float that is NaN or infinite."""
    stack = [obj] if whole else list(obj)
    plain, isfinite = _PLAIN, math.isfinite
    while stack:
        v = stack.pop()
        t = type(v)
        if t not in plain:
            return False
        if t is float:
            if not isfinite(v):
                return False
        elif t is dict:
            stack.extend(v.values())
        elif t is list or t is tuple:
            stack.extend(v)
    return True
