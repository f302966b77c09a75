"""What coordinating a save costs a job at a cluster's size, from what one rank pays.

The per-rank figures are measured by ``benchmarks/bench_scale.py`` (a RAM tier, ``PeerTier(replicas=1)``
and an S3 object tier; one shard file per rank): they are the same at every job size measured (2 to 64
ranks), so a job's totals are the per-rank figure times its ranks. Only the rank that owns the object
tier's steps still does work that grows with the job: retention lists and deletes every rank's objects of
the step it lets go. Pure: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PerRank:
    """What one rank pays to coordinate one save that every tier takes (RAM, peers, object store).

    Attributes
    ----------
    collectives:
        All-reduces of a few integers (agreements, the commit, the copy and the replication).
    sockets:
        Sockets the rank's store holds open (its groups' ring neighbours and replication peers).
    store_requests:
        Requests to the job's TCPStore (none while nothing fails).
    object_requests:
        Requests to the object store for the rank's own shard (its file and manifest: PUT and HEAD each).
    owner_keys_per_rank:
        Keys the owner of the object tier lists and deletes per save for each rank of the job (retention).
    """

    collectives: int = 8
    sockets: int = 16
    store_requests: int = 0
    object_requests: int = 4
    owner_keys_per_rank: float = 2.0


#: per-rank figures of a steady save, ``benchmarks/results/bench_scale-20261127-3.md``
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
    owner_keys: int


def per_save(ranks: int, m: PerRank = MEASURED) -> JobCost:
    """The coordination of one save at ``ranks`` ranks, from the per-rank figures ``m``."""
    if ranks < 1:
        raise ValueError(f"a job has at least one rank, got {ranks}")
    return JobCost(ranks, m.collectives, m.sockets, m.sockets * ranks, m.store_requests * ranks,
                   m.object_requests * ranks, int(round(m.owner_keys_per_rank * ranks)))
