"""What one object-tier save asks of the store at a job's size, and how long the store's per-prefix request
rates make it take.

Per rank and save the object tier makes one request per shard file it uploads (a multipart upload: its
parts plus two) and a few small ones, the same at any job size: the manifest's upload, one listing that
confirms its files, the marker (rank 0), and retention's check and batch delete of an older step. The
small ones are measured by ``benchmarks/bench_requests.py`` (median over ranks, 2 to 64 ranks). Every
rank's keys of a step share one prefix, ``<root>/step_…``, so the store serves a whole save's uploads at
one prefix's rate: S3 about 3,500 writes (PUT, POST, DELETE) and 5,500 reads per second per prefix
partition; GCS about 1,000 writes per second at first, doubling every 20 minutes of sustained load. Pure:
no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..format.names import DEFAULT_FILE_SIZE

#: S3's writes per second per prefix partition, and GCS's initial writes per second (before ramping up)
S3_WRITES, GCS_WRITES = 3500.0, 1000.0
#: the smallest part S3 accepts in a multipart upload
S3_MIN_PART = 5 << 20
#: the object tier's default part size
PART_SIZE = 16 << 20

#: small requests per rank and steady save, by type, the same at 2 to 64 ranks (median over ranks,
#: ``benchmarks/results/bench_requests-20261129-1.md``): the manifest's upload; the listing that confirms the
#: rank's files; retention's check of an older step's marker (a HEAD, and s3fs's listing when it is gone),
#: its manifest read, its batch delete and its folder key's delete
SMALL = {"PUT": 1.0, "HEAD": 2.0, "GET": 1.0, "LIST": 2.0, "DELETE": 2.0}


@dataclass(frozen=True)
class ObjectSave:
    """One save to the object tier by a job of ``ranks`` ranks of ``shard`` bytes each."""

    ranks: int
    shard: float
    files: int  # shard files per rank
    per_file: int  # requests per file's upload
    by_type: dict[str, float] = field(default_factory=dict)  # the whole job's requests

    @property
    def requests(self) -> float:
        return sum(self.by_type.values())

    @property
    def one_prefix(self) -> float:
        """Requests under the step's prefix: every rank's uploads (what the busiest prefix must serve)."""
        return self.ranks * self.files * self.per_file

    def seconds(self, writes_per_second: float) -> float:
        """How long the step's prefix takes to accept its uploads at ``writes_per_second``."""
        return self.one_prefix / writes_per_second


def object_save(shard: float, ranks: int, file_size: int = DEFAULT_FILE_SIZE, part_size: int = PART_SIZE,
                small: dict[str, float] | None = None) -> ObjectSave:
    """The requests of one save of ``shard`` bytes per rank in files of about ``file_size`` bytes."""
    if ranks < 1 or shard < 0:
        raise ValueError(f"a save needs at least one rank and a shard size >= 0, got {ranks}, {shard}")
    part = max(part_size, S3_MIN_PART)
    files = max(1, math.ceil(shard / file_size))
    per_file = 1 if file_size < 2 * part else math.ceil(file_size / part) + 2  # s3fs: whole below two parts
    by_type = {k: v * ranks for k, v in (small or SMALL).items()}
    by_type["PUT"] = by_type.get("PUT", 0.0) + ranks * files * per_file
    return ObjectSave(ranks, shard, files, per_file, by_type)
