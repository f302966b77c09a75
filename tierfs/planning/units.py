"""How the planner writes durations, sizes and rates for people (GB = 1e9 bytes, GB/s = 1e9 bytes/s)."""

from __future__ import annotations

import math


def duration(s: float) -> str:
    """Seconds as ``0.50 s``, ``90.0 s``, ``6.2 min``, ``2.0 h`` or ``3.5 d``; ``never`` for inf, ``-`` for nan.

    Parameters
    ----------
    s : float
        Seconds.

    Returns
    -------
    str
        The duration in the largest unit that keeps it readable.
    """
    if math.isinf(s):
        return "never"
    if math.isnan(s):
        return "-"
    if s < 1:
        return f"{s:.2f} s"
    if s < 120:
        return f"{s:.1f} s"
    if s < 7200:
        return f"{s / 60:.1f} min"
    if s < 172800:
        return f"{s / 3600:.1f} h"
    return f"{s / 86400:.1f} d"


def gigabytes(n: float) -> str:
    """Bytes as ``840 GB`` (from 1 TB), ``26.25 GB`` (from 0.1 GB) or ``5.0 MB``.

    Parameters
    ----------
    n : float
        Bytes.

    Returns
    -------
    str
        The size in GB, or in MB below 0.1 GB.
    """
    if n >= 1e12:
        return f"{n / 1e9:.0f} GB"
    return f"{n / 1e9:.2f} GB" if n >= 1e8 or n == 0 else f"{n / 1e6:.1f} MB"


def rate(n: float) -> str:
    """Bytes per second as ``13.44 GB/s`` (from 1 GB/s) or ``200.0 MB/s``.

    Parameters
    ----------
    n : float
        Bytes per second.

    Returns
    -------
    str
        The rate in GB/s, or in MB/s below 1 GB/s.
    """
    return f"{n / 1e9:.2f} GB/s" if n >= 1e9 or n == 0 else f"{n / 1e6:.1f} MB/s"
