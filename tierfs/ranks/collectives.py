"""Collectives whose cost per rank does not grow with the job: an all-reduce of a few integers, a broadcast
of a small JSON value. Each rank talks to a fixed few others (gloo's ring and tree, over connections made
when first used), so what one rank sends, receives and holds open is the same at 4 ranks and at 8,192.

A collective fails on every rank when one rank's connection drops (each rank that sees it closes its own
connections, so it travels around the ring in milliseconds) or when the time runs out. Which ranks to name
is then found out by :func:`diagnose`: each rank exchanges one byte with every other over a group kept for
this, whose connections are made only then: a rank whose process is gone fails at once, one that is stuck
does not answer before the deadline, and the error names exactly those. Only a failure costs a message
per rank pair.
"""

from __future__ import annotations

import datetime
import json
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from .. import _stages
from ..errors import RankWaitError
from . import waits

if TYPE_CHECKING:
    from .groups import TorchGroup

#: the tag of the messages that find out who failed
PROBE_TAG = 1 << 21


def all_reduce(g: "TorchGroup", values: Sequence[int], op: str = "min") -> list[int]:
    """Every rank's int64 ``values`` reduced element by element (``"min"``, ``"max"`` or ``"sum"``), on
    every rank of ``g``."""
    import torch

    t = torch.tensor([int(v) for v in values], dtype=torch.int64)
    _run(g, lambda: g._dist.all_reduce(t, op=getattr(g._dist.ReduceOp, op.upper()), group=g._pg, async_op=True))
    return [int(v) for v in t.tolist()]


def broadcast(g: "TorchGroup", obj: Any, src: int) -> Any:
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


def _run(g: "TorchGroup", start: Any) -> None:
    """Start a collective and wait for it within the operation's time; a failure is :func:`diagnose`d."""
    with g.bounded() as oper:
        try:
            start().wait(timeout=datetime.timedelta(seconds=oper.allowed()))
        except RuntimeError as e:
            raise diagnose(g, oper, str(e)) from None


def diagnose(g: "TorchGroup", oper: waits.Operation, why: str) -> RankWaitError:
    """After a collective of ``g`` failed with ``why``: the error naming the ranks that failed (see the
    module docstring)."""
    import torch

    where = _stages.current()
    if waits.kind_of(why) == waits.LATE:  # gloo closed this rank's connections on the group
        g._state.setdefault("closed", f"a collective timed out ({why.strip().splitlines()[0]})")
    others = [r for r in range(g.world_size) if r != g.rank]
    ping = torch.zeros(1, dtype=torch.uint8)
    got = {r: torch.empty(1, dtype=torch.uint8) for r in others}
    io = waits.Round(oper)

    def recv(r: int) -> Any:
        return g._dist.irecv(got[r], r, group=g._probe, tag=PROBE_TAG + g._probe_tag)

    def send(r: int) -> Any:
        return g._dist.isend(ping, r, group=g._probe, tag=PROBE_TAG + g._probe_tag)
    works = [(r, io.start(r, lambda r=r: recv(r))) for r in others]  # type: ignore[misc]
    works += [(r, io.start(r, lambda r=r: send(r))) for r in others]  # type: ignore[misc]
    for r, w in works:
        io.wait(w, r)
    if not io.end():  # every rank answered: the collective failed for another reason
        first = why.strip().splitlines()[0] if why.strip() else "no reason given"
        at = f"{where}: " if where else ""
        return RankWaitError(f"{at}a collective of every rank failed ({first}) although every rank answers; see "
                             "the log", stage=where)
    return oper.error(where, g._state.get("closed"))
