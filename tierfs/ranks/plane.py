"""This process's side of tierfs's streams (:mod:`tierfs.ranks.streams`) that no group owns: the socket it
listens on, and the connections its peers opened to it, each claimed by the group it names.

A connection begins with a greeting: a magic word, the group's number, the sender's rank and the
receiver's. One whose greeting is not that is closed unread; one naming a group the process does not know
(yet) waits :data:`UNCLAIMED` seconds at most to be claimed; a second one for the same pair is closed.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time
from typing import Any

from . import liveness

HELLO, MAGIC = struct.Struct("!8sQII"), b"tierfs\x00\x01"  # a greeting: magic, group, sender, receiver
#: seconds a connection's greeting may take; seconds a connection of no known group is kept
GREET, UNCLAIMED = 5.0, 60.0


class Plane:
    """This process's listening socket and the connections it accepted, by ``(group, source rank)``."""

    def __init__(self) -> None:
        self.lock = threading.Condition()
        self.sock: socket.socket | None = None
        self.address = ""
        self.jobs: set[int] = set()
        self.incoming: dict[tuple[int, int, int], socket.socket] = {}  # (group, source, receiver) -> conn
        self.unclaimed: dict[tuple[int, int, int], tuple[socket.socket, float]] = {}
        self.published: set[int] = set()
        self.severed = False

    def listen(self) -> None:
        with self.lock:
            if self.sock is not None:
                return
            if self.severed:
                raise OSError("this rank gave up after a failure of the job's ranks")
            address = liveness.own_address()
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                sock.bind((address, 0))
            except OSError:
                sock.bind(("", 0))
            sock.listen(256)
            self.sock, self.address = sock, address
            threading.Thread(target=self._serve, args=(sock,), name="tierfs-streams", daemon=True).start()

    def publish(self, store: Any, launch: int, rank: int) -> None:
        """Write this process's address under ``launch`` (once per launch)."""
        with self.lock:
            if launch in self.published or self.sock is None:
                return
            self.published.add(launch)
            port = self.sock.getsockname()[1]
        store.set(key(launch, rank), f"{self.address}:{port}")

    def _serve(self, sock: socket.socket) -> None:
        while True:
            try:
                conn, _ = sock.accept()
            except OSError:
                return  # closed: severed, or the process forked
            try:
                conn.settimeout(GREET)
                magic, job, src, dst = HELLO.unpack(conn.recv(HELLO.size, socket.MSG_WAITALL))
                if magic != MAGIC:
                    raise ValueError("not a tierfs stream")
                conn.settimeout(None)
            except (OSError, ValueError, struct.error):
                close(conn)
                continue
            with self.lock:
                key, now = (job, src, dst), time.monotonic()
                for k, (c, t) in list(self.unclaimed.items()):
                    if now - t > UNCLAIMED:
                        del self.unclaimed[k]
                        close(c)
                old = self.incoming.get(key) or self.unclaimed.get(key, (None, 0.0))[0]
                if self.severed or old is not None or len(self.unclaimed) >= 1024:
                    close(conn)  # a second connection for the same pair, or too many nobody claims
                elif job in self.jobs:
                    self.incoming[key] = conn
                else:  # a group whose ranks were quicker than this one to get going
                    self.unclaimed[key] = (conn, now)
                self.lock.notify_all()

    def register(self, job: int) -> None:
        with self.lock:
            self.jobs.add(job)
            for k in [k for k in self.unclaimed if k[0] == job]:
                self.incoming[k] = self.unclaimed.pop(k)[0]
            self.lock.notify_all()

    def forget(self, job: int) -> None:
        with self.lock:
            self.jobs.discard(job)
            for k in [k for k in self.incoming if k[0] == job]:
                close(self.incoming.pop(k))

    def sever(self) -> None:
        with self.lock:
            self.severed = True
            sock, self.sock = self.sock, None
            conns = list(self.incoming.values()) + [c for c, _ in self.unclaimed.values()]
            self.incoming.clear()
            self.unclaimed.clear()
            self.lock.notify_all()
        for c in conns + ([sock] if sock is not None else []):
            close(c)


#: this process's plane (a fresh one in a forked child: :func:`forked`)
PLANE = Plane()


def forked() -> list[socket.socket]:
    """In a process just forked: a fresh plane; the parent's sockets, for the caller to close (closing, not
    shutting them down, which would end the parent's connections too)."""
    global PLANE
    old, PLANE = PLANE, Plane()
    return [*old.incoming.values(), *(c for c, _ in old.unclaimed.values()), *([old.sock] if old.sock else [])]


def key(launch: int, rank: int) -> str:
    """The job's store's key of ``rank``'s address in launch ``launch``."""
    return f"tierfs/streams/{launch}/{rank}"


def close(conn: socket.socket) -> None:
    with contextlib.suppress(OSError):
        conn.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        conn.close()
