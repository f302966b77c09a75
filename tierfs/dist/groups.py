"""The ranks of the job and the few collectives the store needs, every wait bounded.

Without torch.distributed (or with one process) everything is local. Under torchrun the store uses gloo
groups of its own, so it never queues behind the training job's NCCL work; each of the store's threads
gets its own group (``fork``), so collectives from different threads never interleave. Only JSON crosses.

Every collective and point-to-point wait is bounded by the group's ``timeout``: a rank that does not
arrive in time, or whose process is gone, makes the waiting rank raise
:class:`~tierfs.errors.RankWaitError` naming the stage it was in (:mod:`tierfs._stages`) and, where the
job's store tells, the ranks it waited for (each rank notes its arrival at every collective in the c10d
store the job was started with).

A node is a failure domain: the ranks on one machine. Its number comes from ``TIERFS_NODE_RANK``, else
torchrun's ``GROUP_RANK``, else ``rank // LOCAL_WORLD_SIZE``, else 0; tests run each process as its own
node by setting ``TIERFS_NODE_RANK`` to the rank. Which ranks share a RAM directory is observed when a
store opens (:mod:`tierfs.dist.nodes`), not assumed from the node number.

Bulk bytes (the peer tier's replicas) move point to point with ``exchange``: numpy buffers wrapped as
tensors without a copy, every receive posted before any send so a ring of ranks cannot deadlock.
"""

from __future__ import annotations

import datetime
import itertools
import json
import os
import threading
import warnings
from typing import Any, Callable, Sequence, Union

import numpy as np

from .. import _stages
from ..errors import ArgumentError, RankWaitError

#: seconds a rank waits for the others in any of tierfs's collectives, unless the store says otherwise
DEFAULT_TIMEOUT = 600.0


#: bytes of JSON per rank that ``all_gather`` moves in its first (usually only) collective
GATHER_WIDTH = 1024 - 8


def framed(data: bytes, width: int) -> np.ndarray:
    """``width`` bytes: ``len(data)`` as an int64, then as much of ``data`` as fits (read the length with
    ``buf[:8].view(np.int64)[0]``)."""
    out = np.zeros(width, dtype=np.uint8)
    out[:8].view(np.int64)[0] = len(data)
    part = np.frombuffer(data, dtype=np.uint8)[:width - 8]
    out[8:8 + part.size] = part
    return out


class SingleProcess:
    """A job of one process."""

    rank = 0
    world_size = 1
    local_rank = 0
    node_rank = 0
    nodes = (0,)
    node_ranks = (0,)

    #: the torch.distributed process group of tierfs's collectives (None: no torch.distributed)
    process_group: Any = None
    timeout = DEFAULT_TIMEOUT

    def all_gather(self, obj: Any) -> list[Any]:
        return [obj]

    def barrier(self) -> None:
        pass

    def fork(self, backend: str | None = None, nice: int = 0, lanes: int = 1,
             timeout: float | datetime.timedelta | None = None) -> "SingleProcess":
        return self

    def with_timeout(self, timeout: float | datetime.timedelta | None) -> "SingleProcess":
        return self


class TorchGroup:
    """The ranks of an initialised torch.distributed job, over a gloo group created for tierfs.

    Creating one is collective: every rank must do it, in the same order. ``timeout`` (seconds) bounds
    every wait on the group.
    """

    _ids = itertools.count()  # groups are made in the same order on every rank: the same id everywhere

    def __init__(self, backend: str = "gloo", node_rank: int | None = None,
                 timeout: float | datetime.timedelta | None = None) -> None:
        import torch.distributed as dist

        self._dist, self._backend = dist, backend
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.timeout = seconds(timeout)
        self._pg = dist.new_group(backend=backend, timeout=datetime.timedelta(seconds=self.timeout))
        self._lanes = [self._pg]
        self._arrivals = _Arrivals(dist, next(TorchGroup._ids), self.rank, self.world_size)
        if node_rank is None:
            node_rank = env_node_rank(self.rank)
        self.node_rank = int(node_rank)
        #: node number of every rank
        self.nodes: tuple[int, ...] = tuple(int(n) for n in self.all_gather(self.node_rank))
        self.node_ranks = tuple(r for r, n in enumerate(self.nodes) if n == self.node_rank)
        self.local_rank = self.node_ranks.index(self.rank)

    def fork(self, backend: str | None = None, nice: int = 0, lanes: int = 1,
             timeout: float | datetime.timedelta | None = None) -> "TorchGroup":
        """The same ranks over a new group, for use by another thread (collective); ``timeout`` (default:
        this group's) bounds its waits.

        With ``nice``, the threads the backend starts for the group (gloo: its I/O threads, which do the
        kernel copies of every transfer) run at that lower CPU priority, like tierfs's background workers,
        so bulk transfers give way to training. With ``lanes`` > 1 the twin is that many groups and
        ``exchange`` deals the buffers between two ranks out over them in turn: gloo moves a group's bytes
        on one connection per pair of ranks and one I/O thread, so on one lane a rank's sends and receives
        take turns.
        """
        twin = object.__new__(TorchGroup)
        twin.__dict__.update(self.__dict__)
        twin._backend = backend or self._backend
        twin.timeout = self.timeout if timeout is None else seconds(timeout)
        twin._arrivals = _Arrivals(self._dist, next(TorchGroup._ids), self.rank, self.world_size)
        before = _tasks() if nice else set()
        limit = datetime.timedelta(seconds=twin.timeout)
        twin._lanes = [self._dist.new_group(backend=twin._backend, timeout=limit) for _ in range(max(1, int(lanes)))]
        twin._pg = twin._lanes[0]
        for tid in (_tasks() - before) if nice else ():
            try:
                os.setpriority(os.PRIO_PROCESS, tid, nice)
            except OSError:
                pass
        return twin

    def with_timeout(self, timeout: float | datetime.timedelta | None) -> "TorchGroup":
        """The same group (the same connections, no collective) whose waits last at most ``timeout``."""
        twin = object.__new__(TorchGroup)
        twin.__dict__.update(self.__dict__)
        twin.timeout = seconds(timeout)
        return twin

    def exchange(self, sends: Sequence[tuple[int, np.ndarray]], recvs: Sequence[tuple[int, np.ndarray]],
                 pace: Callable[[int], None] | None = None,
                 on_received: Callable[[int], None] | None = None, tag: int = 0) -> None:
        """Send and receive contiguous uint8 buffers point to point: ``sends`` are ``(to rank, buffer)``,
        ``recvs`` ``(from rank, buffer)``; buffers between two ranks pair up in order, and the sizes must
        match on both sides. ``pace(nbytes)`` is called before each send (a throttle). ``on_received(i)``
        is called on a thread of its own as soon as ``recvs[i]`` has landed, in order, while this thread
        goes on sending and later buffers still move.

        Every send is posted and every transfer waited for even when a receive, ``on_received`` or
        ``pace`` fails, so the other ranks are never left waiting for bytes; the first failure is raised
        after. A peer that does not send or receive within the group's timeout is a RankWaitError.
        """
        import torch

        def lane(peer: int, counts: dict[int, int]) -> Any:  # the k-th buffer of a pair: lane k % lanes
            k = counts[peer] = counts.get(peer, -1) + 1
            return self._lanes[k % len(self._lanes)]

        failures: list[BaseException] = []
        where = _stages.current()  # the receiving thread reports the caller's stage

        def receive() -> None:
            for i, w in enumerate(works):
                try:
                    self._wait(w, [recvs[i][0]], where)
                    if on_received is not None and not failures:
                        on_received(i)
                except BaseException as e:  # noqa: BLE001 - raised by the caller once all is done
                    failures.append(e)

        with warnings.catch_warnings():  # read-only mappings are only ever sent, never written
            warnings.simplefilter("ignore", UserWarning)
            got: dict[int, int] = {}
            works = [self._dist.irecv(torch.from_numpy(buf), src, group=lane(src, got), tag=tag)
                     for src, buf in recvs]
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
                    sent.append((dst, self._dist.isend(torch.from_numpy(buf), dst, group=lane(dst, put), tag=tag)))
            finally:
                if receiver is not None:
                    receiver.join()
                else:
                    receive()
                for dst, w in sent:
                    try:
                        self._wait(w, [dst], where)
                    except BaseException as e:  # noqa: BLE001
                        failures.append(e)
        if failures:
            raise failures[0]

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (JSON), in rank order. One collective when every rank's JSON fits in
        ``GATHER_WIDTH`` bytes (the store's agreements usually do); else a second one, of the longest, follows."""
        import torch

        data = json.dumps(obj).encode()
        first = framed(data, 8 + GATHER_WIDTH)
        outs = [torch.empty(first.size, dtype=torch.uint8) for _ in range(self.world_size)]
        self._collective(lambda: self._dist.all_gather(outs, torch.from_numpy(first), group=self._pg,
                                                       async_op=True))
        sizes = [int(o.numpy()[:8].view(np.int64)[0]) for o in outs]
        if max(sizes) <= GATHER_WIDTH:
            return [json.loads(bytes(o.numpy()[8:8 + n])) for o, n in zip(outs, sizes)]
        full = np.zeros(max(sizes), dtype=np.uint8)  # every rank saw the same sizes: all take this round
        full[:len(data)] = np.frombuffer(data, dtype=np.uint8)
        outs = [torch.empty(full.size, dtype=torch.uint8) for _ in range(self.world_size)]
        self._collective(lambda: self._dist.all_gather(outs, torch.from_numpy(full), group=self._pg,
                                                       async_op=True))
        return [json.loads(bytes(o.numpy()[:n])) for o, n in zip(outs, sizes)]

    def barrier(self) -> None:
        self._collective(lambda: self._dist.barrier(group=self._pg, async_op=True))

    def _collective(self, start: Callable[[], Any]) -> None:
        """Run a collective of every rank, waiting at most the group's timeout."""
        seq = self._arrivals.arrive()
        self._wait(start(), None, _stages.current(), seq)

    def _wait(self, work: Any, peers: Sequence[int] | None, where: str | None, seq: int | None = None) -> None:
        """Wait for an operation (torch returns None for one that completed at once) at most the group's
        timeout; a timeout, or a peer gone, is a RankWaitError naming the stage and the ranks waited for
        (``peers``; for a collective, the ranks that did not arrive, where the job's store tells)."""
        if work is None:
            return
        try:
            work.wait(timeout=datetime.timedelta(seconds=self.timeout))
        except RuntimeError as e:
            ranks = list(peers) if peers is not None else self._arrivals.missing(seq)
            raise RankWaitError.waiting(where, ranks, self.timeout, str(e)) from None

    @property
    def process_group(self) -> Any:
        """The torch.distributed process group of tierfs's collectives (e.g. for ``dcp.save``)."""
        return self._pg


class _Arrivals:
    """Each rank notes, in the job's c10d store, the last collective of a group it reached; a rank that
    timed out reads which ranks are behind. Best effort: without a store nothing is noted."""

    def __init__(self, dist: Any, group_id: int, rank: int, world: int) -> None:
        self.rank, self.world, self.seq = rank, world, 0
        self.prefix = f"tierfs/arrivals/{group_id}/"
        try:
            from torch.distributed.distributed_c10d import _get_default_store

            self.store: Any = _get_default_store()
        except Exception:  # noqa: BLE001 - initialised without a store, or another torch: no names
            self.store = None

    def arrive(self) -> int:
        self.seq += 1
        if self.store is not None:
            try:
                self.store.set(f"{self.prefix}{self.rank}", str(self.seq))
            except Exception:  # noqa: BLE001 - only the names in an error message depend on it
                self.store = None
        return self.seq

    def missing(self, seq: int | None) -> list[int] | None:
        """The ranks that have not reached collective ``seq`` (None: unknown)."""
        if self.store is None or seq is None:
            return None
        try:
            keys = [f"{self.prefix}{r}" for r in range(self.world)]
            seen = [int(self.store.get(k)) if self.store.check([k]) else 0 for k in keys]
            return [r for r, v in enumerate(seen) if v < seq]
        except Exception:  # noqa: BLE001 - the store went with the job
            return None


def seconds(timeout: float | datetime.timedelta | None) -> float:
    """A timeout in seconds from seconds or a timedelta (None: the default, 600 s)."""
    if timeout is None:
        return DEFAULT_TIMEOUT
    value = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else timeout
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ArgumentError(f"timeout must be a positive number of seconds or a timedelta, got {timeout!r}")
    return float(value)


def _tasks() -> set[int]:
    try:
        return {int(t) for t in os.listdir("/proc/self/task")}
    except OSError:  # not Linux: priorities stay as they are
        return set()


def env_node_rank(rank: int) -> int:
    """This process's node number from the environment (see the module docstring)."""
    var = env_node_source()
    if var in ("TIERFS_NODE_RANK", "GROUP_RANK"):
        return int(os.environ[var])
    local = os.environ.get("LOCAL_WORLD_SIZE", "").strip()
    return rank // int(local) if local else 0


def env_node_source() -> str:
    """Where :func:`env_node_rank` takes the node number from: the variable's name, or ``"default"``."""
    for var in ("TIERFS_NODE_RANK", "GROUP_RANK", "LOCAL_WORLD_SIZE"):
        if os.environ.get(var, "").strip():
            return var
    return "default"


Group = Union[SingleProcess, "TorchGroup"]


def default_group(timeout: float | datetime.timedelta | None = None) -> SingleProcess | TorchGroup:
    """The job's ranks: torch.distributed's when it is initialised with several processes, else this one
    process."""
    import sys

    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return TorchGroup(timeout=timeout)
    return SingleProcess()
