"""Waits on other ranks: one deadline per operation, and exactly which ranks failed.

A point-to-point wait of tierfs on another rank (a transfer, an all-gather) names that rank, and only
that rank, when it fails; a failed collective finds out which ranks made it fail
(:mod:`tierfs.ranks.diagnosis`). A rank's process that ends closes its connections, and every operation
on them fails at once: a dead rank is noticed as soon as its connections drop, never at the timeout.

An *operation* (``with bounded(timeout):`` — a collective, a transfer of several rounds, a background
copy) gives all its waits one deadline, ``timeout`` after it began, so that a sequence of waits never adds
up to several timeouts. A bulk transfer's deadline moves on with every message that lands (``progress``):
it ends when nothing moved for ``timeout``, however long the bytes take under the bandwidth cap.

A wait past the deadline still gets :data:`GRACE` seconds: the ranks held up by one rank that stopped all
reach their next round together, and none of them should be named for it. For the same reason, of the
ranks that were late or failed, only those of the first round that had such a failure are named: later
ones were held up by it.

gloo ends a wait that timed out by closing every connection of that group on the rank that waited, so the
others see its connections drop as if its process had ended, and its own later operations on the group
fail at once. A rank that did not arrive in time is therefore named before ranks whose connections
dropped (which may be ranks that gave up waiting for it), and failures caused by this rank's own closed
connections (:data:`CLOSED`) never name anyone.

gloo fails an operation started after a peer's connection dropped, but not one under way with it: a
message of several MiB half sent to, or half received from, a rank whose process was killed waits on to
the timeout. So a round may be given ``gone(peer)`` (:mod:`tierfs.ranks.liveness`): each wait then runs on
a thread of its own while the round looks, every :data:`POLL` seconds, whether the peer's process is still
there; once it is not, the wait fails as a dropped connection (:data:`GONE`), at once, and the round's
later waits on that peer too. The abandoned operations are waited for on a thread of their own (gloo
ends them at its timeout); nothing is sent or received on them any more.
"""

from __future__ import annotations

import contextlib
import datetime
import queue
import threading
import time
from typing import Any, Callable, Iterator, Mapping, Sequence

from ..errors import RankWaitError

#: seconds a wait gets even once its operation's deadline has passed (at most the timeout)
GRACE = 1.0
#: the shortest wait handed to the backend (a zero timeout may read as none)
_SHORTEST = 0.002
#: seconds between two looks at a watched peer while a wait on it goes on
POLL = 0.2

#: kinds of failure: the peer's connection dropped (its process ended, or it gave up on the group);
#: nothing came in time; this rank's own connections were closed after an earlier timeout; anything else
GONE, LATE, CLOSED, FAILED = "gone", "late", "closed", "failed"

_local = threading.local()


def kind_of(message: str) -> str:
    """The kind of failure a backend's (gloo's) message describes: :data:`GONE`, :data:`LATE`, :data:`CLOSED`
    or :data:`FAILED`."""
    m = message.lower()
    if "pair closure" in m:  # "Application timeout caused pair closure": this rank closed them, earlier
        return CLOSED
    if any(w in m for w in ("closed by peer", "reset by peer", "broken pipe", "connection refused")):
        return GONE
    if "timed out" in m or "timeout" in m:
        return LATE
    return FAILED


def said(message: str) -> str:
    """What a failed wait's backend ``message`` says of the rank waited for, in a few words."""
    kind = kind_of(message)
    if kind == GONE:
        return "is gone (its connection dropped)"
    if kind == LATE:
        return "did not answer in time"
    if kind == CLOSED:
        return "cannot be reached (this rank gave up on the connection after a timeout)"
    return f"failed ({message.strip().splitlines()[0] if message.strip() else 'no reason given'})"


class Operation:
    """The waits of one operation: one deadline, and which ranks failed, by kind.

    Parameters
    ----------
    timeout:
        Seconds from now that every wait of the operation together may take.
    """

    def __init__(self, timeout: float) -> None:
        self.timeout = float(timeout)
        self.deadline = time.monotonic() + self.timeout
        self.gone: dict[int, str] = {}
        self.late: dict[int, str] = {}
        self.failed: dict[int, str] = {}
        self.closed: dict[int, str] = {}
        self._named = False  # late and failed ranks are taken from the first round with such a failure
        self._lock = threading.Lock()

    def allowed(self) -> float:
        """Seconds the next wait may take: what is left until the deadline, at least the grace."""
        return max(self.deadline - time.monotonic(), min(GRACE, self.timeout), _SHORTEST)

    def progress(self) -> None:
        """A bulk transfer moved: the deadline is ``timeout`` from now (never earlier than it was)."""
        with self._lock:
            self.deadline = max(self.deadline, time.monotonic() + self.timeout)

    def note(self, failures: Mapping[int, str]) -> None:
        """The failed waits of one round, ``{rank: backend message}``."""
        with self._lock:
            for rank, why in failures.items():
                kind = kind_of(why)
                if kind == GONE:
                    self.gone.setdefault(rank, why)
                elif kind == CLOSED:
                    self.closed.setdefault(rank, why)
                elif not self._named:
                    (self.late if kind == LATE else self.failed).setdefault(rank, why)
            self._named = self._named or any(kind_of(w) in (LATE, FAILED) for w in failures.values())

    def error(self, where: str | None, before: str | None = None) -> RankWaitError:
        """The one error of the operation's failed waits: the ranks that did not arrive in time (the
        others may have given up waiting for them), else those gone, else those whose transfer failed;
        ``before``: why this rank's connections on the group were closed, if an earlier operation did."""
        at = f"{where}: " if where else ""
        if self.late:
            err = RankWaitError.waiting(where, sorted(self.late), self.timeout, "timed out")
        elif self.gone:
            err = RankWaitError.waiting(where, sorted(self.gone), self.timeout, "closed by peer")
        elif self.failed:
            ranks = sorted(self.failed)
            why = self.failed[ranks[0]].strip().splitlines()[0]
            err = RankWaitError(f"{at}the transfer with rank(s) {ranks} failed ({why}); check their logs",
                                stage=where, ranks=ranks)
        else:
            ranks = sorted(self.closed)
            err = RankWaitError(f"{at}rank(s) {ranks} cannot be reached: this rank closed its connections on "
                                f"this group when an earlier wait timed out ({before or 'see the log'})",
                                stage=where, ranks=ranks)
        if where is not None:
            err.tierfs_stage = where  # type: ignore[attr-defined]
        return err


@contextlib.contextmanager
def bounded(timeout: float) -> Iterator[Operation]:
    """Run the block as one operation: its waits on this thread share one deadline, ``timeout`` seconds
    from now. Inside another operation's block, the block is part of that one (its deadline holds)."""
    outer = getattr(_local, "op", None)
    if outer is not None:
        yield outer
        return
    op = _local.op = Operation(timeout)
    try:
        yield op
    finally:
        _local.op = None


class Round:
    """One round of point-to-point operations of an operation: each started, then each waited for (from
    one thread or two); ``end`` notes its failures in the operation.

    Parameters
    ----------
    op:
        The operation the round belongs to.
    bulk:
        A bulk transfer: every wait that ends moves the deadline on (:meth:`Operation.progress`).
    """

    def __init__(self, op: Operation, bulk: bool = False, gone: Callable[[int], bool] | None = None) -> None:
        self.op, self.bulk, self.gone = op, bulk, gone
        self.failures: dict[int, str] = {}
        self._lock = threading.Lock()
        self._lost: set[int] = set()  # peers whose process ended: their operations are abandoned

    def start(self, peer: int, post: Callable[[], Any]) -> Any:
        """``post()`` an operation with ``peer``; None if it cannot start (its connection is gone: noted)."""
        try:
            return post()
        except RuntimeError as e:
            self.fail(peer, str(e))
            return None

    def wait(self, work: Any, peer: int) -> bool:
        """Wait for ``work`` (from :meth:`start`; None: it never started) within the operation's time;
        whether it completed (else its failure is noted)."""
        if work is None:
            return False
        if peer in self._lost:
            _reap_later(work, self.op.timeout)
            return False
        try:
            if self.gone is None:
                work.wait(timeout=datetime.timedelta(seconds=self.op.allowed()))
            elif watched(work, self.op.allowed(), [peer], self.gone) is not None:
                self._lost.add(peer)
                self.fail(peer, ended(peer))
                return False
        except RuntimeError as e:
            self.fail(peer, str(e))
            return False
        if self.bulk:
            self.op.progress()
        return True

    def fail(self, peer: int, why: str) -> None:
        """Note that the round's operations with ``peer`` failed (the first reason holds)."""
        with self._lock:
            self.failures.setdefault(peer, why)


    def end(self) -> dict[int, str]:
        """The round's failures, ``{rank: backend message}``, noted in the operation."""
        self.op.note(self.failures)
        return dict(self.failures)


def watched(work: Any, seconds: float, peers: Sequence[int], gone: Callable[[int], bool]) -> int | None:
    """Wait for ``work`` up to ``seconds`` (its failure raised), looking every :data:`POLL` seconds whether
    the processes of ``peers`` are still there; the first one found gone, if any (the wait goes on on its
    thread, abandoned), else None."""
    done = threading.Event()
    failure: list[BaseException] = []

    def run() -> None:
        try:
            work.wait(timeout=datetime.timedelta(seconds=seconds))
        except BaseException as e:  # noqa: BLE001 - raised on the waiting thread
            failure.append(e)
        finally:
            done.set()

    # a first look at once: a peer's socket is connected at the first wait on it (the job's store read
    # then, once per peer), not at the first wait that lasts, so a steady save's requests do not depend on
    # how busy the machine is
    for peer in peers:
        if gone(peer):
            _reap_later(work, seconds)  # abandoned, as below
            return peer
    if work.is_completed():  # done already (a send into the socket's buffer): no thread to hand it to
        run()
    else:
        _WAITERS.run(run)
    try:
        while not done.wait(POLL):
            for peer in peers:
                if gone(peer):
                    return peer
    except BaseException:  # an interrupt: raised once the wait ended, as a wait of the backend's own does
        done.wait()
        raise
    if failure:
        raise failure[0]
    return None


def ended(peer: int) -> str:
    """The failure of a wait on ``peer`` once its process is found gone (a dropped connection: :data:`GONE`)."""
    return f"Connection closed by peer: rank {peer}'s process ended, or it gave up after a failure (its socket closed)"


class Threads:
    """Daemon threads named ``name`` that run functions handed to them, started as they are needed (by the
    thread that hands one over: a thread's CPU priority is its starter's) and reused."""

    def __init__(self, name: str = "tierfs-wait") -> None:
        self.name = name
        self._queue: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._idle = 0
        self._lock = threading.Lock()

    def run(self, fn: Callable[[], None]) -> None:
        with self._lock:
            start = self._idle == 0
            if not start:
                self._idle -= 1
        if start:
            threading.Thread(target=self._loop, name=self.name, daemon=True).start()
        self._queue.put(fn)

    def _loop(self) -> None:
        while True:
            self._queue.get()()
            with self._lock:
                self._idle += 1


def _reap_later(work: Any, seconds: float) -> None:
    """Wait for ``work``, abandoned on a peer that is gone, on a thread that waits for such operations one
    after the other (started when first needed)."""
    with _reaper["lock"]:
        if not _reaper["started"]:
            threading.Thread(target=_reap, name="tierfs-reap", daemon=True).start()
            _reaper["started"] = True
    _reaped.put((work, seconds))


def _reap() -> None:
    while True:
        work, seconds = _reaped.get()
        try:
            work.wait(timeout=datetime.timedelta(seconds=seconds))
        except Exception:  # noqa: BLE001 - their failure was reported already
            pass


_WAITERS = Threads()  # the watched waits'
_reaped: "queue.SimpleQueue[tuple[Any, float]]" = queue.SimpleQueue()
_reaper: dict[str, Any] = {"lock": threading.Lock(), "started": False}
