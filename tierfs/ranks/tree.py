"""Collectives over a group's streams (:mod:`tierfs.ranks.streams`): a binary tree of the ranks, rooted at
rank 0 (rank ``r``'s parent is ``(r - 1) // 2``, its children ``2r + 1`` and ``2r + 2``).

Each collective goes up the tree and back down: a rank waits for its children's messages, combines them
with its own, sends the result to its parent, waits for the parent's answer and passes it on to its
children. So a rank talks to three others at most whatever the job's size, over six streams, and a
collective takes ``2 log2(N)`` hops (gloo's ring all-reduce takes ``2 (N - 1)``). Every message is sent and
read on the calling thread, with no thread of the backend's: a group whose collectives go this way holds
no gloo group, and nothing of it runs while it is idle (gloo's I/O loop of a group wakes every 10 ms).

A message that cannot move (its peer's process ended, nothing came within the operation's time, the stream
out of step) stops the collective on this rank; the caller then closes every stream of the process, so the
ranks blocked on this one fail at once, and finds out which rank failed through the job's store, as for a
failed transfer (:meth:`tierfs.ranks.groups.TorchGroup.exchange`).
"""

from __future__ import annotations

import json
import struct
from typing import Any, Callable, Sequence

import numpy as np

from .streams import Link
from .waits import Round

_RANK = struct.Struct("<q")
_OPS: dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    "min": np.minimum, "max": np.maximum, "sum": np.add}


def edges(rank: int, world: int) -> tuple[int | None, list[int]]:
    """``rank``'s parent (None: the root) and children in a job of ``world`` ranks."""
    parent = None if rank == 0 else (rank - 1) // 2
    return parent, [c for c in (2 * rank + 1, 2 * rank + 2) if c < world]


def up_and_down(link: Link, io: Round, rank: int, world: int, mine: bytes,
                combine: Callable[[bytes, list[bytes]], bytes]) -> bytes:
    """The root's ``combine`` of the whole tree, on every rank: each rank combines its own ``mine`` with
    what its children sent up, sends that to its parent, and passes the answer coming down to its
    children. A failed message raises :class:`~tierfs.ranks.streams.Stopped` (noted in ``io``)."""
    parent, children = edges(rank, world)
    got = [link.receive(io, c) for c in children]
    out = combine(mine, got) if got else mine
    if parent is not None:
        link.send(io, parent, out)
        out = link.receive(io, parent)
    for c in children:
        link.send(io, c, out)
    return out


def all_reduce(link: Link, io: Round, rank: int, world: int, values: Sequence[int], op: str) -> list[int]:
    """Every rank's int64 ``values`` reduced element by element (``"min"``, ``"max"`` or ``"sum"``)."""
    fn = _OPS[op]

    def combine(own: bytes, rest: list[bytes]) -> bytes:
        acc = np.frombuffer(own, dtype=np.int64).copy()
        for r in rest:
            acc = fn(acc, np.frombuffer(r, dtype=np.int64))
        return acc.tobytes()
    out = up_and_down(link, io, rank, world, np.array([int(v) for v in values], dtype=np.int64).tobytes(), combine)
    return [int(v) for v in np.frombuffer(out, dtype=np.int64)]


def broadcast(link: Link, io: Round, rank: int, world: int, obj: Any, src: int) -> Any:
    """Rank ``src``'s ``obj`` (JSON) on every rank: up the tree from ``src`` to the root, then down (only
    the tree's streams are used, whichever rank sends)."""
    mine = b"\x01" + json.dumps(obj).encode() if rank == src else b"\x00"

    def combine(own: bytes, rest: list[bytes]) -> bytes:
        return next((m for m in (own, *rest) if m[:1] == b"\x01"), b"\x00")
    out = up_and_down(link, io, rank, world, mine, combine)
    return json.loads(out[1:])


def all_gather(link: Link, io: Round, rank: int, world: int, row: np.ndarray) -> np.ndarray:
    """Every rank's uint8 ``row`` (the same length on every rank) as the rows of an array in rank order:
    each rank sends up its subtree's rows, each with its rank, and every rank gets all of them back."""
    width = row.size

    def combine(own: bytes, rest: list[bytes]) -> bytes:
        return b"".join((own, *rest))
    mine = _RANK.pack(rank) + np.ascontiguousarray(row, dtype=np.uint8).tobytes()
    out = np.frombuffer(up_and_down(link, io, rank, world, mine, combine), dtype=np.uint8).reshape(-1, 8 + width)
    rows = np.zeros((world, width), dtype=np.uint8)
    rows[out[:, :8].copy().view(np.int64)[:, 0]] = out[:, 8:]
    return rows
