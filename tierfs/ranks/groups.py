"""The ranks of the job and the few collectives the store needs, every wait bounded.

Without torch.distributed (or with one process) everything is local. Under torchrun the store uses gloo
groups of its own, so it never queues behind the training job's NCCL work; each of the store's threads
gets its own group (``fork``), so collectives from different threads never interleave. Only JSON crosses.
While a store opens, its groups come from the process's pool (:mod:`tierfs.ranks.pool`): made by the
first store, reused by the later ones; a group on which a wait failed is not reused.

The store's own group's collectives are gloo's all-reduce and broadcast (:mod:`tierfs.ranks.collectives`),
over connections made when first used: each rank talks to its ring's neighbours. Where every rank has
streams of tierfs's own (:mod:`tierfs.ranks.streams`), the groups forked from it for the store's threads
hold no gloo group: their collectives go over their streams, up and down a binary tree of the ranks
(:mod:`tierfs.ranks.tree`), on the thread that calls them, so an idle fork costs nothing (a gloo group's I/O
loop wakes every 10 ms) and a collective takes ``2 log2(N)`` hops instead of the ring's ``2 (N - 1)``.
Either way the sockets a rank holds do not grow with the job; bulk transfers are point to point, between
the ranks that exchange. The waits of one operation
share one deadline, the group's ``timeout`` (:mod:`tierfs.ranks.waits`): a rank that does not arrive in
time, or whose process is gone (noticed as soon as its connections drop, or, for a transfer under way with
it, its socket of tierfs, :mod:`tierfs.ranks.liveness`), makes the waiting rank raise
:class:`~tierfs.errors.RankWaitError` naming the stage it was in (:mod:`tierfs.util.stages`) and exactly the
ranks that made it fail (a point-to-point wait names its peer, a collective finds them out through
:mod:`tierfs.ranks.diagnosis`). A rank that sees such a failure closes its connections on every group
(:mod:`tierfs.ranks.severing`), so the ranks blocked on it fail too, at once; from then on every wait of
the process on other ranks raises at once, naming the same ranks: the job must restart. No transfer
outlives the call that started it: each one is waited for, to its end or its failure (a group closed after
a failure ends what gloo still ran on it), so nothing of tierfs's is left in flight when the interpreter
exits.

A node is a failure domain: the ranks on one machine. Its number comes from ``TIERFS_NODE_RANK``, else
torchrun's ``GROUP_RANK``, else ``rank // LOCAL_WORLD_SIZE``, else 0; tests run each process as its own
node by setting ``TIERFS_NODE_RANK`` to the rank. Which ranks share a RAM directory is observed when a
store opens (:mod:`tierfs.ranks.nodes`), not assumed from the node number.

Bulk bytes (the peer tier's replicas, erasure blocks, restores) move point to point with ``exchange``: over
the group's streams (:mod:`tierfs.ranks.streams`), or over gloo as numpy buffers wrapped as tensors without
a copy, every receive posted before any send so a ring of ranks cannot deadlock.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import secrets
from typing import Any, Callable, ContextManager, Iterator, Sequence, Union

import numpy as np

from ..util import stages as _stages
from ..errors import ArgumentError, TierfsError
from . import collectives, diagnosis, liveness, pool, severing, streams, tree, waits
from .collectives import framed
from .nodenumbers import env_node_rank
from .single import DEFAULT_TIMEOUT, SingleProcess
from .waits import Operation

#: bytes of JSON per rank that ``all_gather`` moves in its first (usually only) round
GATHER_WIDTH = 1024 - 8


class TorchGroup:
    """The ranks of an initialised torch.distributed job, over a gloo group created for tierfs.

    Creating one is collective: every rank must do it, in the same order. ``timeout`` (seconds) bounds
    every wait on the group.
    """

    def __init__(self, backend: str = "gloo", node_rank: int | None = None,
                 timeout: float | datetime.timedelta | None = None) -> None:
        import torch.distributed as dist

        self._dist, self._backend = dist, backend
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.timeout = seconds(timeout)
        # "closed": why this rank's connections on the group were closed; "failed": a wait on it failed
        self._state: dict[str, str] = {}
        self._lanes: list[Any] = []  # the groups (one, or a fork's lanes); empty once destroyed
        self._gone: Callable[[int], bool] | None = None  # set once the group is named
        self._tree = False  # its collectives go over its streams (a fork's, where the ranks have streams)
        self._link: streams.Link | None = None  # its streams, once named
        self._lanes.append(pool.POOL.take(dist, backend, self.timeout, 0, self._state, self._lanes))
        self._named()
        if node_rank is None:
            node_rank = env_node_rank(self.rank)
        self.node_rank = int(node_rank)
        #: node number of every rank
        self.nodes: tuple[int, ...] = self._node_numbers()
        self.node_ranks = tuple(r for r, n in enumerate(self.nodes) if n == self.node_rank)
        self.local_rank = self.node_ranks.index(self.rank)

    def _node_numbers(self) -> tuple[int, ...]:
        """Every rank's node number (collective). Where the ranks are laid out as torchrun lays them out (node
        ``n`` runs ranks ``n*L`` to ``n*L + L - 1``, ``L`` being ``LOCAL_WORLD_SIZE``, or 1 where it is not
        set), one all-reduce of three numbers confirms it and each rank works them out; else they are
        gathered (8 bytes per rank)."""
        per = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "").strip() or 1))
        lo, neg_hi, ok = self.all_reduce([per, -per, int(self.node_rank == self.rank // per)], "min")
        if lo == -neg_hi and ok:
            return tuple(r // per for r in range(self.world_size))
        return tuple(row[0] for row in self.all_gather_ints([self.node_rank]))

    def fork(self, backend: str | None = None, nice: int = 0, lanes: int = 1,
             timeout: float | datetime.timedelta | None = None) -> "TorchGroup":
        """The same ranks over a new group, for use by another thread (collective); ``timeout`` (default:
        this group's) bounds its waits. Where the ranks have streams, the new group's collectives and
        transfers all go over streams of its own (:mod:`tierfs.ranks.tree`), and it holds no torch.distributed
        group; else it is a gloo group (while a store opens, one given back by an earlier store, see
        :mod:`tierfs.ranks.pool`), and the rest of this applies.

        With ``nice``, the threads the backend starts for the group (gloo: its I/O threads, which do the
        kernel copies of every transfer) run at that CPU priority, like tierfs's background workers
        (:data:`tierfs.util.worker.BACKGROUND_NICE`). With ``lanes`` > 1, where the group's bulk bytes go
        over gloo (the ranks have no streams), the twin is that many groups and ``exchange`` deals the
        buffers between two ranks out over them in turn: gloo moves a group's bytes on one connection per
        pair of ranks and one I/O thread, so on one lane a rank's sends and receives take turns. Over the
        streams more lanes would carry nothing, and each gloo group costs its idle I/O loop (it wakes every
        10 ms: 1-2.5 ms of CPU a second here), so the twin is then one group.
        """
        twin = object.__new__(TorchGroup)
        twin.__dict__.update(self.__dict__)
        twin._backend = backend or self._backend
        twin.timeout = self.timeout if timeout is None else seconds(timeout)
        twin._state = {}
        twin._lanes = []
        if self._link is not None:  # every rank has streams: the twin's collectives go over a tree of its own
            twin._over_streams(self)
            return twin
        twin._lanes.append(pool.POOL.take(self._dist, twin._backend, twin.timeout, nice, twin._state, twin._lanes))
        twin._named()  # whether the ranks have streams: every rank sees the same
        for _ in range(max(1, int(lanes)) - 1 if twin._link is None else 0):
            twin._lanes.append(pool.POOL.take(self._dist, twin._backend, twin.timeout, nice, twin._state, twin._lanes))
        return twin

    def _over_streams(self, parent: "TorchGroup") -> None:
        """Make this fork a group without a torch.distributed group of its own (collective, on ``parent``):
        its collectives go over its streams (:mod:`tierfs.ranks.tree`), under a number the ranks draw on
        ``parent``."""
        assert parent._link is not None
        self._tree, self._calls = True, [0]
        self._job = parent.all_reduce([secrets.randbits(62) if self.rank == 0 else 0], "max")[0]
        self._link = streams.Link(self._job, self.rank, parent._link.store, parent._link.launch, self._gone)
        severing.watch(self)  # closed after a failure of the job's ranks (its streams, with every other)

    def _named(self) -> None:
        """Number the group's collectives from here on, under a name of the group's own that every rank
        shares (collective): a failed collective's diagnosis is kept in the job's store under both."""
        self._calls = [0]
        self._job = 0
        store = diagnosis.job_store(self._dist)
        with self._failing():  # rank 0's random number, by an all-reduce: the ring's neighbours connect; and
            # whether any rank cannot offer streams (then the group's bulk transfers all go over gloo)
            self._job, off = collectives.all_reduce(self, [secrets.randbits(62) if self.rank == 0 else 0,
                                                           int(store is None or not streams.enabled())], "max")
        pool.POOL.named(self._job)
        diagnosis.launched(self._dist, self._job)
        launch = diagnosis.launch(self._dist)
        if launch is not None:
            liveness.publish(self._dist, self.rank, launch, store)
        #: ``gone(peer)``: whether a peer's process ended (long waits on it are watched)
        self._gone = liveness.watcher(launch, store)
        #: the group's streams for bulk bytes (:mod:`tierfs.ranks.streams`); None: they go over gloo
        self._link = None if off or launch is None else streams.Link(self._job, self.rank, store, launch, self._gone)
        severing.watch(self)  # closed after a failure of the job's ranks

    @property
    def _pg(self) -> Any:
        """The group of the collectives (the first lane)."""
        if self._tree:
            raise TierfsError("this group's collectives go over tierfs's streams: it has no torch.distributed group")
        if not self._lanes:
            raise TierfsError("the store using these ranks' groups is closed")
        return self._lanes[0]

    @contextlib.contextmanager
    def _failing(self) -> Iterator[None]:
        """Note on the group any failure of the block (a wait on it that failed or was cut short): its
        ranks may no longer be in step on it, so it is not reused (:mod:`tierfs.ranks.pool`)."""
        try:
            yield
        except BaseException as e:
            self._state.setdefault("failed", f"{type(e).__name__}: {e}")
            raise

    def with_timeout(self, timeout: float | datetime.timedelta | None) -> "TorchGroup":
        """The same group (the same connections, no collective) whose waits last at most ``timeout``."""
        twin = object.__new__(TorchGroup)
        twin.__dict__.update(self.__dict__)
        twin.timeout = seconds(timeout)
        return twin

    def bounded(self) -> ContextManager[Operation]:
        """Run a block as one operation: its waits on this thread share one deadline, this group's timeout
        from now (see :mod:`tierfs.ranks.waits`)."""
        return waits.bounded(self.timeout)

    def exchange(self, sends: Sequence[tuple[int, np.ndarray]], recvs: Sequence[tuple[int, np.ndarray]],
                 pace: Callable[[int], None] | None = None,
                 on_received: Callable[[int], None] | None = None, tag: int = 0, *,
                 tolerate: bool = False, bulk: bool = False) -> dict[int, str]:
        """Send and receive contiguous uint8 buffers point to point: ``sends`` are ``(to rank, buffer)``,
        ``recvs`` ``(from rank, buffer)``; buffers between two ranks pair up in order, and the sizes must
        match on both sides. ``pace(nbytes)`` is called before each send (a throttle). ``on_received(i)`` is
        called on a thread of its own as soon as ``recvs[i]`` has landed, in order, while this thread goes
        on sending and later buffers still move. With either, or ``bulk``, the exchange is a bulk transfer: its
        deadline moves on with every buffer that moves (it fails when nothing moved for the timeout), and its
        bytes go over the group's streams (:mod:`tierfs.ranks.streams`; ``on_received`` is then called in order
        for each peer, one call at a time) where the ranks have them, else over gloo.

        Every send is posted and every transfer waited for even when a receive, ``on_received`` or
        ``pace`` fails, so the other ranks are never left waiting for bytes; the first failure of
        ``on_received`` or ``pace`` is raised after. The waits are one operation's (the caller's, or their
        own): a peer that does not send or receive in time, or whose connection drops, is a RankWaitError
        naming it, raised once every transfer ended; with ``tolerate`` the failed peers are returned
        instead, ``{rank: why}`` (the caller goes on with the others).
        """
        failures: list[BaseException] = []  # this rank's own (on_received, pace)
        where = _stages.current()  # the receiving thread reports the caller's stage
        diagnosis.raise_known(self._dist, self.rank, where)  # a rank failed before: at once
        with self._failing(), self.bounded() as op:
            bulk = bulk or pace is not None or on_received is not None  # data: the deadline moves as it lands
            io = waits.Round(op, bulk=bulk, gone=self._gone)
            if self._link is not None and (io.bulk or self._tree):  # over the group's streams
                self._link.run(io, sends, recvs, pace, on_received, failures)
            else:
                collectives.posted(self, io, sends, recvs, pace, on_received, failures, tag)
            failed = self._ended(op, io, where, tolerate)
        if failures:
            raise failures[0]
        return failed

    def _ended(self, op: Operation, io: waits.Round, where: str | None, tolerate: bool) -> dict[int, str]:
        """The failures of an exchange's ``io``: a rank gone or stuck closes this rank's connections, so the
        ranks blocked on it fail too, and every rank finds out which failed; raised (naming the peers this
        rank waited on) unless ``tolerate``."""
        failed = io.end()
        if failed:  # a pair of ranks may no longer be in step on the group
            self._state.setdefault("failed", f"transfers with ranks {sorted(failed)} failed")
        kinds = {waits.kind_of(why) for why in failed.values()}
        if waits.LATE in kinds:  # gloo closed the group's connections: later waits fail at once
            self._state.setdefault("closed", str(op.error(where)))
        lost = next((k for k in (waits.LATE, waits.GONE, waits.CLOSED) if k in kinds), None)
        if lost is not None:  # the ranks blocked on this one fail too, and every rank finds out which
            severing.sever_all(self._dist)  # (this rank's error names its peers)
            diagnosis.find_out(self, op, lost)
        if failed and not tolerate:
            raise op.error(where, self._state.get("closed"))
        return failed

    def _over_tree(self, run: Callable[[waits.Round], Any]) -> Any:
        """Run a collective over the group's streams (:mod:`tierfs.ranks.tree`), ``run(io)``, numbered and
        bounded like gloo's. A failure is one of gloo's collectives': this rank closes its connections (the
        ranks blocked on it fail at once) and raises the error naming the ranks that made it fail, found
        out through the job's store (:func:`~tierfs.ranks.diagnosis.diagnose`)."""
        diagnosis.raise_known(self._dist, self.rank, _stages.current())
        self._calls[0] += 1
        with self._failing(), self.bounded() as op:
            io = waits.Round(op, gone=self._gone)
            try:
                return run(io)
            except streams.Stopped as e:
                failed = io.end()
                self._state.setdefault("failed", f"a collective over the streams failed ({e})")
                severing.sever_all(self._dist)
                raise diagnosis.diagnose(self, op, next(iter(failed.values()), str(e))) from None

    def _gather(self, row: np.ndarray) -> np.ndarray:
        """Every rank's uint8 ``row`` as the rows of an array, in rank order."""
        if self._tree:
            assert self._link is not None
            link = self._link
            return self._over_tree(lambda io: tree.all_gather(link, io, self.rank, self.world_size, row))
        return collectives.all_gather(self, row)

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (JSON), in rank order: one gather of ``GATHER_WIDTH`` bytes per rank when
        every rank's JSON fits (the store's agreements usually do); else a second one, of the longest rest,
        follows (:func:`~tierfs.ranks.collectives.all_gather`). What a rank receives grows with the job:
        only for what every rank needs of every other, or when the ranks' views differ."""
        data = json.dumps(obj).encode()
        with self.bounded(), self._failing():
            rows = self._gather(framed(data, 8 + GATHER_WIDTH))
            sizes = [int(n) for n in rows[:, :8].copy().view(np.int64)[:, 0]]
            rest = None
            if max(sizes) > GATHER_WIDTH:  # every rank saw the same sizes: all take this round
                mine = np.zeros(max(sizes) - GATHER_WIDTH, dtype=np.uint8)
                tail = np.frombuffer(data, dtype=np.uint8)[GATHER_WIDTH:]
                mine[:tail.size] = tail
                rest = self._gather(mine)
        return [json.loads(rows[r, 8:8 + min(n, GATHER_WIDTH)].tobytes()
                           + (rest[r, :n - GATHER_WIDTH].tobytes() if rest is not None and n > GATHER_WIDTH else b""))
                for r, n in enumerate(sizes)]

    def all_gather_ints(self, values: Sequence[int]) -> list[list[int]]:
        """Every rank's ``values`` (int64, the same count on every rank), in rank order: 8 bytes per value
        and rank (:func:`~tierfs.ranks.collectives.all_gather_ints`)."""
        if self._tree:
            row = np.array([int(v) for v in values], dtype=np.int64).view(np.uint8)
            rows = self._gather(row).view(np.int64)
        else:
            with self._failing():
                rows = collectives.all_gather_ints(self, values)
        return [[int(v) for v in row] for row in rows]

    def barrier(self) -> None:
        """Wait until every rank got here (an all-reduce of one number)."""
        self.all_reduce([0])

    def all_reduce(self, values: Sequence[int], op: str = "min") -> list[int]:
        """Every rank's int64 ``values`` reduced element by element (``"min"``, ``"max"`` or ``"sum"``), the
        same few bytes per rank whatever the job's size (:func:`~tierfs.ranks.collectives.all_reduce`)."""
        return self.all_reduce_started(values, op)()

    def all_reduce_started(self, values: Sequence[int], op: str = "min") -> Callable[[], list[int]]:
        """:meth:`all_reduce` started now, its result from calling what it returns (once, on this thread);
        over the streams, it all runs in that call."""
        if self._tree:
            assert self._link is not None
            link, mine = self._link, [int(v) for v in values]
            return lambda: self._over_tree(lambda io: tree.all_reduce(link, io, self.rank, self.world_size,
                                                                       mine, op))
        with self._failing():
            result = collectives.all_reduce_started(self, values, op)

        def finished() -> list[int]:
            with self._failing():
                return result()
        return finished

    def broadcast(self, obj: Any, src: int) -> Any:
        """Rank ``src``'s ``obj`` (JSON) on every rank (:func:`~tierfs.ranks.collectives.broadcast`)."""
        if self._tree:
            assert self._link is not None
            link = self._link
            return self._over_tree(lambda io: tree.broadcast(link, io, self.rank, self.world_size, obj, src))
        with self._failing():
            return collectives.broadcast(self, obj, src)

    @property
    def process_group(self) -> Any:
        """The torch.distributed process group of tierfs's collectives (e.g. for ``dcp.save``)."""
        return self._pg


def seconds(timeout: float | datetime.timedelta | None) -> float:
    """A timeout in seconds from seconds or a timedelta (None: the default, 600 s)."""
    if timeout is None:
        return DEFAULT_TIMEOUT
    value = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else timeout
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ArgumentError(f"timeout must be a positive number of seconds or a timedelta, got {timeout!r}")
    return float(value)


Group = Union[SingleProcess, "TorchGroup"]


def default_group(timeout: float | datetime.timedelta | None = None) -> SingleProcess | TorchGroup:
    """The job's ranks: torch.distributed's when it is initialised with several processes, else this one
    process."""
    import sys

    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return TorchGroup(timeout=timeout)
    return SingleProcess()
