"""Whether another rank's process is still there, told by a socket of its own that the kernel closes when
the process ends, however it ends.

gloo notices a peer's connection drop only for the operations it starts later: a transfer under way with
a rank whose process was killed (a message of several MiB half sent or half received) waits on to its
timeout, and a wait that times out closes every connection of the group. So a long wait on a peer is
watched from outside: every process of the job listens on a socket of its own, opened when its first group
of tierfs is made, and writes its address to the job's key-value store (torch.distributed's TCPStore, to
which every rank is connected already: one request). A rank whose wait on a peer lasts connects to that
peer's socket once (the first time a wait on it is still going after :data:`~tierfs.ranks.waits.POLL`
seconds) and looks at the connection while it waits: the peer's process ending closes it (or refuses it),
at once, whatever the timeout.

A rank that sees a failure of the job's ranks gives up (:func:`give_up`, from
:func:`~tierfs.ranks.severing.sever_all`): it closes its socket too, so that a peer still waiting on a
transfer with it stops as if its process had ended (gloo closing its connections does not end an operation
under way either), and reports to the diagnosis in turn. A process forked from a rank (a data loader's
worker) closes its copies of these sockets, so that they never outlive the rank.

A process that cannot listen, or a peer whose socket cannot be reached (a firewall, an address not
routable from here), is not watched: its waits end as before, when the peer's connection drops or at the
timeout. The only bytes on these connections are one word a rank writes when it leaves: :data:`GAVE_UP`
(after a failure: its peers stop waiting on it at once) or :data:`BYE` (at a normal exit: a peer that did
its part may end before the waiting rank's last bytes have landed, and is not taken for a dead one). A
process that ends without a word (killed) counts as gone :data:`LINGER` seconds after it is seen ended.
"""

from __future__ import annotations

import atexit
import logging
import os
import selectors
import socket
import threading
import time
from typing import Any, Callable, cast

log = logging.getLogger("tierfs")

#: seconds a connection to a peer's socket may take
CONNECT = 2.0
#: seconds a peer's process must have ended, without a word, before it counts as gone: one that did its part
#: of a transfer and ended may do so before the waiting rank's last bytes have landed
LINGER = 0.5
#: the words a rank writes to its peers' connections: it gave up after a failure; it ends normally
GAVE_UP, BYE = b"!", b"."

_lock = threading.Lock()
#: this process's listening socket and the launches it was published for
_listening: dict[str, Any] = {"sock": None, "launches": set()}
#: per launch: ``{peer: connection, or None where the peer cannot be watched}``
_peers: dict[int, dict[int, socket.socket | None]] = {}
#: every socket of this module's in this process (the connections it accepted too)
_sockets: set[socket.socket] = set()
#: ``{(launch, peer): when its process was first seen ended}``
_ended: dict[tuple[int, int], float] = {}


def _forget() -> None:
    """In a process just forked: close the copies of the rank's sockets (its threads did not come along)."""
    global _lock
    _lock = threading.Lock()
    for s in list(_sockets):
        try:
            s.close()
        except OSError:
            pass
    _sockets.clear()
    _peers.clear()
    _ended.clear()
    _listening.update(sock=None, launches=set())


os.register_at_fork(after_in_child=_forget)


def _key(launch: int, rank: int) -> str:
    return f"tierfs/alive/{launch}/{rank}"


def own_address() -> str:
    """The address the other nodes reach this one by: the one this host routes to the job's store host
    (``MASTER_ADDR``) from, else its name's."""
    master = os.environ.get("MASTER_ADDR", "").strip()
    if master:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect((master, 9))  # no packet is sent: the kernel picks the route
                return str(s.getsockname()[0])
        except OSError:
            pass
    return socket.gethostbyname(socket.gethostname())


def _serve(sock: socket.socket) -> None:
    """Accept the peers' connections and hold them until they close, or until this rank gives up (a daemon
    thread)."""
    sel = selectors.DefaultSelector()
    sel.register(sock, selectors.EVENT_READ)
    while True:
        for key, _ in sel.select():
            r = cast(socket.socket, key.fileobj)
            if r is sock:
                try:
                    conn, _ = sock.accept()
                except OSError:
                    if _listening["sock"] is not sock:  # given up: every connection goes
                        for k in list(sel.get_map().values()):
                            _close(cast(socket.socket, k.fileobj))
                        sel.close()
                        return
                    continue
                _sockets.add(conn)
                sel.register(conn, selectors.EVENT_READ)
                continue
            try:
                data = r.recv(4096)
            except OSError:
                data = b""
            if not data:  # the watching peer went: drop its connection
                sel.unregister(r)
                _close(r)


def _close(s: socket.socket) -> None:
    _sockets.discard(s)
    try:
        s.close()
    except OSError:
        pass


def give_up() -> None:
    """This rank saw a failure of the job's ranks and leaves tierfs's groups: close its socket, so that the
    peers still waiting on a transfer with it stop at once too (as they would if its process had ended)."""
    with _lock:
        sock, _listening["sock"] = _listening["sock"], None
        if sock is None:
            return
        _tell(GAVE_UP, sock)


def _tell(word: bytes, listener: socket.socket) -> None:
    """Write ``word`` to every peer watching this rank and end the connections (and ``listener``: its thread
    ends, closing them)."""
    watching = _watching()
    for s in list(_sockets):
        if s in watching:
            continue
        try:
            if s is not listener:
                s.send(word, socket.MSG_DONTWAIT)
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def _bye() -> None:
    """At the interpreter's exit: tell the peers watching this rank that it ends normally."""
    with _lock:
        sock, _listening["sock"] = _listening["sock"], None
        if sock is not None:
            _tell(BYE, sock)


def _watching() -> set[socket.socket]:
    """The connections this rank made to watch its peers (not closed when it gives up)."""
    return {c for peers in _peers.values() for c in peers.values() if c is not None}


def publish(dist: Any, rank: int, launch: int, store: Any) -> None:
    """Listen (once per process) and write this rank's address under ``launch`` in the job's ``store``
    (once per launch). Best effort: where it fails, this rank's peers do not watch it."""
    with _lock:
        if launch in _listening["launches"] or store is None:
            return
        _listening["launches"].add(launch)
        try:
            address = own_address()
            if _listening["sock"] is None:
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                try:  # only on the address the peers are told (not every interface of the host)
                    sock.bind((address, 0))
                except OSError:
                    sock.bind(("", 0))
                sock.listen(256)
                _sockets.add(sock)
                threading.Thread(target=_serve, args=(sock,), name="tierfs-alive", daemon=True).start()
                if not _listening.get("bye"):
                    atexit.register(_bye)
                    _listening["bye"] = True
                _listening["sock"] = sock
            port = _listening["sock"].getsockname()[1]
            store.set(_key(launch, rank), f"{address}:{port}")
        except Exception as e:  # noqa: BLE001 - the store's own errors are RuntimeErrors; waits go on unwatched
            log.debug("tierfs: this rank cannot be watched by its peers (%s)", e)


def watcher(launch: int | None, store: Any) -> Callable[[int], bool] | None:
    """``gone(peer)``: whether ``peer``'s process of ``launch`` has ended, as far as its socket tells
    (False where it cannot be told). None without a launch or a store."""
    if launch is None or store is None:
        return None

    def gone(peer: int) -> bool:
        with _lock:
            peers = _peers.setdefault(launch, {})
            if peer not in peers:
                conn = _connect(store, launch, peer)
                if conn is _GONE:
                    return _silent(launch, peer)
                if conn is _NOT_YET:
                    return False
                peers[peer] = conn if isinstance(conn, socket.socket) else None
                if isinstance(conn, socket.socket):
                    _sockets.add(conn)
            conn = peers[peer]
        if conn is None:
            return False
        try:
            word = conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:  # nothing to read: the connection holds
            return False
        except ConnectionError:  # reset by the peer's kernel: its process ended
            word = b""
        except OSError:  # anything else says nothing of the peer
            return False
        if word == GAVE_UP:
            return True
        return _silent(launch, peer) if word == b"" else False  # BYE: it ended normally, its part done

    return gone


def _silent(launch: int, peer: int) -> bool:
    """Whether ``peer``'s process, seen ended without a word, has been for :data:`LINGER` seconds."""
    first = _ended.setdefault((launch, peer), time.monotonic())
    return time.monotonic() - first >= LINGER


_GONE, _NOT_YET, _UNWATCHED = object(), object(), object()


def _connect(store: Any, launch: int, peer: int) -> Any:
    """A connection to ``peer``'s socket; or ``_GONE`` (refused: its process ended), ``_NOT_YET`` (it wrote
    no address yet), ``_UNWATCHED`` (it cannot be reached from here)."""
    key = _key(launch, peer)
    try:
        if not store.check([key]):
            return _NOT_YET
        host, port = bytes(store.get(key)).decode().rsplit(":", 1)
    except Exception:  # noqa: BLE001 - the store is gone too: nothing to watch by
        return _UNWATCHED
    try:
        conn = socket.create_connection((host, int(port)), timeout=CONNECT)
        conn.setblocking(False)  # a look at it never waits (a socket with a timeout would, before reading)
        return conn
    except ConnectionRefusedError:
        return _GONE
    except OSError as e:
        log.debug("tierfs: rank %d's socket at %s:%s cannot be reached (%s): its waits are not watched", peer,
                  host, port, e)
        return _UNWATCHED
