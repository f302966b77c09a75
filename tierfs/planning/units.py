"""How the planner writes durations, sizes and rates for people: :mod:`tierfs._units`, sizes in decimal
units (GB = 1e9 bytes, as the planner's inputs: ``70B`` parameters x 12 bytes = 840 GB) and rates in
GB/s or MB/s (1e9 and 1e6 bytes/s)."""

from __future__ import annotations

from .. import _units

#: seconds as ``660 ms``, ``90.0 s``, ``6.2 min``, ``2.0 h``, ``3.5 d`` (see :func:`tierfs._units.duration`)
duration = _units.duration

#: bytes per second as ``13.44 GB/s`` or ``200.0 MB/s`` (see :func:`tierfs._units.rate`)
rate = _units.rate


def gigabytes(n: float) -> str:
    """Bytes in decimal units: ``840.00 GB``, ``26.25 GB``, ``5.00 TB``, ``5.0 MB``.

    Parameters
    ----------
    n : float
        Bytes.

    Returns
    -------
    str
        :func:`tierfs._units.size` with ``si=True``.
    """
    return _units.size(n, si=True)
