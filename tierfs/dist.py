"""Who else is saving: the ranks of the job, which of them share a node, and the few collectives the store
needs.

Without torch.distributed (or with one process) everything is local. Under torchrun the store uses gloo
groups of its own, so it never queues behind the training job's NCCL work; each of the store's threads
gets its own group (``fork``), so collectives from different threads never interleave. Only JSON crosses.

A node is a set of ranks sharing one RAM directory. Its number comes from ``TIERFS_NODE_RANK``, else
torchrun's ``GROUP_RANK``, else ``rank // LOCAL_WORLD_SIZE``, else 0; tests run each process as its own
node by setting ``TIERFS_NODE_RANK`` to the rank.

Bulk bytes (the peer tier's replicas) move point to point with ``exchange``: numpy buffers wrapped as
tensors without a copy, every receive posted before any send so a ring of ranks cannot deadlock.
"""

from __future__ import annotations

import json
import os
import threading
import warnings
from typing import Any, Callable, Sequence, Union

import numpy as np

from . import errors as _errors


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

    def all_gather(self, obj: Any) -> list[Any]:
        return [obj]

    def barrier(self) -> None:
        pass

    def fork(self, backend: str | None = None, nice: int = 0, lanes: int = 1) -> "SingleProcess":
        return self


class TorchGroup:
    """The ranks of an initialised torch.distributed job, over a gloo group created for tierfs.

    Creating one is collective: every rank must do it, in the same order.
    """

    def __init__(self, backend: str = "gloo", node_rank: int | None = None) -> None:
        import torch.distributed as dist

        self._dist, self._backend = dist, backend
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self._pg = dist.new_group(backend=backend)
        self._lanes = [self._pg]
        if node_rank is None:
            node_rank = env_node_rank(self.rank)
        self.node_rank = int(node_rank)
        #: node number of every rank
        self.nodes: tuple[int, ...] = tuple(int(n) for n in self.all_gather(self.node_rank))
        self.node_ranks = tuple(r for r, n in enumerate(self.nodes) if n == self.node_rank)
        self.local_rank = self.node_ranks.index(self.rank)

    def fork(self, backend: str | None = None, nice: int = 0, lanes: int = 1) -> "TorchGroup":
        """The same ranks over a new group, for use by another thread (collective).

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
        before = _tasks() if nice else set()
        twin._lanes = [self._dist.new_group(backend=twin._backend) for _ in range(max(1, int(lanes)))]
        twin._pg = twin._lanes[0]
        for tid in (_tasks() - before) if nice else ():
            try:
                os.setpriority(os.PRIO_PROCESS, tid, nice)
            except OSError:
                pass
        return twin

    def exchange(self, sends: Sequence[tuple[int, np.ndarray]], recvs: Sequence[tuple[int, np.ndarray]],
                 pace: Callable[[int], None] | None = None,
                 on_received: Callable[[int], None] | None = None, tag: int = 0) -> None:
        """Send and receive contiguous uint8 buffers point to point: ``sends`` are ``(to rank, buffer)``,
        ``recvs`` ``(from rank, buffer)``; buffers between two ranks pair up in order, and the sizes must
        match on both sides. ``pace(nbytes)`` is called before each send (a throttle). ``on_received(i)``
        is called on a thread of its own as soon as ``recvs[i]`` has landed, in order, while this thread
        goes on sending and later buffers still move.

        Every send is posted and every transfer waited for even when a receive or ``on_received`` fails,
        so the other ranks are never left waiting for bytes; the first failure is raised after.
        """
        import torch

        def lane(peer: int, counts: dict[int, int]) -> Any:  # the k-th buffer of a pair: lane k % lanes
            k = counts[peer] = counts.get(peer, -1) + 1
            return self._lanes[k % len(self._lanes)]

        failures: list[BaseException] = []

        def receive() -> None:
            for i, w in enumerate(works):
                try:
                    _wait(w)
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
            sent: list[Any] = []
            put: dict[int, int] = {}
            try:
                for dst, buf in sends:
                    if pace is not None:
                        pace(buf.nbytes)
                    sent.append(self._dist.isend(torch.from_numpy(buf), dst, group=lane(dst, put), tag=tag))
            finally:
                if receiver is not None:
                    receiver.join()
                else:
                    receive()
                for w in sent:
                    try:
                        _wait(w)
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
        self._dist.all_gather(outs, torch.from_numpy(first), group=self._pg)
        sizes = [int(o.numpy()[:8].view(np.int64)[0]) for o in outs]
        if max(sizes) <= GATHER_WIDTH:
            return [json.loads(bytes(o.numpy()[8:8 + n])) for o, n in zip(outs, sizes)]
        full = np.zeros(max(sizes), dtype=np.uint8)  # every rank saw the same sizes: all take this round
        full[:len(data)] = np.frombuffer(data, dtype=np.uint8)
        outs = [torch.empty(full.size, dtype=torch.uint8) for _ in range(self.world_size)]
        self._dist.all_gather(outs, torch.from_numpy(full), group=self._pg)
        return [json.loads(bytes(o.numpy()[:n])) for o, n in zip(outs, sizes)]

    def barrier(self) -> None:
        self._dist.barrier(group=self._pg)

    @property
    def process_group(self) -> Any:
        """The torch.distributed process group of tierfs's collectives (e.g. for ``dcp.save``)."""
        return self._pg


def outcomes(group: "Group", mine: Any = None, failure: BaseException | None = None, *,
             classify: Callable[[BaseException], type[_errors.TierfsError]] | None = None) -> list[list[Any]]:
    """Every rank's outcome of a step, in rank order (collective): ``[None, mine]`` where the rank got
    through it, ``[kind, reason]`` where it failed with ``failure`` (``kind``: the name of the error class
    ``classify(failure)`` gives, TierfsError by default; ``reason``: ``"Type: message"``)."""
    if failure is None:
        payload: list[Any] = [None, mine]
    else:
        kind = (classify or (lambda e: _errors.TierfsError))(failure)
        payload = [kind.__name__, f"{type(failure).__name__}: {failure}"]
    return group.all_gather(payload) if group.world_size > 1 else [payload]


def agree(group: "Group", mine: Any = None, failure: BaseException | None = None, what: str = "", *,
          classify: Callable[[BaseException], type[_errors.TierfsError]] | None = None,
          outcome: str = "") -> list[Any]:
    """Every rank's ``mine``, in rank order, once every rank reached this point; if any rank failed, raise
    on every rank (collective).

    A rank that failed passes its exception as ``failure`` and raises it again here, after the others
    heard of it; every other rank raises a :class:`~tierfs.errors.TierfsError` (or the class
    ``classify(failure)`` names on the failing rank, e.g. StateMismatchError for a caller's mistake) that
    names ``what``, the ranks that failed and the first one's reason, then ``outcome`` (e.g. "not
    committed"). The exception's ``failed_ranks`` maps each failed rank to its reason.
    """
    views = outcomes(group, mine, failure, classify=classify)
    if failure is not None:
        raise failure
    failed = {r: (kind, why) for r, (kind, why) in enumerate(views) if kind is not None}
    if failed:
        raise ranks_failed(what, failed, outcome)
    return [v[1] for v in views]


def ranks_failed(what: str, failed: dict[int, tuple[str, str]], outcome: str = "") -> _errors.TierfsError:
    """The error a rank raises when other ranks failed: ``{rank: (kind, reason)}`` as :func:`outcomes`
    gives them; of the class the first failed rank's kind names (a tierfs error class)."""
    first = min(failed)
    cls = getattr(_errors, failed[first][0], None)
    if not (isinstance(cls, type) and issubclass(cls, _errors.TierfsError)):
        cls = _errors.TierfsError
    tail = f"; {outcome}" if outcome else ""
    err = cls(f"{what}: rank(s) {sorted(failed)} failed (rank {first}: {failed[first][1]}){tail}")
    err.failed_ranks = {r: why for r, (_, why) in failed.items()}  # type: ignore[attr-defined]
    return err


class agreement:
    """``agree`` around a block: ``with agreement(group, "commit step 3") as vote: ...; vote.mine = x``.

    On leaving the block every rank learns whether every rank got through it; a rank whose block raised
    raises it again, the others raise as :func:`agree` does. ``vote.results`` holds every rank's ``mine``.
    """

    def __init__(self, group: "Group", what: str, *, outcome: str = "",
                 classify: Callable[[BaseException], type[_errors.TierfsError]] | None = None) -> None:
        self.group, self.what, self.outcome, self.classify = group, what, outcome, classify
        self.mine: Any = None
        self.results: list[Any] = []

    def __enter__(self) -> "agreement":
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        try:
            self.results = agree(self.group, self.mine, exc, self.what, classify=self.classify,
                                 outcome=self.outcome)
        except BaseException as e:
            if e is exc:
                return  # the block's own exception goes on as it was
            raise


def _wait(work: Any) -> None:
    """Wait for a point-to-point operation (torch returns None for one that completed at once)."""
    if work is not None:
        work.wait()


def _tasks() -> set[int]:
    try:
        return {int(t) for t in os.listdir("/proc/self/task")}
    except OSError:  # not Linux: priorities stay as they are
        return set()


def env_node_rank(rank: int) -> int:
    """This process's node number from the environment (see the module docstring)."""
    for var in ("TIERFS_NODE_RANK", "GROUP_RANK"):
        if os.environ.get(var, "").strip():
            return int(os.environ[var])
    local = os.environ.get("LOCAL_WORLD_SIZE", "").strip()
    return rank // int(local) if local else 0


Group = Union[SingleProcess, "TorchGroup"]


def default_group() -> SingleProcess | TorchGroup:
    import sys

    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return TorchGroup()
    return SingleProcess()
