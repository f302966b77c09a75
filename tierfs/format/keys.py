"""Where a step's files go on an object store: the key layout of each format version.

Up to version 2 every file of a step is under one prefix, ``<root>/step_…/``. An object store serves one
prefix at a limited rate (S3 about 3,500 writes per second per prefix partition; GCS spreads load by key
range), and each new step's prefix starts cold: at thousands of ranks a save queues on one partition.
From version 3 a rank's files (``rank_NNNNN.*``) go under one of :data:`SPREAD_BUCKETS` prefixes before
the step, ``<root>/ranks/<bucket>/step_…/``; the marker (and any file no rank owns) stays at
``<root>/step_…/``, so listing the steps and committing one cost what they did. The buckets are the
same for every step, so the partitions a store splits for one save serve the next.

Only object tiers spread their keys; node-local tiers keep one directory per step whatever the version.
A step's marker says its version, hence where its ranks' files are.
"""

from __future__ import annotations

import re

from .names import step_dirname

#: the first format version whose object-tier steps keep each rank's files under its bucket
SPREAD_VERSION = 3
#: the folder under a tier's root that holds the buckets
SPREAD_DIR = "ranks"
#: buckets in all: ranks beyond share them evenly
SPREAD_BUCKETS = 256

_RANK_RE = re.compile(r"rank_([0-9]{5})\.", re.ASCII)
_BUCKET_RE = re.compile(r"[0-9a-f]{2}", re.ASCII)


def spread_bucket(rank: int) -> str:
    """The bucket of rank ``rank``'s files: the low 8 bits of the rank in reverse order, as two hex digits,
    so ranks 0-15 differ in the first digit, ranks 0-255 each have a bucket of their own, and every bucket
    takes the same share of a larger job's ranks."""
    low = rank % SPREAD_BUCKETS
    return f"{int(f'{low:08b}'[::-1], 2):02x}"


def rank_of_file(name: str) -> int | None:
    """The rank whose file ``name`` is (``rank_00003.0001.bin`` → 3), or None for a file no rank owns (the
    marker)."""
    m = _RANK_RE.match(name)
    return int(m.group(1)) if m else None


def key(step: int, name: str) -> str:
    """Where a save of this version puts file ``name`` of ``step``, relative to the tier's root:
    ``ranks/<bucket>/step_…/<name>`` for a rank's file, ``step_…/<name>`` for the marker."""
    rank = rank_of_file(name)
    if rank is None:
        return f"{step_dirname(step)}/{name}"
    return f"{SPREAD_DIR}/{spread_bucket(rank)}/{step_dirname(step)}/{name}"


def is_bucket(name: str) -> bool:
    """Whether ``name`` (one listing entry's last component) names a bucket."""
    return bool(_BUCKET_RE.fullmatch(name))
