"""Bulk bytes between two ranks over plain TCP streams of tierfs's own: the data of a replica, an erasure
code's blocks, a restore's shards.

gloo moves a transfer's bytes through its I/O thread in pieces as each socket becomes writable: between
mapped files (the RAM tier's) 1.3-1.5x the CPU of a blocking ``sendall`` and ``recv_into`` of the same
bytes (``benchmarks/bench_streams.py``), and a small round over twice the CPU and time. So a
group's bulk exchanges go over streams instead, a transfer's headers and yes/no rounds too, and a forked
group's collectives (:mod:`tierfs.ranks.tree`, one message at a time on the calling thread):

- every process listens on one socket (on the address its peers route to, like
  :mod:`tierfs.ranks.liveness`; :mod:`tierfs.ranks.plane`) and writes that address to the job's store once
  per launch;
- for each group of tierfs (named by the random number its ranks share) and each ordered pair of ranks
  that exchange, the sender opens one connection when it first sends and says who it is: a magic word,
  the group's number, its rank and the receiver's. A connection whose greeting is not that is closed
  unread; one naming a group the process does not know (yet) waits a minute at most to be claimed;
- each exchange between a pair begins with its number and its length in bytes on that connection; the
  sender writes with ``sendall``, the receiver reads straight into the buffers with ``recv_into`` (no copy
  in Python) on a thread per source, kept between exchanges; both release the GIL while the kernel copies.

A failure on a connection (its peer's process ended and its kernel closed it, nothing moved within the
operation's time, the pair out of step) closes it; later exchanges of the group with that peer fail at
once, as gloo's do after a pair closure. A rank that gives up after a failure of the job's ranks closes
every stream (:func:`sever`), so its peers blocked on one fail at once. ``TIERFS_STREAMS=0`` on any rank
keeps every transfer on gloo (the ranks agree on it when a group is made).
"""

from __future__ import annotations

import datetime
import functools
import logging
import os
import socket
import struct
import threading
import time
import weakref
from typing import Any, Callable, NoReturn, Sequence

import numpy as np

from . import liveness, plane
from .waits import POLL, Round, Threads

log = logging.getLogger("tierfs")

#: an exchange's head on a connection: its number between the pair, its bytes
_HEAD = struct.Struct("!QQ")
#: bytes per system call at most: the deadline moves on at least this often
PIECE = 8 << 20
#: bytes of one collective's message at most (a longer head is a stream out of step)
MESSAGE = 1 << 30


def enabled() -> bool:
    """Whether this process offers streams (``TIERFS_STREAMS`` is not ``0``, and it can listen)."""
    if os.environ.get("TIERFS_STREAMS", "1").strip() == "0":
        return False
    try:
        plane.PLANE.listen()
    except OSError as e:
        log.info("tierfs: no streams of its own for bulk transfers (%s); they go over gloo", e)
        return False
    return True


_links: "weakref.WeakSet[Link]" = weakref.WeakSet()


def _forked() -> None:
    """In a process just forked: close the copies of the parent's sockets (closing, not shutting them down,
    which would end the parent's connections too)."""
    conns = plane.forked()
    for link in list(_links):
        conns += link._out.values()
        link._out.clear()
    _links.clear()
    for c in conns:
        c.close()


os.register_at_fork(after_in_child=_forked)


def sever() -> None:
    """Close every stream of this process (after a failure of the job's ranks): the peers blocked on one
    fail at once, as if this process had ended."""
    for link in list(_links):
        link.close("this rank gave up after a failure of the job's ranks")
    plane.PLANE.sever()


class _Broken(Exception):
    """A stream failed; the message says how, in the words :func:`tierfs.ranks.waits.kind_of` reads."""


class Stopped(Exception):
    """A collective's message could not move: the failure is noted in its round, the stream closed."""


class Link:
    """This rank's streams with the other ranks of one group: ``job`` is the group's number (the same on every
    rank), ``store`` the job's, ``launch`` the number the ranks' addresses are written under there, and
    ``gone(peer)`` whether a peer's process ended (:mod:`tierfs.ranks.liveness`), or None."""

    def __init__(self, job: int, rank: int, store: Any, launch: int, gone: Callable[[int], bool] | None) -> None:
        self.job, self.rank, self.store, self.launch, self._gone = job, rank, store, launch, gone
        self._out: dict[int, socket.socket] = {}
        self._broken: dict[int, str] = {}  # peer -> why its streams were closed
        self._sent: dict[int, int] = {}  # exchanges sent to / received from each peer
        self._got: dict[int, int] = {}
        #: the threads that read the streams from each source, one per source at a time, kept between
        #: exchanges (an erasure code's save has one exchange per block) with the priority of the group's user
        self._readers = Threads("tierfs-receive")
        plane.PLANE.publish(store, launch, rank)
        plane.PLANE.register(job)
        _links.add(self)
        weakref.finalize(self, _drop, job, self._out)

    def close(self, why: str = "closed") -> None:
        for peer in list(self._out):
            self._break(peer, why)
        plane.PLANE.forget(self.job)

    def _break(self, peer: int, why: str) -> None:
        self._broken.setdefault(peer, why)
        conn = self._out.pop(peer, None)
        if conn is not None:
            plane.close(conn)
        with plane.PLANE.lock:
            for key in [k for k in plane.PLANE.incoming if k[0] == self.job and k[1] == peer and k[2] == self.rank]:
                plane.close(plane.PLANE.incoming.pop(key))

    def run(self, io: Round, sends: Sequence[tuple[int, np.ndarray]], recvs: Sequence[tuple[int, np.ndarray]],
            pace: Callable[[int], None] | None, on_received: Callable[[int], None] | None,
            failures: list[BaseException]) -> None:
        """One exchange (see :meth:`tierfs.ranks.groups.TorchGroup.exchange`): failed peers noted in ``io``,
        failures of ``pace`` and ``on_received`` appended to ``failures``. ``on_received`` is called in order
        for each peer, from a thread per peer, one call at a time."""
        by_src: dict[int, list[int]] = {}
        for i, (src, _) in enumerate(recvs):
            by_src.setdefault(src, []).append(i)
        one = threading.Lock()

        def receive(src: int, order: list[int], done: threading.Event) -> None:
            try:
                conn = self._incoming(src, io)
                raw = np.empty(_HEAD.size, dtype=np.uint8)
                _read_into(conn, raw, io, src)
                head = _HEAD.unpack(raw.tobytes())
                want = (self._got.get(src, 0), sum(recvs[i][1].nbytes for i in order))
                if head != want:
                    raise _Broken(f"rank {src} is out of step on its stream: it sent exchange {head[0]} of "
                                  f"{head[1]} bytes where {want[0]} of {want[1]} was due")
                self._got[src] = want[0] + 1
                for i in order:
                    _read_into(conn, recvs[i][1], io, src)
                    if on_received is not None:
                        with one:
                            if not failures:
                                try:
                                    on_received(i)
                                except BaseException as e:  # noqa: BLE001 - raised by the caller at the end
                                    failures.append(e)
            except _Broken as e:
                io.fail(src, str(e))
                self._break(src, str(e))
            except BaseException as e:  # noqa: BLE001 - raised by the caller at the end
                failures.append(e)
            finally:
                done.set()

        ended = [threading.Event() for _ in by_src]
        for (src, order), done in zip(by_src.items(), ended):
            self._readers.run(functools.partial(receive, src, order, done))
        try:
            totals: dict[int, int] = {}
            for dst, buf in sends:
                totals[dst] = totals.get(dst, 0) + buf.nbytes
            for dst, buf in sends:
                if dst in io.failures:
                    continue
                try:
                    conn = self._outgoing(dst, io)
                    if dst in totals:
                        _write(conn, _HEAD.pack(self._sent.get(dst, 0), totals.pop(dst)), io, dst)
                        self._sent[dst] = self._sent.get(dst, 0) + 1
                    if pace is not None:
                        try:
                            pace(buf.nbytes)
                        except BaseException as e:  # noqa: BLE001 - the rest goes unpaced: nobody waits
                            failures.append(e)
                            pace = None
                    for a in range(0, buf.nbytes, PIECE):
                        _write(conn, buf[a:a + PIECE].data.cast("B"), io, dst)
                except _Broken as e:
                    io.fail(dst, str(e))
                    self._break(dst, str(e))
        finally:
            for done in ended:  # each reader ends within the operation's time (its reads are bounded)
                done.wait()

    def send(self, io: Round, dst: int, data: bytes) -> None:
        """One message of a collective to ``dst``, on this thread (:mod:`tierfs.ranks.tree`): numbered like
        an exchange. A failure is noted in ``io`` and raised as :class:`Stopped`."""
        try:
            _write(self._outgoing(dst, io), _HEAD.pack(self._sent.get(dst, 0), len(data)) + data, io, dst)
            self._sent[dst] = self._sent.get(dst, 0) + 1
        except _Broken as e:
            self._stop(io, dst, str(e))

    def receive(self, io: Round, src: int) -> bytes:
        """The next message of a collective from ``src``, on this thread (at most :data:`MESSAGE` bytes)."""
        try:
            conn = self._incoming(src, io)
            raw = np.empty(_HEAD.size, dtype=np.uint8)
            _read_into(conn, raw, io, src)
            number, size = _HEAD.unpack(raw.tobytes())
            if number != self._got.get(src, 0) or size > MESSAGE:
                raise _Broken(f"rank {src} is out of step on its stream: it sent message {number} of {size} "
                              f"bytes where {self._got.get(src, 0)} was due")
            self._got[src] = number + 1
            body = np.empty(size, dtype=np.uint8)
            _read_into(conn, body, io, src)
            return body.tobytes()
        except _Broken as e:
            self._stop(io, src, str(e))

    def _stop(self, io: Round, peer: int, why: str) -> NoReturn:
        io.fail(peer, why)
        self._break(peer, why)
        raise Stopped(why)

    def _outgoing(self, dst: int, io: Round) -> socket.socket:
        conn = self._out.get(dst)
        if conn is not None:
            return conn
        if dst in self._broken:
            raise _Broken(f"pair closure: the stream to rank {dst} was closed ({self._broken[dst]})")
        host, port = self._address(dst, io)
        try:
            conn = socket.create_connection((host, port), timeout=min(io.op.allowed(), liveness.CONNECT * 5))
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.sendall(plane.HELLO.pack(plane.MAGIC, self.job, self.rank, dst))
        except OSError as e:
            raise _Broken(_said(e, dst)) from None
        self._out[dst] = conn
        return conn

    def _address(self, dst: int, io: Round) -> tuple[str, int]:
        key = plane.key(self.launch, dst)
        while True:
            try:
                if self.store.check([key]):
                    host, port = bytes(self.store.get(key)).decode().rsplit(":", 1)
                    return host, int(port)
            except Exception as e:  # noqa: BLE001 - the store's errors are RuntimeErrors
                raise _Broken(f"rank {dst}'s stream address cannot be read from the job's store ({e})") from None
            try:
                self.store.wait([key], datetime.timedelta(seconds=POLL))
            except Exception:  # noqa: BLE001 - not written yet (a store that is gone fails the next look)
                pass
            self._wait(dst, io)

    def _incoming(self, src: int, io: Round) -> socket.socket:
        key = (self.job, src, self.rank)
        while True:
            with plane.PLANE.lock:
                conn = plane.PLANE.incoming.get(key)
                if conn is not None:
                    return conn
                if src in self._broken:
                    raise _Broken(f"pair closure: the stream from rank {src} was closed ({self._broken[src]})")
                if plane.PLANE.severed:
                    raise _Broken("pair closure: this rank gave up after a failure of the job's ranks")
                plane.PLANE.lock.wait(min(POLL, max(io.op.deadline - time.monotonic(), 0.0)))
                if key in plane.PLANE.incoming:
                    continue
            self._wait(src, io)

    def _wait(self, peer: int, io: Round) -> None:
        """Raise once ``peer``'s process ended or the operation's time is out (``peer`` has not shown up)."""
        if self._gone is not None and self._gone(peer):
            raise _Broken(f"Connection closed by peer: rank {peer}'s process ended before its stream opened")
        if time.monotonic() >= io.op.deadline:
            raise _Broken(f"Timed out: rank {peer} opened no stream within {io.op.timeout:.0f} s")


def _drop(job: int, out: dict[int, socket.socket]) -> None:
    for conn in list(out.values()):
        plane.close(conn)
    out.clear()
    plane.PLANE.forget(job)


def _said(e: BaseException, peer: int) -> str:
    """A failed stream call in the words :func:`tierfs.ranks.waits.kind_of` reads."""
    if isinstance(e, socket.timeout):
        return f"Timed out: nothing moved on the stream with rank {peer} in time"
    if isinstance(e, (ConnectionError, EOFError)):
        return f"Connection closed by peer: rank {peer}'s stream ended ({e or 'its process ended'})"
    return f"the stream with rank {peer} failed ({type(e).__name__}: {e})"


def _write(conn: socket.socket, data: Any, io: Round, peer: int) -> None:
    try:
        conn.settimeout(io.op.allowed())
        conn.sendall(data)
    except OSError as e:
        raise _Broken(_said(e, peer)) from None
    if io.bulk:
        io.op.progress()


def _read_into(conn: socket.socket, buf: np.ndarray, io: Round, peer: int) -> None:
    view, got, n = buf.data.cast("B"), 0, buf.nbytes
    try:
        while got < n:
            conn.settimeout(io.op.allowed())
            k = conn.recv_into(view[got:], min(n - got, PIECE))
            if not k:
                raise EOFError("its process ended")
            got += k
            if io.bulk:
                io.op.progress()
    except (OSError, EOFError) as e:
        raise _Broken(_said(e, peer)) from None
