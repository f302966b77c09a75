"""Whether another rank's process is still there, told by a socket of its own that the kernel closes when
the process ends, however it ends.

gloo notices a peer's connection drop only for the operations it starts later: a transfer under way with
a rank whose process was killed (a message of several MiB half sent or half received) waits on to its
timeout, and a wait that times out closes every connection of the group. So a long wait on a peer is
watched from outside: every process of the job listens on a socket of its own, opened when its first group
of tierfs is made, and writes its address to the job's key-value store (torch.distributed's TCPStore, to
which every rank is connected already: one request). A rank whose wait on a peer lasts connects to that
peer's socket once (when a wait is still going after :data:`~tierfs.ranks.waits.POLL` seconds: never in a
transfer that runs smoothly) and looks at the connection while it waits: the peer's process ending closes
it (or refuses it), at once, whatever the timeout.

A process that cannot listen, or a peer whose socket cannot be reached (a firewall, an address not
routable from here), is not watched: its waits end as before, when the peer's connection drops or at the
timeout. Nothing is ever read from or written to these sockets.
"""

from __future__ import annotations

import logging
import os
import select
import socket
import threading
from typing import Any, Callable

log = logging.getLogger("tierfs")

#: seconds a connection to a peer's socket may take
CONNECT = 2.0

_lock = threading.Lock()
#: this process's listening socket and the launches it was published for
_listening: dict[str, Any] = {"sock": None, "launches": set()}
#: per launch: ``{peer: connection, or None where the peer cannot be watched}``
_peers: dict[int, dict[int, socket.socket | None]] = {}
#: every socket of this module's in this process (the connections it accepted too)
_sockets: set[socket.socket] = set()


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
    _listening.update(sock=None, launches=set())


os.register_at_fork(after_in_child=_forget)


def _key(launch: int, rank: int) -> str:
    return f"tierfs/alive/{launch}/{rank}"


def _own_address() -> str:
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
    """Accept the peers' connections and hold them until they close (a daemon thread)."""
    held: list[socket.socket] = []
    while True:
        try:
            ready, _, _ = select.select([sock, *held], [], [])
        except (OSError, ValueError):
            held = [c for c in held if c.fileno() >= 0]
            continue
        for r in ready:
            if r is sock:
                try:
                    conn, _ = sock.accept()
                    held.append(conn)
                    _sockets.add(conn)
                except OSError:
                    pass
                continue
            try:
                data = r.recv(4096)
            except OSError:
                data = b""
            if not data:  # the watching peer went: drop its connection
                held.remove(r)
                _sockets.discard(r)
                r.close()


def publish(dist: Any, rank: int, launch: int, store: Any) -> None:
    """Listen (once per process) and write this rank's address under ``launch`` in the job's ``store``
    (once per launch). Best effort: where it fails, this rank's peers do not watch it."""
    with _lock:
        if launch in _listening["launches"] or store is None:
            return
        _listening["launches"].add(launch)
        try:
            if _listening["sock"] is None:
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                sock.bind(("", 0))
                sock.listen(256)
                _sockets.add(sock)
                threading.Thread(target=_serve, args=(sock,), name="tierfs-alive", daemon=True).start()
                _listening["sock"] = sock
            port = _listening["sock"].getsockname()[1]
            store.set(_key(launch, rank), f"{_own_address()}:{port}")
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
                    return True
                if conn is _NOT_YET:
                    return False
                peers[peer] = conn if isinstance(conn, socket.socket) else None
                if isinstance(conn, socket.socket):
                    _sockets.add(conn)
            conn = peers[peer]
        if conn is None:
            return False
        try:
            ready, _, _ = select.select([conn], [], [], 0)
            return bool(ready) and conn.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):  # reset by the peer's kernel: its process is gone
            return True

    return gone


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
        return socket.create_connection((host, int(port)), timeout=CONNECT)
    except ConnectionRefusedError:
        return _GONE
    except OSError as e:
        log.debug("tierfs: rank %d's socket at %s:%s cannot be reached (%s): its waits are not watched", peer,
                  host, port, e)
        return _UNWATCHED
