"""Numbers with units on the command line: ``70B`` parameters, ``5TB``, ``5GB/s``, ``124min``.

Counts take K, M, B or G, T (``70B`` is 7e10); sizes SI (``840GB``, ``5TB``) or binary units
(``2GiB``); rates a size per second (``5GB/s``, ``500MB/s``; a bare number is GB/s); durations s, min,
h, d, w, y (``124min``, ``90s``, ``5.7y``; a bare number is seconds). Each parser is an argparse
``type``: a bad value is an ``ArgumentTypeError`` that argparse turns into a one-line usage error.
"""

from __future__ import annotations

import argparse
import re
from typing import Callable

_SI = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "p": 1e15}
_BIN = {"ki": 2.0**10, "mi": 2.0**20, "gi": 2.0**30, "ti": 2.0**40, "pi": 2.0**50}
_COUNT = {"": 1.0, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}
_TIME = {"": 1.0, "s": 1.0, "sec": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "hr": 3600.0, "d": 86400.0,
         "day": 86400.0, "days": 86400.0, "w": 604800.0, "y": 365 * 86400.0, "yr": 365 * 86400.0}
_NUM = r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*"


def _parse(text: str, units: dict[str, float], what: str, example: str, suffix: str = "") -> float:
    m = re.fullmatch(_NUM + r"([A-Za-z]*)" + suffix + r"\s*", str(text))
    unit = m.group(2).lower() if m else None
    if m is None or unit not in units:
        raise argparse.ArgumentTypeError(f"{what} {text!r}: expected e.g. {example}")
    v = float(m.group(1)) * units[unit]
    if not v > 0:
        raise argparse.ArgumentTypeError(f"{what} {text!r} must be positive")
    return v


def parse_count(text: str) -> float:
    """``70B`` -> 7e10 (K, M, B/G, T); a bare number as is."""
    return _parse(text, _COUNT, "count", "70B or 7e10")


def parse_bytes(text: str) -> float:
    """``5TB`` -> 5e12, ``2GiB`` -> 2147483648; a bare number is bytes."""
    m = re.fullmatch(_NUM + r"([A-Za-z]*)\s*", str(text))
    if m:
        unit = m.group(2).lower()
        unit = unit[:-1] if unit.endswith("b") else unit
        mult = _BIN.get(unit) if unit.endswith("i") else _SI.get(unit)
        if mult is not None and float(m.group(1)) > 0:
            return float(m.group(1)) * mult
    raise argparse.ArgumentTypeError(f"size {text!r}: expected a positive size, e.g. 840GB, 5TB or 2GiB")


def parse_rate(text: str) -> float:
    """``5GB/s`` -> 5e9 bytes/s; a bare number is GB/s."""
    m = re.fullmatch(_NUM + r"([A-Za-z]*)(/s)?\s*", str(text))
    if m and not m.group(2):
        return _parse(m.group(1), {"": 1e9}, "rate", "5GB/s")
    if m:
        return parse_bytes(m.group(1) + m.group(2))
    raise argparse.ArgumentTypeError(f"rate {text!r}: expected e.g. 5GB/s or 500MB/s")


def parse_duration(text: str) -> float:
    """``124min`` -> 7440 s (s, min, h, d, w, y); a bare number is seconds."""
    return _parse(text, _TIME, "duration", "124min, 90s, 2h or 5.7y")


def parse_duration_or_zero(text: str) -> float:
    """As :func:`parse_duration`, but ``0`` (or ``0s``) is allowed: a time that may be nothing."""
    m = re.fullmatch(_NUM + r"([A-Za-z]*)\s*", str(text))
    if m and float(m.group(1)) == 0 and m.group(2).lower() in _TIME:
        return 0.0
    return parse_duration(text)


def parse_fraction(text: str) -> float:
    """``0.5`` -> 0.5: a number in [0, 1]."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.0 <= v <= 1.0:
        raise argparse.ArgumentTypeError(f"{text!r} must be a fraction between 0 and 1")
    return v


def int_at_least(low: int) -> Callable[[str], int]:
    """An argparse type: a whole number no smaller than ``low``."""

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if v < low:
            raise argparse.ArgumentTypeError(f"{text!r} must be at least {low}")
        return v

    return parse


#: argparse types: a whole number >= 1, and >= 0
positive_int, nonneg_int = int_at_least(1), int_at_least(0)


def parse_count_int(text: str) -> int:
    """``24k`` -> 24000: a count (see :func:`parse_count`), rounded to a whole number, at least 1."""
    v = int(round(parse_count(text)))
    if v < 1:
        raise argparse.ArgumentTypeError(f"count {text!r} must be at least 1")
    return v

