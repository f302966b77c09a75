"""What one rank pays to coordinate a steady save does not grow with the job.

The same job at 2, 3 and 6 processes (each its own node: a RAM tier, ``PeerTier(replicas=1)`` and an S3
object tier on a local server behind a request-counting proxy; benchmarks/_scale.py, whose ranks are
tests/children/scale_child.py): each rank, rank 0 included, makes the same calls into torch.distributed,
moves the same bytes through them and asks the object store the same requests in a steady save (its
retention's deletions included), opens the store in the same collectives and bytes, and holds the same
sockets after opening it (from 3 ranks on: with 2, a ring's two neighbours are one rank); a restart
agrees in the same collectives and bytes (``RestoreInfo.ranks`` goes through the job's store: one write
per rank), and only rank 0 lists the object tier.
``benchmarks/bench_scale.py`` measures the same from 2 to 64 processes.
"""

from __future__ import annotations

import os
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("moto")
pytest.importorskip("s3fs")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from _scale import Harness, measure  # noqa: E402

from tierfs.ranks import tree  # noqa: E402

#: what a steady save costs a rank, each the same at every job size
STEADY = ("calls", "collective_calls", "p2p_calls", "bytes_sent", "bytes_recv", "groups_created", "store_writes",
          "store_reads", "s3_LIST", "s3_keys_listed", "s3_PUT", "s3_HEAD", "s3_GET", "s3_DELETE",
          "s3_keys_deleted", "stream_collectives", "stream_p2p", "stream_p2p_bytes_sent", "stream_p2p_bytes_recv")


def tree_neighbours(rank: int, n: int) -> int:
    """How many ranks ``rank`` talks to in the tree of tierfs's collectives over its streams (its parent and
    children): 3 at most, whatever the job's size."""
    parent, children = tree.edges(rank, n)
    return (parent is not None) + len(children)


def test_a_steady_save_costs_a_rank_the_same_at_2_3_and_6_ranks():
    with Harness(6) as h:
        detail: dict = {}
        jobs = {n: measure(n, ("open", "steady_save", "restore"), harness=h, detail=detail if n == 6 else None)
                for n in (2, 3, 6)}
    large = jobs[6]
    for n in (2, 3):
        for rank in range(n):  # ranks holding the same state in every job (sizes differ by rank)
            a, b = jobs[n][rank]["steady_save"], large[rank]["steady_save"]
            assert {f: a.get(f, 0) for f in STEADY} == {f: b.get(f, 0) for f in STEADY}, (n, rank)
            assert a["calls"] > 0 and a["s3_PUT"] > 0 and a["s3_DELETE"] > 0  # it coordinated, uploaded, deleted
            # no HEAD: retention's owner tells the ranks in the copy's agreement which markers it deleted
            # (no rank asks the store for the marker's key), and whole files are read in one GET
            assert a.get("s3_HEAD", 0) == b.get("s3_HEAD", 0) == 0, (n, rank)
            # a restart: the same collectives and bytes, the object tier listed by rank 0 alone, and one
            # write to the job's store (this rank's line of RestoreInfo.ranks)
            a, b = jobs[n][rank]["restore"], large[rank]["restore"]
            assert a["calls"] == b["calls"] and a["groups_created"] == b["groups_created"] == 0, (n, rank)
            assert a["bytes_sent"] == b["bytes_sent"] and a["store_writes"] == b["store_writes"] == 1, (n, rank)
            assert a["s3_LIST"] == b["s3_LIST"] == (1 if rank == 0 else 0), (n, rank)
    # opening a store: the same collectives and bytes at every size (node numbers and which ranks share a
    # RAM directory confirmed, not gathered); sockets the same from 3 ranks on (with 2, a ring's two
    # neighbours are one rank)
    for n in (2, 3):
        for rank in range(n):
            a, b = jobs[n][rank]["open"], large[rank]["open"]
            assert (a["calls"], a["bytes_sent"], a["bytes_recv"]) == (b["calls"], b["bytes_sent"], b["bytes_recv"]), \
                (n, rank)
    for rank in range(3):
        assert jobs[3][rank]["open"]["tierfs_socket_fds"] == large[rank]["open"]["tierfs_socket_fds"], rank
    # every rank, rank 0 and the ranks only the larger job has included, makes the same calls
    assert len({r["steady_save"]["calls"] for job in jobs.values() for r in job.values()}) == 1
    # the collectives over the streams: the same on every rank; each costs a rank two messages per neighbour
    # of the tree (three at most), of the same bytes
    steady = [(n, rank, r["steady_save"]) for n, job in jobs.items() for rank, r in job.items()]
    assert len({s["stream_collectives"] for _, _, s in steady}) == 1 and steady[0][2]["stream_collectives"] > 0
    assert all(s["stream_messages"] == 2 * tree_neighbours(rank, n) * s["stream_collectives"]
               for n, rank, s in steady), [(n, rank, s["stream_messages"]) for n, rank, s in steady]
    assert len({s["stream_bytes_sent"] / tree_neighbours(rank, n) for n, rank, s in steady}) == 1

    # retention (LatestN(2) of steps 1-5): at each save the owner deletes the marker of the step dropped,
    # and each rank takes back its own files at the next save's retention; the close removes what is left
    # of the step the last save dropped (step 3): the job leaves only the kept steps
    saved = by_step(detail["keys"]["save"])
    assert sorted(saved) == ["step_000000000004", "step_000000000005"], sorted(saved)
    for s in ("step_000000000004", "step_000000000005"):
        assert "COMMITTED" in saved[s] and {f"rank_{r:05d}.manifest.json" for r in range(6)} <= saved[s], s
    assert sorted(by_step(detail["keys"]["restore"])) == ["step_000000000004", "step_000000000005"]


def by_step(keys: list[str]) -> dict[str, set[str]]:
    """``{step folder: names}`` of an object tier's keys (the marker under the step, each rank's files
    under its bucket: ``ranks/<bucket>/step_…/``)."""
    out: dict[str, set[str]] = {}
    for k in keys:
        step, _, name = (k.split("/", 2)[2] if k.startswith("ranks/") else k).partition("/")
        out.setdefault(step, set()).add(name)
    return out


def test_a_data_parallel_save_costs_a_rank_the_same_at_2_and_6_ranks():
    """An array every rank holds alike, declared replicated: stored once, and the ranks check at each commit
    that they hold the same values, each against its neighbours in the group, so a rank's steady save costs
    the same at any size: the group's first rank (it stores the array) and last rank as at 2 ranks, the
    ranks between the same as one another (one more receive: from both neighbours)."""
    with Harness(6) as h:
        small = measure(2, ("steady_save",), harness=h, replicated=True)
        large = measure(6, ("steady_save",), harness=h, replicated=True)

    def figures(job, rank):
        return {f: job[rank]["steady_save"].get(f, 0) for f in STEADY if "bytes" not in f}
    assert figures(small, 0) == figures(large, 0) and figures(small, 1) == figures(large, 5)
    assert small[0]["steady_save"]["s3_PUT"] > small[1]["steady_save"]["s3_PUT"]  # the array: stored once
    middle = [figures(large, r) for r in range(1, 5)]
    assert all(m == middle[0] for m in middle) and middle[0]["stream_p2p"] == figures(large, 5)["stream_p2p"] + 1
