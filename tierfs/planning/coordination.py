"""What coordinating a save costs a job at a cluster's size, from what one rank pays.

The per-rank figures are measured by ``benchmarks/bench_scale.py`` (a RAM tier, ``PeerTier(replicas=1)``
and an S3 object tier; one shard file per rank): they are the same at every job size measured (2 to 64
ranks), rank 0 included, so a job's totals are the per-rank figure times its ranks. Pure: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PerRank:
    """What one rank pays to coordinate one save that every tier takes (RAM, peers, object store).

    Attributes
    ----------
    collectives:
        All-reduces of a few integers (agreements, the commit, the copy and the replication): one on the
        store's gloo group, the rest up and down the tree of its threads' groups over tierfs's streams.
    sockets:
        Sockets the rank's store holds open at most (its gloo group's ring neighbours and listening socket,
        its threads' groups' streams to their tree's parent and children, the replication peers); a rank
        with fewer neighbours in the tree (half the ranks are its leaves) holds fewer.
    store_requests:
        Requests to the job's TCPStore (none while nothing fails).
    object_requests:
        Requests to the object store for the rank's own files with one shard file: the uploads of that
        file and its manifest, one listing that confirms them, and retention's deletion of its files of the
        step a later save lets go (its manifest read, one batch delete, its folder's key). Rank 0 also
        writes the new marker and deletes the old one, and tells the other ranks so in the next copy's
        agreement. A larger shard adds one request per
        shard file (:mod:`tierfs.planning.store_requests`).
    """

    collectives: int = 7
    sockets: int = 39
    store_requests: int = 0
    object_requests: int = 6


#: per-rank figures of a steady save, ``benchmarks/results/bench_scale-20261201-1.md`` (the object store's:
#: ``bench_requests-20261129-3.md``)
MEASURED = PerRank()


@dataclass(frozen=True)
class JobCost:
    """One save's coordination for a job of ``ranks`` ranks (the object store's requests are per save)."""

    ranks: int
    collectives_per_rank: int
    sockets_per_rank: int
    sockets: int
    store_requests: int
    object_requests: int


def per_save(ranks: int, m: PerRank = MEASURED) -> JobCost:
    """The coordination of one save at ``ranks`` ranks, from the per-rank figures ``m``."""
    if ranks < 1:
        raise ValueError(f"a job has at least one rank, got {ranks}")
    return JobCost(ranks, m.collectives, m.sockets, m.sockets * ranks, m.store_requests * ranks,
                   m.object_requests * ranks)
