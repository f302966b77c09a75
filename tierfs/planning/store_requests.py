"""What one object-tier save asks of the store at a job's size, and how long the store's per-prefix request
rates make it take.

Per rank and save the object tier makes one request per shard file it uploads (a multipart upload: its
parts plus two) and a few small ones, the same at any job size: the manifest's upload, one listing that
confirms its files, and retention's reading of an older step's manifest and batch delete of its files. The
small ones are measured by ``benchmarks/bench_requests.py`` (median over ranks, 2 to 64 ranks). A rank's
keys go under its bucket of key prefixes (:mod:`tierfs.format.keys`: 256 buckets, ranks beyond share them
evenly); the step's own prefix holds the marker, which rank 0 alone writes and deletes (retention's owner
tells the other ranks which markers it deleted: none of them asks the store). A store serves each prefix
at a limited rate: S3 about 3,500 writes (PUT, POST, DELETE) and 5,500 reads per second per prefix
partition; GCS about 1,000 writes per second at first, doubling every 20 minutes of sustained load. The
busiest prefix sets how long a save takes to be accepted. Pure: no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..format.keys import SPREAD_BUCKETS
from ..format.names import DEFAULT_FILE_SIZE

#: S3's writes per second per prefix partition, and GCS's initial writes per second (before ramping up)
S3_WRITES, GCS_WRITES = 3500.0, 1000.0
#: the smallest part S3 accepts in a multipart upload
S3_MIN_PART = 5 << 20
#: the object tier's default part size
PART_SIZE = 16 << 20

#: small requests per rank and steady save, by type, the same at 2 to 64 ranks (median over ranks,
#: ``benchmarks/results/bench_requests-20261129-3.md``): the manifest's upload; the listing that confirms the
#: rank's files; retention's read of an older step's manifest, its batch delete and its folder key's delete
SMALL = {"PUT": 1.0, "GET": 1.0, "LIST": 1.0, "DELETE": 2.0}
#: requests under a step's own prefix, at any job size (measured as SMALL): its marker's upload, by rank 0
#: (retention's deletion of an older marker goes to the bucket in a batch, its folder key to that step's)
AT_STEP = 1.0


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
    def buckets(self) -> int:
        """Key prefixes the ranks' files go under (one per rank, up to 256)."""
        return min(self.ranks, SPREAD_BUCKETS)

    @property
    def prefixes(self) -> int:
        """Key prefixes a save uses: the ranks' buckets and the step's own."""
        return self.buckets + 1

    @property
    def busiest_bucket(self) -> float:
        """Requests under the busiest bucket: its ranks' uploads and small requests."""
        return math.ceil(self.ranks / self.buckets) * (self.files * self.per_file + sum(SMALL.values()))

    @property
    def at_step(self) -> float:
        """Requests under the step's own prefix: the marker's, from rank 0 alone."""
        return AT_STEP

    @property
    def busiest(self) -> float:
        """Requests under the busiest prefix (what sets how long the store takes to accept a save)."""
        return max(self.busiest_bucket, self.at_step)

    def seconds(self, per_second: float) -> float:
        """How long the busiest prefix takes to accept its requests at ``per_second`` (a write rate: reads
        are served faster, so this is an upper bound)."""
        return self.busiest / per_second


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
