"""Where the store's torch.distributed groups come from: made once while the process has a store open,
reused by the stores it opens meanwhile, destroyed when the last one closes.

A store takes every group it needs while it opens (:meth:`Pool.opening`: the store's own; its commit and
copy workers' and the peer tier's only where the ranks have no streams of tierfs's, else those carry their
collectives over the streams, see :mod:`tierfs.ranks.tree`) and gives them back when it closes
(:meth:`Lease.give_back`). A store
opened while another is still open takes the groups given back instead of making new ones; groups still
held by a store that is open are never handed to another (two threads never share one). When the last
store of the process closes, the groups given back are destroyed: their threads and sockets go. Groups are interchangeable when
they have the same backend, timeout and CPU priority of their threads (:data:`Key`): a group's timeout is
its backend's, and its threads keep the priority they were started with.

Taking is collective, like making a group: every rank takes the same groups in the same order, or the
ranks would wait on different groups. The ranks' pools can differ after a failure: a group that saw a
wait fail on a rank (its connections closed by gloo after a timeout, a peer gone, an operation cut
short) is destroyed when given back on that rank, not reused, while a rank that saw nothing keeps it.
So before a store takes groups given back earlier, the ranks vote through the job's key-value store
(torch.distributed's TCPStore, a few requests per rank): when every rank has the same groups to give,
each takes them; else every rank destroys what it has and the store makes new ones.

Given-back groups stay in the pool while a store of the process is open (and are destroyed at interpreter
exit, or by :func:`release`); a group torch.distributed destroyed itself (``destroy_process_group()`` of
the whole job) is only forgotten. Destroying a group ends its backend's threads there and then (the
stores using it forget it too), while the interpreter is whole, never during its teardown.

After a failure of the job's ranks (:mod:`tierfs.ranks.diagnosis`) every group of the process in use is
closed (:mod:`tierfs.ranks.severing`), and no group is destroyed any more: each is kept as it is until the
process ends. gloo's destructor of a group joins the group's I/O loop, which a connection to a dead peer
can keep busy for good (the process would hang at exit, or the teardown abort), and a group without
usable connections costs nothing but its idle threads. An idle group costs its
backend's threads (gloo: two workers and an I/O loop that wakes every 10 ms, 1-2.5 ms of CPU a second on
a 2-core machine, the more the busier its cores) and one listening socket; its connections are made when first used (``TORCH_GLOO_LAZY_INIT``), so it
holds only those to the ranks it talked to.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import datetime
import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Iterator

from ..errors import RankWaitError
from .diagnosis import job_store, known, raise_known

log = logging.getLogger("tierfs")

#: what makes two groups interchangeable: backend, timeout (seconds), nice of their threads
Key = tuple[str, float, int]


@dataclass
class _Held:
    """A group of the pool: its number (the same on every rank), what it is, and the failures seen on it
    while a store held it (the state of the :class:`~tierfs.ranks.groups.TorchGroup` using it)."""

    pg: Any
    serial: int
    key: Key
    state: dict[str, str] = field(default_factory=dict)
    #: the lanes of the groups using it (a group destroyed leaves them)
    users: list[list[Any]] = field(default_factory=list)


def make(dist: Any, backend: str, timeout: float, nice: int = 0) -> Any:
    """A new group of every rank (collective), its connections made when first used (gloo's lazy
    initialisation): a collective over it connects each rank to its two neighbours of a ring, a transfer
    the two ranks that exchange, so the sockets a rank holds do not grow with the job. With ``nice``, the
    threads the backend starts for it run at that CPU priority."""
    before = _tasks() if nice else set()
    lazy = os.environ.get("TORCH_GLOO_LAZY_INIT")
    os.environ["TORCH_GLOO_LAZY_INIT"] = "1"
    try:
        pg = dist.new_group(backend=backend, timeout=datetime.timedelta(seconds=timeout))
    finally:
        if lazy is None:
            os.environ.pop("TORCH_GLOO_LAZY_INIT", None)
        else:
            os.environ["TORCH_GLOO_LAZY_INIT"] = lazy
    for tid in (_tasks() - before) if nice else ():
        try:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
        except OSError:
            pass
    return pg


def _tasks() -> set[int]:
    try:
        return {int(t) for t in os.listdir("/proc/self/task")}
    except OSError:  # not Linux: priorities stay as they are
        return set()


def _alive(dist: Any, pg: Any) -> bool:
    """Whether torch.distributed still knows ``pg`` (it forgets every group when the job's is destroyed)."""
    try:
        return dist.is_initialized() and pg in dist.distributed_c10d._world.pg_map
    except Exception:  # noqa: BLE001 - a torch without these: not ours to keep
        return False


#: groups kept until the process ends (see the module docstring)
_kept: list[Any] = []


def _destroy(dist: Any, held: _Held) -> None:
    """Destroy ``held``'s group (its backend's threads end now: nothing of tierfs refers to it after), or,
    once the job's ranks failed (or it was closed after a failure), keep it for good."""
    pg, held.pg = held.pg, None
    for lanes in held.users:
        lanes[:] = [p for p in lanes if p is not pg]
    held.users = []
    if "severed" in held.state or known(dist) is not None:
        _keep(pg)
        return
    if _alive(dist, pg):
        try:
            dist.destroy_process_group(pg)
        except Exception as e:  # noqa: BLE001 - dropped either way
            log.debug("destroying a process group failed (%s)", e)


def _keep(pg: Any) -> None:
    """Keep ``pg`` until the process ends: never destroyed, even by the interpreter's teardown (its
    destructor would join the group's I/O loop, which a dead peer can keep busy for good)."""
    _kept.append(pg)
    try:
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(pg))  # no teardown drops the last reference
    except Exception:  # noqa: BLE001 - not CPython: the list keeps it until the interpreter's teardown
        pass


class Lease:
    """The groups one store took while it opened, given back when it closes."""

    def __init__(self, pool: "Pool", reuse: bool) -> None:
        self._pool = pool
        self._reuse = reuse  # every rank has the same groups to give (see Pool.opening)
        self.held: list[_Held] = []
        #: groups this lease made (the rest it took from the pool)
        self.made = 0
        self._given = False

    def take(self, dist: Any, backend: str, timeout: float, nice: int, state: dict[str, str],
             lanes: list[Any]) -> Any:
        """A group of ``(backend, timeout, nice)``, given back earlier or new (collective); ``state`` is
        where its user notes failures (a failed one is not reused), ``lanes`` the user's list of groups
        (the group leaves it when destroyed)."""
        key: Key = (backend, float(timeout), int(nice))
        held = self._pool._take(key) if self._reuse else None
        if held is None:
            held = _Held(make(dist, backend, timeout, nice), self._pool._serial(), key)
            self.made += 1
        held.state = state
        held.users.append(lanes)
        self.held.append(held)
        return held.pg

    def give_back(self, usable: bool = True) -> None:
        """Give the groups back for the next store; with ``usable=False`` (threads may still use them) the
        pool forgets them. A group a failure was seen on is destroyed instead."""
        if self._given:
            return
        held, self.held, self._given = self.held, [], True
        self._pool._give_back(held, usable)


class Pool:
    """The groups of this process (one pool: :data:`POOL`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: list[_Held] = []  # given back, oldest first
        self._made = 0  # groups made through the pool: the next one's number, the same on every rank
        self._openings = 0
        self._open = 0  # leases not given back yet: the stores of this process that are open
        self._exiting = False
        self._local = threading.local()
        #: a number every rank of this launch shares (the first pooled group's, see ``named``)
        self.job: int | None = None

    # -- opening a store ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def opening(self, timeout: float) -> Iterator[Lease | None]:
        """While a store opens on this thread: the groups made on it come from the lease yielded
        (collective: a vote, when groups were given back before). None, and nothing pooled, without
        torch.distributed of several processes."""
        dist = _dist()
        if dist is None:
            yield None
            return
        raise_known(dist, dist.get_rank(), "open the store")  # a rank failed: new groups would wait for it
        lease = Lease(self, self._agree(dist, timeout))
        with self._lock:
            self._open += 1
        before = getattr(self._local, "lease", None)
        self._local.lease = lease
        try:
            yield lease
        finally:
            self._local.lease = before

    def take(self, dist: Any, backend: str, timeout: float, nice: int, state: dict[str, str],
             lanes: list[Any]) -> Any:
        """A group for a :class:`~tierfs.ranks.groups.TorchGroup` (collective): from the lease of the store
        opening on this thread, else a new one that is never pooled (see :meth:`Lease.take`)."""
        raise_known(dist, dist.get_rank())  # a rank failed: a new group would wait for it
        lease = getattr(self._local, "lease", None)
        if lease is None:
            return make(dist, backend, timeout, nice)
        return lease.take(dist, backend, timeout, nice, state, lanes)

    def named(self, job: int) -> None:
        """Note the number a pooled group's ranks agreed on (the first one names the votes' keys)."""
        if self.job is None and getattr(self._local, "lease", None) is not None:
            self.job = job

    def _agree(self, dist: Any, timeout: float) -> bool:
        """Whether the store opening now takes given-back groups: the vote (see the module docstring)."""
        with self._lock:
            self._openings += 1
            self._free = [h for h in self._free if _alive(dist, h.pg)]
            offer = "v:" + ",".join(f"{h.serial}:{h.key[0]}:{h.key[1]!r}:{h.key[2]}" for h in self._free)
            number, job = self._openings, self.job
            if job is None:  # no pooled group was ever made: nothing to give on any rank
                self._clear(dist)
                return False
        agreed = _vote(dist, f"tierfs/pool/{job}/{number}", offer, timeout)
        if not agreed:
            log.info("the ranks' pools of groups differ (after a failure): making new ones")
            with self._lock:
                self._clear(dist)
        return agreed

    def _take(self, key: Key) -> _Held | None:
        with self._lock:
            for i, h in enumerate(self._free):
                if h.key == key:
                    return self._free.pop(i)
        return None

    def _serial(self) -> int:
        with self._lock:
            self._made += 1
            return self._made

    def _give_back(self, held: list[_Held], usable: bool) -> None:
        dist = _dist(any_size=True)
        with self._lock:
            self._open = max(0, self._open - 1)
            for h in held:
                if not usable:
                    continue  # still in use: neither reused nor destroyed
                if dist is None or not _alive(dist, h.pg):
                    continue  # torch.distributed destroyed it
                if h.state or self._exiting or known(dist) is not None:
                    _destroy(dist, h)
                else:
                    self._free.append(h)
            self._free.sort(key=lambda h: h.serial)
            if self._open == 0 and dist is not None:  # the last store closed: its groups go
                self._clear(dist)

    def _clear(self, dist: Any) -> None:
        """Destroy (or keep for good, see :func:`_destroy`) every group given back (under the lock)."""
        for h in self._free:
            _destroy(dist, h)
        self._free = []

    def release(self) -> None:
        """Destroy the groups no store holds (their threads and sockets go)."""
        dist = _dist(any_size=True)
        with self._lock:
            if dist is not None:
                self._clear(dist)
            self._free = []

    def free(self) -> int:
        """How many groups wait for the next store."""
        with self._lock:
            return len(self._free)

    def _at_exit(self) -> None:
        self._exiting = True  # stores closed at exit after this destroy theirs
        self.release()


def _dist(any_size: bool = False) -> Any:
    """torch.distributed when it is initialised with several processes (with ``any_size``: at all)."""
    import sys

    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized() and \
                (any_size or dist.get_world_size() > 1):
            return dist
    except Exception:  # noqa: BLE001 - torch.distributed being torn down
        pass
    return None


def _vote(dist: Any, key: str, offer: str, timeout: float) -> bool:
    """Whether every rank's ``offer`` is the same, through the job's key-value store (collective): each
    rank compares its offer with the first one written, counts itself in, and waits for the last rank in
    to say so. A few requests per rank, whatever the job's size."""
    store = job_store(dist)
    if store is None:  # no store: never reuse (the same on every rank)
        return False
    world = dist.get_world_size()
    try:
        if store.compare_set(f"{key}/offer", "", offer) != offer.encode():
            store.add(f"{key}/differ", 1)
        if store.add(f"{key}/in", 1) == world:
            store.set(f"{key}/done", b"1")
        store.wait([f"{key}/done"], datetime.timedelta(seconds=timeout))
        return store.add(f"{key}/differ", 0) == 0
    except Exception as e:  # noqa: BLE001 - the store raises RuntimeErrors of its own
        raise RankWaitError(f"open the store: not every rank came to take its groups within {timeout:g} s "
                            f"({str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}); "
                            "check the other ranks' logs", stage="open") from None


#: this process's pool
POOL = Pool()
atexit.register(POOL._at_exit)


def release() -> None:
    """Destroy the groups no store of this process holds now (a later store makes new ones)."""
    POOL.release()
