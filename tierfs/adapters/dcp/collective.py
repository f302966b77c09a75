"""One rank's bytes to every rank of the store, along a binomial tree (``TieredReader``'s metadata).

Built on the store group's point-to-point ``exchange`` (every wait bounded by the group's timeout, a
peer that fails named in a :class:`~tierfs.errors.RankWaitError`), without pickle: each rank receives
the bytes once, from its parent in the tree, and passes them on to at most log2(N) children, so what a
rank moves does not grow with the job beyond that, and the source sends log2(N) copies, not N - 1.

A message is a fixed-size first frame (kind, length, the first bytes) and, when the bytes do not fit,
the rest. A rank that fails to receive from its parent tells its children so (kind ``FAILED``) before
raising, so that a failure travels down the tree at once rather than by every rank's timeout.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ...util import stages as _stages
from ...errors import RankWaitError
#: the tag of the broadcast's messages
TAG = 1 << 20
#: bytes of the first frame: a 16-byte header (kind, length) and the first bytes of the data
WIDTH = 4096
_HEAD = 16
NONE, DATA, FAILED = 0, 1, 2


def tree(rank: int, world: int, src: int) -> tuple[int | None, list[int]]:
    """A rank's parent and children in the binomial tree rooted at ``src``.

    Parameters
    ----------
    rank, world, src : int
        This rank, the number of ranks and the root.

    Returns
    -------
    tuple
        ``(parent, children)``: the parent (None for ``src``) and the children, the one with the largest
        subtree first. Relative to ``src``, rank ``v``'s parent is ``v`` without its highest bit and its
        children are ``v + 2**j`` for every ``2**j`` above ``v``.
    """
    v = (rank - src) % world
    parent = None if v == 0 else ((v - (1 << (v.bit_length() - 1))) + src) % world
    children = []
    bit = 1 << v.bit_length()
    while v + bit < world:
        children.append((v + bit + src) % world)
        bit <<= 1
    return parent, children


def _frame(kind: int, data: bytes) -> np.ndarray:
    out = np.zeros(WIDTH, dtype=np.uint8)
    out[:_HEAD].view(np.int64)[:] = (kind, len(data))
    part = np.frombuffer(data, dtype=np.uint8)[:WIDTH - _HEAD]
    out[_HEAD:_HEAD + part.size] = part
    return out


def broadcast(group: Any, data: bytes | None, src: int) -> bytes | None:
    """Rank ``src``'s ``data`` on every rank of ``group`` (collective).

    Parameters
    ----------
    group : Group
        The store's ranks (``store.group``, or one ``with_timeout``); its timeout bounds the whole broadcast.
    data : bytes or None
        On ``src``, what to send (None is sent as None); ignored on the other ranks.
    src : int
        The rank whose data every rank gets.

    Returns
    -------
    bytes or None
        ``src``'s data.

    Raises
    ------
    RankWaitError
        This rank's parent in the tree (or a rank above it) did not send in time or is gone.
    """
    if group.world_size == 1:
        return data
    parent, children = tree(group.rank, group.world_size, src)
    failure: RankWaitError | None = None
    with group.bounded():
        if parent is None:
            kind, payload = (NONE, b"") if data is None else (DATA, bytes(data))
        else:
            try:
                head = np.empty(WIDTH, dtype=np.uint8)
                group.exchange([], [(parent, head)], tag=TAG)
                kind, size = (int(x) for x in head[:_HEAD].view(np.int64))
                payload = head[_HEAD:_HEAD + min(size, WIDTH - _HEAD)].tobytes()
                if size > WIDTH - _HEAD:
                    rest = np.empty(size - (WIDTH - _HEAD), dtype=np.uint8)
                    group.exchange([], [(parent, rest)], tag=TAG)
                    payload += rest.tobytes()
            except RankWaitError as e:
                failure, kind, payload = e, FAILED, str(e).encode()
        if children:
            first = _frame(kind, payload)
            sends = [(c, first) for c in children]
            if len(payload) > WIDTH - _HEAD:
                rest = np.frombuffer(payload, dtype=np.uint8)[WIDTH - _HEAD:]
                sends += [(c, rest) for c in children]
            group.exchange(sends, [], tag=TAG, tolerate=kind == FAILED)
    if failure is not None:
        raise failure
    if kind == FAILED:
        where = _stages.current()
        raise RankWaitError(f"{where + ': ' if where else ''}rank {src}'s data did not reach rank {parent}, "
                            f"which passes it on to this rank: {payload.decode(errors='replace')}",
                            stage=where)
    return payload if kind == DATA else None
