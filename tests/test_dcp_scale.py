"""DCP at scale, without processes: the coordinator's sharing plan (``plan_sharing``) decides what the
code before it decided, and what each rank is sent does not grow with the number of ranks; the runs
that carry groups of ranks; the binomial tree and the broadcast ``TieredReader`` sends the metadata with
(over an in-process stand-in of the store's group)."""

from __future__ import annotations

import contextlib
import os
import pickle
import queue
import random
import sys
import threading
from typing import Any

import numpy as np
import pytest
import torch
from torch.distributed.checkpoint._dedup_save_plans import dedup_save_plans
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import (BytesIOWriteData, SavePlan, TensorWriteData, WriteItem,
                                                  WriteItemType)

from tierfs.adapters.dcp import collective
from tierfs.adapters.dcp.sharing import HELD, decode_ranks, encode_ranks, held, plan_sharing, sharing_of
from tierfs.errors import RankWaitError

# the code before the planning was made linear, kept verbatim by the benchmark that compares the two
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from bench_dcp_plan import old_plan_sharing  # noqa: E402


# -- synthesized plans ---------------------------------------------------------------------------------
_PROPS = TensorProperties(dtype=torch.float32)
SHAPES = [("model.embed.weight", (64, 16)), ("model.0.norm.weight", (16,)), ("model.0.attn.weight", (48, 16)),
          ("model.0.mlp.weight", (64, 16)), ("model.1.norm.weight", (16,)), ("model.head.weight", (64, 16))]


def chunk(fqn: str, shape: tuple[int, ...], shards: int, shard: int) -> WriteItem:
    """Chunk ``shard`` of ``shards`` of a tensor on dim 0 (dim 0 rounded up to a multiple of ``shards``)."""
    d0 = -(-max(shape[0], shards) // shards) * shards
    rows = d0 // shards
    offsets = torch.Size((shard * rows, *(0 for _ in shape[1:])))
    c = ChunkStorageMetadata(offsets=offsets, sizes=torch.Size((rows, *shape[1:])))
    return WriteItem(index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD,
                     tensor_data=TensorWriteData(chunk=c, properties=_PROPS, size=torch.Size((d0, *shape[1:]))))


def blob(fqn: str) -> WriteItem:
    return WriteItem(index=MetadataIndex(fqn), type=WriteItemType.BYTE_IO, bytes_io_data=BytesIOWriteData(nbytes=8))


def local_plan(items: list[WriteItem], rank: int) -> SavePlan:
    return SavePlan(items, storage_data={"tierfs_rank": rank, HELD: held(items)})


def layout(kind: str, world: int) -> list[SavePlan]:
    """Every rank's local plan: ``dp`` (every rank every tensor), ``hsdp`` (replica groups of 4 over
    world / 4 shards), ``mixed`` (some tensors on every rank, some HSDP-sharded, some per rank, bytes
    items, ranks holding different sets and one listing its items in another order)."""
    plans = []
    for r in range(world):
        if kind == "dp":
            items = [chunk(f, s, 1, 0) for f, s in SHAPES]
        elif kind == "hsdp":
            shards = max(1, world // 4)
            items = [chunk(f, s, shards, r % shards) for f, s in SHAPES]
        else:
            shards = max(1, world // 2)
            items = [chunk(f, s, 1, 0) for f, s in SHAPES[:2]]  # replicated everywhere
            items += [chunk(f, s, shards, r % shards) for f, s in SHAPES[2:5]]  # pairs of replicas
            items += [chunk(f"own.{r}", (8,), 1, 0), blob("optim.step")]  # own; bytes every rank holds
            if r % 3 == 0:
                items.append(chunk(SHAPES[5][0], SHAPES[5][1], 1, 0))  # held by every third rank
            if r == 1:
                items.append(blob("only.one"))
            if r == 2:
                items.reverse()  # the same names in another order
        plans.append(local_plan(items, r))
    return plans


def decisions(shares: list[Any]) -> list[Any]:
    return [sharing_of(s) for s in shares]


@pytest.mark.parametrize("kind", ["dp", "hsdp", "mixed"])
@pytest.mark.parametrize("world", [1, 2, 3, 8, 12, 32])
@pytest.mark.parametrize("lowest", [False, True])
def test_the_same_decisions_as_before(kind: str, world: int, lowest: bool) -> None:
    final = dedup_save_plans(layout(kind, world), save_to_lowest_rank=lowest)
    ranks = list(range(world))
    new, old = plan_sharing(final, ranks, "s1"), old_plan_sharing(final, ranks, "s1")
    assert decisions(new) == decisions(old)
    for a, b in zip(new, old):  # the JSON too, but for the encoding of the groups
        assert a is not None and b is not None and a["sid"] == b["sid"] == "s1"
        assert a["owners"] == b["owners"] and [list(decode_ranks(g)) for g in a["groups"]] == b["groups"]
    if world > 1 and kind != "hsdp":
        assert any(d is not None for d in decisions(new))


def test_other_rank_numbers_and_a_plan_without_names() -> None:
    final = dedup_save_plans(layout("mixed", 8))
    ranks = [7 - k for k in range(8)]  # a plan's rank is what it says, not its place
    assert decisions(plan_sharing(final, ranks, "s")) == decisions(old_plan_sharing(final, ranks, "s"))
    final[3].storage_data.pop(HELD)
    assert plan_sharing(final, ranks, "s") == [None] * 8 == old_plan_sharing(final, ranks, "s")


def test_a_name_listed_twice() -> None:  # the writer rejects such a plan later; the planning still agrees
    plans = layout("dp", 3)
    plans[1].storage_data[HELD].append(plans[1].storage_data[HELD][0])
    final = dedup_save_plans(plans)
    assert decisions(plan_sharing(final, [0, 1, 2], "s")) == decisions(old_plan_sharing(final, [0, 1, 2], "s"))


@pytest.mark.parametrize("kind", ["dp", "hsdp"])
def test_what_each_rank_is_sent_does_not_grow_with_the_ranks(kind: str) -> None:
    def sent(world: int) -> list[int]:
        final = dedup_save_plans(layout(kind, world))
        shares = plan_sharing(final, list(range(world)), "0" * 32)
        return [len(pickle.dumps({"tierfs_rank": r, "tierfs_shared": s})) for r, s in enumerate(shares)]

    small, large = sent(8), sent(512)
    # the same items per rank: only the rank numbers take a byte or two more
    assert max(large) <= max(small) + 3 * len(SHAPES) + 16, (max(small), max(large))


# -- runs of ranks -------------------------------------------------------------------------------------
@pytest.mark.parametrize("ranks, runs", [
    ([], []), ([5], [5]), (list(range(8)), [[0, 8, 1]]), ([1, 5, 9, 13], [[1, 17, 4]]),
    ([0, 1, 2, 3, 16, 17, 18, 19, 32, 33, 34, 35], [[0, 4, 1, 3, 16]]), ([2, 2], [[2, 3, 1, 2, 0]]),
    ([0, 2, 3, 7], [[0, 4, 2], [3, 11, 4]]),
])
def test_runs(ranks: list[int], runs: list[Any]) -> None:
    assert encode_ranks(ranks) == runs and decode_ranks(runs) == tuple(ranks)


def test_runs_of_any_group() -> None:
    rng = random.Random(7)
    for _ in range(300):
        ranks = sorted(rng.sample(range(200), rng.randint(0, 60)) + rng.choices(range(200), k=rng.randint(0, 3)))
        assert decode_ranks(pickle.loads(pickle.dumps(encode_ranks(ranks)))) == tuple(ranks)


# -- the tree and the broadcast ------------------------------------------------------------------------
@pytest.mark.parametrize("world", [1, 2, 5, 8, 13, 64, 1000])
@pytest.mark.parametrize("src", [0, 3])
def test_tree(world: int, src: int) -> None:
    src %= world
    parents = {r: collective.tree(r, world, src)[0] for r in range(world)}
    assert parents[src] is None and all(p is not None for r, p in parents.items() if r != src)
    for r in range(world):
        assert all(parents[c] == r for c in collective.tree(r, world, src)[1])
    depth = max(len(bin((r - src) % world)) - 2 for r in range(world)) if world > 1 else 0
    assert depth <= max(1, (world - 1).bit_length())


class _Group:
    """One rank of an in-process group: ``exchange`` through queues, as the store's group moves buffers."""

    def __init__(self, rank: int, world: int, boxes: dict[tuple[int, int], "queue.Queue[np.ndarray]"],
                 broken: set[int]) -> None:
        self.rank, self.world_size, self._boxes, self._broken = rank, world, boxes, broken
        self.sent: list[int] = []

    def bounded(self) -> Any:
        return contextlib.nullcontext()

    def exchange(self, sends: list[tuple[int, np.ndarray]], recvs: list[tuple[int, np.ndarray]], tag: int = 0,
                 *, tolerate: bool = False) -> dict[int, str]:
        for dst, buf in sends:
            self._boxes[(self.rank, dst)].put(buf.copy())
            self.sent.append(buf.nbytes)
        for src, buf in recvs:
            if self.rank in self._broken:
                raise RankWaitError(f"rank {src} is gone", ranks=[src])
            got = self._boxes[(src, self.rank)].get(timeout=10)
            assert got.nbytes == buf.nbytes
            buf[:] = got
        return {}


def _run(world: int, src: int, data: bytes | None, broken: set[int] = frozenset()) -> tuple[dict, list]:  # type: ignore[assignment]
    boxes = {(a, b): queue.Queue() for a in range(world) for b in range(world)}
    groups = [_Group(r, world, boxes, broken) for r in range(world)]
    out: dict[int, Any] = {}

    def one(g: _Group) -> None:
        try:
            out[g.rank] = collective.broadcast(g, data if g.rank == src else b"ignored", src)
        except RankWaitError as e:
            out[g.rank] = e

    threads = [threading.Thread(target=one, args=(g,)) for g in groups]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out, groups


@pytest.mark.parametrize("size", [0, 10, collective.WIDTH - 16, collective.WIDTH * 3 + 5])
def test_broadcast(size: int) -> None:
    data = bytes(random.Random(size).getrandbits(8) for _ in range(size))
    out, groups = _run(13, 5, data)
    assert all(out[r] == data for r in range(13))
    assert max(len(g.sent) for g in groups) <= 2 * 4  # at most log2(13) children, two frames each
    assert _run(4, 1, None)[0] == {r: None for r in range(4)}


def test_a_failure_travels_down_the_tree() -> None:
    out, _ = _run(8, 0, b"x" * 10, broken={1})  # rank 1 cannot hear its parent: 3, 5 and 7 hear of it
    assert isinstance(out[1], RankWaitError) and out[1].ranks == [0]
    for r in (3, 5, 7):
        assert isinstance(out[r], RankWaitError) and "rank 0 is gone" in str(out[r])
    assert all(out[r] == b"x" * 10 for r in (0, 2, 4, 6))
