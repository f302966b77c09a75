"""What the commands show people: ages, and a progress bar on stderr while bytes move (sizes, durations
and rates: :mod:`tierfs.util.readable`)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ..util.readable import duration
from ..errors import TierfsError
from ..tiers.base import Tier


def age(seconds: float | None) -> str:
    """``450 ms ago``, ``45 s ago``, ``10 min ago``, ``3.5 h ago`` or ``at an unknown time``."""
    if seconds is None:
        return "at an unknown time"
    if seconds < 1:
        return f"{duration(seconds)} ago"
    if seconds < 120:
        return f"{seconds:.0f} s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min ago"
    return f"{seconds / 3600:.1f} h ago"


def progress_bar(total: int, label: str, args: argparse.Namespace) -> Any:
    """A tqdm bar of ``total`` bytes on stderr, or None: with ``--no-progress``, off a terminal, or without
    tqdm (the ``progress`` extra). Its ``update(nbytes)`` is a progress callback; close it when done."""
    if args.no_progress or not sys.stderr.isatty():
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=label, unit="B", unit_scale=True, unit_divisor=1024, leave=False,
                file=sys.stderr)


def step_bytes(tier: Tier, step: int) -> int:
    """The bytes the commit marker of ``step`` on ``tier`` records (a progress bar's total); 0 if unreadable."""
    try:
        return int(tier.read_marker(step).nbytes)
    except (TierfsError, OSError):
        return 0


def add_threads(p: argparse.ArgumentParser) -> None:
    """``-j/--threads N``: checksum threads."""
    p.add_argument("-j", "--threads", type=int, metavar="N", help="checksum threads (default: up to 4)")


def add_no_progress(p: argparse.ArgumentParser) -> None:
    """``--no-progress``."""
    p.add_argument("--no-progress", action="store_true", help="no progress bar (default: shown on a terminal)")
