"""Closing this rank's connections on a group once a wait of tierfs on another rank failed, so that every
rank blocked on this one fails at once too, and nothing of the group is left in flight.

gloo (torch.distributed's CPU backend) closes a group's connections on a rank only when a wait of that rank
times out. A rank whose peer died fails only the operation that touched the dead connection: its other
peers, blocked on it in the same collective, wait on (in a ring all-reduce of 3 ranks one of the two
survivors waits on the other, not on the dead one, until its timeout), and a transfer of this rank's that
gloo still runs goes on until the group's timeout. So a rank that saw a failure closes its connections
itself, the way gloo does: it waits a millisecond for a message nobody sends, from a neighbour of the ring
(a collective connected them when the group was made, see :mod:`tierfs.ranks.groups`); gloo ends that wait
by closing every connection of the group on this rank. Each rank waiting on it then sees its connection
drop and fails in turn, in milliseconds around the ring, and gloo's threads of the group are left with
nothing to wait for or to read (a connection left open to a peer whose data has nowhere to land keeps a
group's I/O loop spinning, and the group's destructor, which joins that loop, from ever returning).

That ends the operations that wait for a message or a connection, not one with a message under way: the
rank also closes the socket its peers watch it by (:func:`tierfs.ranks.liveness.give_up`), which ends
those at once (:mod:`tierfs.ranks.waits`).

A group closed so is never used again: its ranks are out of step on it anyway (:mod:`tierfs.ranks.pool`
never reuses nor destroys it).
"""

from __future__ import annotations

import datetime
import threading
import weakref
from typing import TYPE_CHECKING, Any

from . import liveness, streams, waits

if TYPE_CHECKING:
    from .member import Member

#: the tag of the message waited for (none of tierfs's transfers uses it)
TAG = 0x7E5E
#: how long that wait lasts
_WAIT = datetime.timedelta(milliseconds=1)

#: the groups of this process in use: each made by a collective of every rank (its ring's neighbours are
#: connected), and not closed yet
_live: "weakref.WeakSet[Member]" = weakref.WeakSet()
_lock = threading.Lock()


def watch(g: "Member") -> None:
    """Close ``g`` too when a failure of the job's ranks is seen (:func:`sever_all`)."""
    with _lock:
        _live.add(g)


def sever_all(dist: Any) -> None:
    """After a failure of the job's ranks: close this rank's connections on every group of the process that
    is in use, so that every rank blocked on this one fails at once. None of them is used again."""
    liveness.give_up()  # the peers waiting on a transfer with this rank stop too
    streams.sever()  # and those reading or writing a stream of its
    with _lock:
        groups = [g for g in _live if "severed" not in g._state]
        for g in groups:
            g._state["severed"] = "closed after a failure of the job's ranks"
            _live.discard(g)
    for g in groups:
        if g._lanes:  # (a closed store's groups are destroyed, and a group over the streams has no gloo
            # group: streams.sever above closed its streams)
            sever(dist, g._lanes[0], g.rank, g.world_size)


def sever(dist: Any, pg: Any, rank: int, world: int) -> bool:
    """Close this rank's connections on group ``pg`` (of every rank of the job, ``rank`` being this one's).

    Returns
    -------
    bool
        Whether they are closed now: False where no neighbour could be waited on (both are gone: their
        connections dropped already).
    """
    import torch

    for peer in dict.fromkeys([(rank + 1) % world, (rank - 1) % world]):
        if peer == rank:
            continue
        try:
            work = dist.irecv(torch.zeros(1, dtype=torch.uint8), src=peer, group=pg, tag=TAG)
            work.wait(timeout=_WAIT)
        except RuntimeError as e:  # the wait timed out: gloo closed the group's connections on this rank
            if waits.kind_of(str(e)) in (waits.LATE, waits.CLOSED):
                return True
            continue  # that neighbour's connection is gone: the other one
        except Exception:  # noqa: BLE001 - a group torch.distributed destroyed meanwhile: nothing to close
            return False
    return False
