"""Collectives over connections that do not grow with the job: an all-reduce of a few integers, a broadcast
of a small JSON value (their bytes per rank do not grow either), and an all-gather of fixed-size rows. Each rank talks to a fixed few others (gloo's ring and tree, over connections made
when first used), so what one rank sends, receives and holds open is the same at 4 ranks and at 8,192.

A collective fails on the ranks whose connections to a dead rank drop, or when the time runs out; each rank
that sees it fail closes its own connections (:mod:`tierfs.ranks.severing`), so the failure travels around
the ring in milliseconds to the ranks blocked on it. Which ranks to name is then found out through the
job's store (:mod:`tierfs.ranks.diagnosis`), never by connecting to them.
"""

from __future__ import annotations

import datetime
import json
import threading
import warnings
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from . import diagnosis, severing, waits

if TYPE_CHECKING:
    from .member import Member

def framed(data: bytes, width: int) -> np.ndarray:
    """``width`` bytes: ``len(data)`` as an int64, then as much of ``data`` as fits (read the length with
    ``buf[:8].view(np.int64)[0]``): a row of a gather, or a transfer's first message."""
    out = np.zeros(width, dtype=np.uint8)
    out[:8].view(np.int64)[0] = len(data)
    part = np.frombuffer(data, dtype=np.uint8)[:width - 8]
    out[8:8 + part.size] = part
    return out


def all_reduce(g: "Member", values: Sequence[int], op: str = "min") -> list[int]:
    """Every rank's int64 ``values`` reduced element by element (``"min"``, ``"max"`` or ``"sum"``), on
    every rank of ``g``."""
    return all_reduce_started(g, values, op)()


def all_reduce_started(g: "Member", values: Sequence[int], op: str = "min") -> Callable[[], list[int]]:
    """:func:`all_reduce` started now; calling what it returns (once, on this thread) waits for it and
    returns the result. Meanwhile the backend's threads move its bytes and this thread is free: a save
    copies its state while the ranks agree, with no thread of its own for the agreement."""
    import torch

    t = torch.tensor([int(v) for v in values], dtype=torch.int64)
    work = _start(g, lambda: g._dist.all_reduce(t, op=getattr(g._dist.ReduceOp, op.upper()), group=g._pg,
                                                async_op=True))

    def result() -> list[int]:
        _finish(g, work)
        return [int(v) for v in t.tolist()]
    return result


def broadcast(g: "Member", obj: Any, src: int) -> Any:
    """Rank ``src``'s ``obj`` (JSON) on every rank of ``g``: its length, then its bytes."""
    import torch

    data = json.dumps(obj).encode() if g.rank == src else b""
    n = torch.tensor([len(data)], dtype=torch.int64)
    _run(g, lambda: g._dist.broadcast(n, src=src, group=g._pg, async_op=True))
    size = int(n[0])
    buf = np.frombuffer(data, dtype=np.uint8).copy() if g.rank == src else np.empty(size, dtype=np.uint8)
    body = torch.from_numpy(buf)
    _run(g, lambda: g._dist.broadcast(body, src=src, group=g._pg, async_op=True))
    return json.loads(buf.tobytes())


def all_gather(g: "Member", row: np.ndarray) -> np.ndarray:
    """Every rank's uint8 ``row`` (the same length on every rank), as the rows of an array in rank order:
    an all-reduce (a sum) of an array holding this rank's row in its place and zeros elsewhere, so that a
    gather too only ever talks to the ring's neighbours (its bytes grow with the job, its connections do
    not)."""
    import torch

    rows = torch.zeros((g.world_size, row.size), dtype=torch.uint8)
    rows[g.rank] = torch.from_numpy(np.ascontiguousarray(row, dtype=np.uint8))
    _run(g, lambda: g._dist.all_reduce(rows, op=g._dist.ReduceOp.SUM, group=g._pg, async_op=True))
    return rows.numpy()


def all_gather_ints(g: "Member", values: Sequence[int]) -> np.ndarray:
    """Every rank's int64 ``values`` (the same count on every rank), as the rows of an array in rank order:
    8 bytes per value and rank (:func:`all_gather`'s way)."""
    import torch

    rows = torch.zeros((g.world_size, len(values)), dtype=torch.int64)
    rows[g.rank] = torch.tensor([int(v) for v in values], dtype=torch.int64)
    _run(g, lambda: g._dist.all_reduce(rows, op=g._dist.ReduceOp.SUM, group=g._pg, async_op=True))
    return rows.numpy()


def _run(g: "Member", start: Any) -> None:
    """Start a collective and wait for it within the operation's time (:func:`_start`, :func:`_finish`)."""
    _finish(g, _start(g, start))


def _start(g: "Member", start: Any) -> Any:
    """Start a collective (numbered: the same number on every rank, collectives run in one order); once a
    failure of the job's ranks is known, raise it at once."""
    diagnosis.raise_known(g._dist, g.rank)
    g._calls[0] += 1
    with g.bounded() as oper:
        try:
            return start()
        except RuntimeError as e:
            severing.sever_all(g._dist)
            raise diagnosis.diagnose(g, oper, str(e)) from None


def _finish(g: "Member", work: Any) -> None:
    """Wait for a started collective within the operation's time; a failure closes this rank's connections
    on every group (so the ranks blocked on it fail too) and names the ranks that made it fail
    (:func:`~tierfs.ranks.diagnosis.diagnose`)."""
    with g.bounded() as oper:
        try:
            if g._gone is None or g.world_size < 2:
                work.wait(timeout=datetime.timedelta(seconds=oper.allowed()))
            else:  # a neighbour killed with a message under way: noticed at once, not at the timeout
                ring = list(dict.fromkeys([(g.rank + 1) % g.world_size, (g.rank - 1) % g.world_size]))
                dead = waits.watched(work, oper.allowed(), ring, g._gone)
                if dead is not None:
                    raise RuntimeError(waits.ended(dead))
        except RuntimeError as e:
            severing.sever_all(g._dist)
            raise diagnosis.diagnose(g, oper, str(e)) from None


def posted(g: "Member", io: waits.Round, sends: Sequence[tuple[int, np.ndarray]],
           recvs: Sequence[tuple[int, np.ndarray]], pace: Callable[[int], None] | None,
           on_received: Callable[[int], None] | None, failures: list[BaseException], tag: int) -> None:
    """An exchange's transfers over gloo (see :meth:`tierfs.ranks.groups.TorchGroup.exchange`): every receive
    posted, then every send, each waited for, in ``io``."""
    import torch

    def lane(peer: int, counts: dict[int, int]) -> Any:  # the k-th buffer of a pair: lane k % lanes
        k = counts[peer] = counts.get(peer, -1) + 1
        return g._lanes[k % len(g._lanes)]

    def post(send: bool, peer: int, buf: np.ndarray, counts: dict[int, int]) -> Any:
        start = g._dist.isend if send else g._dist.irecv
        return io.start(peer, lambda: start(torch.from_numpy(buf), peer, group=lane(peer, counts), tag=tag))

    def receive() -> None:
        for i, w in enumerate(works):
            if io.wait(w, recvs[i][0]) and on_received is not None and not failures:
                try:
                    on_received(i)
                except BaseException as e:  # noqa: BLE001 - raised by the caller once all is done
                    failures.append(e)

    with warnings.catch_warnings():  # read-only mappings are only ever sent, never written
        warnings.simplefilter("ignore", UserWarning)
        got: dict[int, int] = {}
        works = [post(False, src, buf, got) for src, buf in recvs]
        receiver = None
        if on_received is not None:  # else this thread waits for the receives once its sends are out
            receiver = threading.Thread(target=receive, name="tierfs-receive", daemon=True)
            receiver.start()  # inherits this thread's CPU priority
        sent: list[tuple[int, Any]] = []
        put: dict[int, int] = {}
        try:
            for dst, buf in sends:
                if pace is not None:
                    try:
                        pace(buf.nbytes)
                    except BaseException as e:  # noqa: BLE001 - the rest still goes, unpaced: nobody waits
                        failures.append(e)
                        pace = None
                sent.append((dst, post(True, dst, buf, put)))
        finally:
            if receiver is not None:
                receiver.join()
            else:
                receive()
            for dst, w in sent:
                io.wait(w, dst)
