"""Sizes, durations and rates as people read them, in messages and on the command line.

- :func:`size`: bytes in binary units, ``512 B``, ``16.0 KiB``, ``3.4 MiB``, ``1.0 GiB`` (what files and
  tiers hold); ``si=True`` gives decimal units, ``840.00 GB``, for the planner, whose inputs are decimal
  (``70B`` parameters x 12 bytes, ``5TB``).
- :func:`duration`: ``<0.01 ms``, ``0.25 ms``, ``1.2 ms``, ``950 ms``, ``1.5 s``, ``6.2 min``, ``2.0 h``, ``3.5 d``.
- :func:`rate`: bytes per second in decimal units, as bandwidths are quoted: ``13.44 GB/s``, ``200.0 MB/s``.

Each returns a short string and never raises on a number: ``nan`` is ``-``, an infinite duration
``never``, an infinite rate ``inf``.
"""

from __future__ import annotations

import math

_BINARY = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")
_DECIMAL = ("B", "kB", "MB", "GB", "TB", "PB")


def size(n: float, *, si: bool = False) -> str:
    """Bytes as ``512 B``, ``16.0 KiB``, ``1.0 GiB`` (binary, one decimal above bytes).

    Parameters
    ----------
    n : float
        Bytes.
    si : bool
        Decimal units instead (kB, MB, GB, TB = 1e3, 1e6, 1e9, 1e12 bytes), with two decimals from GB:
        ``840.00 GB``, ``26.25 GB``, ``5.0 MB``.

    Returns
    -------
    str
        The size in the largest unit that keeps the number at least 1.
    """
    if math.isnan(n):
        return "-"
    if n < 0:
        return "-" + size(-n, si=si)
    if math.isinf(n):
        return "inf"
    base, units = (1000.0, _DECIMAL) if si else (1024.0, _BINARY)
    x = float(n)
    for i, unit in enumerate(units):
        last = i == len(units) - 1
        if i == 0 and round(x) < base:
            return f"{int(round(x))} B"
        if i > 0 and (round(x, 2 if si and i >= 3 else 1) < base or last):
            return f"{x:.2f} {unit}" if si and i >= 3 else f"{x:.1f} {unit}"
        x /= base
    raise AssertionError("unreachable")


def duration(s: float) -> str:
    """Seconds as ``0.25 ms``, ``1.2 ms``, ``950 ms``, ``1.5 s``, ``90.0 s``, ``6.2 min``, ``2.0 h``, ``3.5 d``.

    Parameters
    ----------
    s : float
        Seconds (``inf``: ``never``; ``nan``: ``-``).

    Returns
    -------
    str
        Milliseconds under a second, then seconds up to 2 minutes, minutes up to 2 hours, hours up to 2
        days, then days.
    """
    if math.isnan(s):
        return "-"
    if s < 0:
        return "-" + duration(-s)
    if math.isinf(s):
        return "never"
    ms = s * 1e3
    if ms < 1:
        return "0 ms" if ms == 0 else ("<0.01 ms" if ms < 0.005 else f"{ms:.2f} ms")
    if round(ms, 1) < 100:
        return f"{ms:.1f} ms"
    if round(ms) < 1000:
        return f"{ms:.0f} ms"
    if round(s, 1) < 120:
        return f"{s:.1f} s"
    if round(s / 60, 1) < 120:
        return f"{s / 60:.1f} min"
    if round(s / 3600, 1) < 48:
        return f"{s / 3600:.1f} h"
    return f"{s / 86400:.1f} d"


def rate(n: float, s: float | None = None) -> str:
    """``n`` bytes per second (or ``n`` bytes in ``s`` seconds) as ``13.44 GB/s``, ``200.0 MB/s``.

    Parameters
    ----------
    n : float
        Bytes per second; with ``s``, bytes moved.
    s : float, optional
        Seconds it took; ``-`` when it is not positive (too fast to time).

    Returns
    -------
    str
        Decimal units, as bandwidths are quoted (1 GB/s = 1e9 bytes/s): two decimals in GB/s, one below.
    """
    if s is not None:
        if not s > 0:
            return "-"
        n = n / s
    if math.isnan(n):
        return "-"
    if math.isinf(n):
        return "inf"
    if n >= 1e9 or n == 0:
        return "0 B/s" if n == 0 else f"{n / 1e9:.2f} GB/s"
    if round(n / 1e6, 1) >= 1:
        return f"{n / 1e6:.1f} MB/s"
    if round(n / 1e3, 1) >= 1:
        return f"{n / 1e3:.1f} kB/s"
    return f"{n:.0f} B/s"


class Bytes(int):
    """A number of bytes that prints as :func:`size`: a log record's argument that reads as ``16.0 KiB`` in
    the message (``%s``) and stays a number for handlers that read ``record.args``."""

    def __str__(self) -> str:
        return size(self)


class Seconds(float):
    """Seconds that print as :func:`duration`: ``1.2 ms`` in a log message (``%s``), a float in ``record.args``."""

    def __str__(self) -> str:
        return duration(self)
