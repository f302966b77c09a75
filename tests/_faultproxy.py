"""A fault-injecting, request-counting HTTP/1.1 proxy on 127.0.0.1 in front of an S3 server (no mocks):
the object-store fault tests inject faults with it, and the scale benchmarks (``benchmarks/_scale.py``,
which puts this folder on ``sys.path``) count each rank's requests with it.

    proxy = FaultProxy("http://127.0.0.1:8333", seed=7)   # in front of a real S3 server
    proxy.set_faults(0.2)                                  # ~20% of requests fail, every kind
    fs = s3fs.S3FileSystem(endpoint_url=proxy.url, ...)    # the real client talks to the proxy
    proxy.fail_next(2, "internal", match=is_listing)       # exactly the next two listings fail
    proxy.close()

Each client connection gets a thread; each request it forwards goes to the server on a connection of its
own. Requests and responses are parsed only as far as framing needs (Content-Length or chunked bodies)
and otherwise pass byte for byte, so signatures and checksums stay valid. A request either passes, or
gets one fault (:data:`KINDS`):

``slowdown``
    503 with S3's ``SlowDown`` XML error body; the server never sees the request.
``internal``
    500 with S3's ``InternalError`` XML error body; the server never sees the request.
``reset``
    The connection is reset mid-body: a request with a body reaches the server cut in half (the server
    sees the connection drop); one without gets the first half of the server's response body.
``slow``
    The server handles the request but its response is held until the client hangs up (its read timeout
    fired), at most ``hold_limit`` seconds; then it is sent late.
``denied``
    403 ``AccessDenied`` (a permanent error, for checking that it is not retried). Never drawn by
    :meth:`FaultProxy.set_faults` unless named.

A throttling store: :meth:`FaultProxy.set_bucket` gives every key prefix (:func:`prefix_of`) a token
bucket of ``rate`` requests per second, shared by every client; a request finding its prefix's bucket
empty gets ``slowdown`` (as S3 answers beyond a partition's rate).

Determinism: whether a request is faulted at random, and how, depends only on the seed, the request
(method, path, query without the server-chosen ``uploadId``, ``Range``) and how many times that same
request came before, never on thread interleaving or timing. :meth:`FaultProxy.fail_next` faults the next
matching requests in the order they arrive. :attr:`FaultProxy.log` records every request and its fault.

Counting: the proxy listens on ``ports`` ports (``url_of(i)``; :attr:`FaultProxy.url` is port 0's; more
with :meth:`FaultProxy.ensure`), one per client to tell apart (a rank), and counts per port each request
the server answered: by kind (:func:`classify`), its bytes, its key prefix (:func:`key_prefix`), the keys
a listing returned and the keys a delete named (:meth:`FaultProxy.count`, :attr:`FaultProxy.counts`).
``GET`` :data:`COUNTS_PATH` on a port answers that port's counts as JSON and is not forwarded. With
``keep_alive``, a response the server closes its connection after (werkzeug's ``Connection: close``, on
every response) keeps the client's connection open, as S3's do.
"""

from __future__ import annotations

import json
import random
import re
import socket
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from typing import Callable, Sequence

from _httpwire import Closed, close_quietly, dechunk, drop_header, linger0, read_body, read_head, wait_for_hangup

__all__ = ["COUNTS_PATH", "KINDS", "FaultProxy", "Request", "classify", "key_prefix", "keys_listed", "prefix_of"]

#: the faults drawn at random (``denied`` is only injected when asked for by name)
KINDS = ("slowdown", "internal", "reset", "slow")
_ERRORS = {
    "slowdown": (503, "Slow Down", "SlowDown", "Please reduce your request rate."),
    "internal": (500, "Internal Server Error", "InternalError", "We encountered an internal error. Please try "
                                                                "again."),
    "denied": (403, "Forbidden", "AccessDenied", "Access Denied"),
}
_VOLATILE_QUERY = {"uploadId"}  # chosen by the server per attempt: not part of what a request asks for
#: the path on any port that answers that port's counts (JSON) instead of being forwarded
COUNTS_PATH = "/__scale__/counts"


@dataclass(frozen=True)
class Request:
    """One request as the proxy saw it: ``fault`` is None when it passed."""

    method: str
    path: str
    query: str
    range: str
    fault: str | None
    #: when the proxy saw it (``time.monotonic()``: comparable across the processes of this machine)
    at: float = field(default_factory=time.monotonic, compare=False)

    @property
    def is_listing(self) -> bool:
        """A ListObjects(V2) request (a GET on a bucket, ``list-type``/``prefix``/``delimiter`` query)."""
        q = urllib.parse.parse_qs(self.query, keep_blank_values=True)
        return self.method == "GET" and self.path.count("/") == 1 and bool(
            {"list-type", "prefix", "delimiter"} & q.keys())


Match = Callable[[Request], bool]


def prefix_of(r: Request) -> str:
    """The key prefix a request falls under: its key's folder, or a listing's ``prefix`` parameter."""
    if r.is_listing:
        q = urllib.parse.parse_qs(r.query, keep_blank_values=True)
        return r.path.strip("/") + "/" + q.get("prefix", [""])[0].rstrip("/")
    return r.path.strip("/").rsplit("/", 1)[0]


def classify(r: Request) -> str:
    """The kind of an S3 request: LIST, PUT, HEAD, GET, DELETE or OTHER (path-style addressing)."""
    q = urllib.parse.parse_qs(r.query, keep_blank_values=True)
    on_bucket = len([s for s in r.path.split("/") if s]) <= 1
    if r.method == "HEAD":
        return "HEAD"
    if r.method == "GET":
        if on_bucket:
            return "LIST" if {"list-type", "prefix", "delimiter"} & q.keys() or not q else "OTHER"
        return "GET" if "uploadId" not in q else "OTHER"
    if r.method == "PUT":
        return "PUT" if not on_bucket else "OTHER"
    if r.method == "DELETE":
        return "DELETE" if not on_bucket or "uploadId" in q else "OTHER"
    if r.method == "POST":
        if "delete" in q:
            return "DELETE"
        if "uploads" in q or "uploadId" in q:
            return "PUT"
    return "OTHER"


def key_prefix(r: Request) -> str:
    """The key prefix a request works under, as counted: its key's folder (under the bucket), a listing's
    ``prefix``'s folder."""
    segs = [s for s in r.path.split("/") if s]
    prefix = urllib.parse.parse_qs(r.query, keep_blank_values=True).get("prefix", [""])[0]
    if len(segs) <= 1:  # on the bucket: a listing (the folder of its prefix), or a batch delete
        return prefix.rsplit("/", 1)[0] if "/" in prefix else ""
    return "/".join(segs[1:-1])


def keys_listed(body: bytes) -> int:
    """Keys (and common prefixes) in a ListObjects(V2) response: its KeyCount, else its <Key> and <Prefix>
    elements under CommonPrefixes."""
    m = re.search(rb"<KeyCount>(\d+)</KeyCount>", body)
    if m:
        return int(m.group(1))
    return len(re.findall(rb"<Key>", body)) + len(re.findall(rb"<CommonPrefixes>", body))


class FaultProxy:
    """A threaded proxy on 127.0.0.1 (free ports) in front of ``upstream`` (``http://host:port``).

    Parameters
    ----------
    upstream
        The S3 server's endpoint URL.
    seed
        Seeds every random fault decision (see the module docstring).
    hold_limit
        Seconds a ``slow`` response is held at most while the client still waits.
    ports
        Ports to listen on at first, each counted apart (see the module docstring).
    keep_alive
        Keep the client's connection open after a response the server closes its own after.
    """

    def __init__(self, upstream: str, *, seed: int = 0, hold_limit: float = 30.0, ports: int = 1,
                 keep_alive: bool = False) -> None:
        u = urllib.parse.urlsplit(upstream)
        if u.scheme != "http" or not u.hostname or not u.port:
            raise ValueError(f"FaultProxy needs an http://host:port upstream, got {upstream!r}")
        self.upstream = (u.hostname, u.port)
        self.seed, self.hold_limit, self.keep_alive = seed, hold_limit, keep_alive
        self.log: list[Request] = []
        self._rate, self._kinds = 0.0, KINDS
        self._match: Match | None = None
        self._scripted: list[tuple[int, str, Match | None]] = []  # [remaining, kind, match]
        self._bucket: tuple[float, float] | None = None  # (requests per second, burst) per prefix
        self._buckets: dict[str, tuple[float, float]] = {}  # prefix: (tokens, when)
        self._seen: dict[tuple[str, ...], int] = {}
        self._lock = threading.Lock()
        self._logged = threading.Condition(self._lock)  # notified as each request is logged
        self._conns: set[socket.socket] = set()
        self.counts: list[dict[str, int]] = []  # per port: what its requests were (see count())
        self._listeners: list[socket.socket] = []
        self._accepts: list[threading.Thread] = []
        self._threads: list[threading.Thread] = []
        self.ensure(max(1, ports))
        self.url = self.url_of(0)

    def ensure(self, ports: int) -> None:
        """Listen on at least ``ports`` ports."""
        while len(self._listeners) < ports:
            port = len(self._listeners)
            lst = socket.create_server(("127.0.0.1", 0), backlog=128)
            with self._lock:
                self._listeners.append(lst)
                self.counts.append({})
            t = threading.Thread(target=self._serve, args=(lst, port), name=f"faultproxy-accept-{port}", daemon=True)
            self._accepts.append(t)
            t.start()

    def url_of(self, port: int) -> str:
        """The URL of the proxy's ``port``-th port."""
        return f"http://127.0.0.1:{self._listeners[port].getsockname()[1]}"

    def count(self, port: int, key: str, n: int = 1) -> None:
        """Add ``n`` to ``key`` in ``port``'s counts (the proxy counts ``LIST``, ``PUT``, ...,
        ``bytes:<kind>``, ``prefix:<key prefix>``, ``keys_listed`` and ``keys_deleted``)."""
        with self._lock:
            c = self.counts[port]
            c[key] = c.get(key, 0) + n

    # -- what the tests set -------------------------------------------------------------------------
    def set_faults(self, rate: float, kinds: Sequence[str] = KINDS, *, match: Match | None = None,
                   seed: int | None = None) -> None:
        """Fault a fraction ``rate`` of the requests ``match`` accepts (default: all) with ``kinds``."""
        bad = [k for k in kinds if k not in (*KINDS, "denied")]
        if bad or not 0.0 <= rate <= 1.0 or not kinds:
            raise ValueError(f"fault kinds must be among {(*KINDS, 'denied')} and rate in [0, 1], got "
                             f"{list(kinds)}, {rate}")
        with self._lock:
            self._rate, self._kinds, self._match = float(rate), tuple(kinds), match
            if seed is not None:
                self.seed = seed

    def fail_next(self, n: int, kind: str, *, match: Match | None = None) -> None:
        """Fault exactly the next ``n`` requests that ``match`` accepts with ``kind`` (before any rate)."""
        if kind not in (*KINDS, "denied"):
            raise ValueError(f"unknown fault kind {kind!r}")
        with self._lock:
            self._scripted.append((n, kind, match))

    def scripted_left(self) -> int:
        """Faults asked for with :meth:`fail_next` that no request has taken yet."""
        with self._lock:
            return sum(n for n, _, _ in self._scripted)

    def set_bucket(self, rate: float | None, burst: float | None = None) -> None:
        """Serve each prefix at most ``rate`` requests per second (bursts of ``burst``, default ``rate``),
        answering ``slowdown`` beyond it; None: no limit."""
        with self._lock:
            self._bucket = None if rate is None else (float(rate), float(burst if burst is not None else rate))
            self._buckets = {}

    def clear(self) -> None:
        """No more faults (nor a bucket); the log stays."""
        with self._lock:
            self._rate, self._scripted, self._bucket = 0.0, [], None

    def wait_for(self, match: Match, timeout: float = 120.0) -> Request:
        """The first logged request ``match`` accepts, waiting for it (as requests come) up to ``timeout``
        seconds; TimeoutError past them."""
        deadline = time.monotonic() + timeout
        with self._logged:
            while True:
                for r in self.log:
                    if match(r):
                        return r
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no request the test waits for came within {timeout:g} s")
                self._logged.wait(left)

    def requests(self, *, fault: str | None | bool = True, match: Match | None = None) -> list[Request]:
        """Logged requests: ``fault=True`` any, ``False`` only faulted, None only passed, or one kind."""
        with self._lock:
            got = list(self.log)
        return [r for r in got if (match is None or match(r)) and (
            fault is True or (fault is False and r.fault is not None) or r.fault == fault)]

    # -- deciding -----------------------------------------------------------------------------------
    def _decide(self, method: str, target: str, rng_header: str) -> Request:
        path, _, query = target.partition("?")
        q = sorted((k, v) for k, v in urllib.parse.parse_qsl(query, keep_blank_values=True)
                   if k not in _VOLATILE_QUERY)
        plain = Request(method, urllib.parse.unquote(path), query, rng_header, None)
        with self._lock:
            fault = None
            for i, (n, kind, match) in enumerate(self._scripted):
                if n > 0 and (match is None or match(plain)):
                    self._scripted[i] = (n - 1, kind, match)
                    fault = kind
                    break
            key = (method, plain.path, urllib.parse.urlencode(q), rng_header)
            n_before = self._seen.get(key, 0)
            self._seen[key] = n_before + 1
            if fault is None and self._rate > 0 and (self._match is None or self._match(plain)):
                rng = random.Random(f"{self.seed}|{'|'.join(key)}|{n_before}")
                if rng.random() < self._rate:
                    fault = rng.choice(self._kinds)
            if fault is None and self._bucket is not None:
                rate, burst = self._bucket
                pre, now = prefix_of(plain), time.monotonic()
                tokens, when = self._buckets.get(pre, (burst, now))
                tokens = min(burst, tokens + (now - when) * rate)
                if tokens < 1:
                    fault = "slowdown"
                self._buckets[pre] = (tokens - (tokens >= 1), now)
            req = Request(method, plain.path, query, rng_header, fault)
            self.log.append(req)
            self._logged.notify_all()
        return req

    # -- serving ------------------------------------------------------------------------------------
    def _serve(self, listener: socket.socket, port: int) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # closed
            with self._lock:
                self._conns.add(client)
            t = threading.Thread(target=self._connection, args=(client, port), name="faultproxy-conn", daemon=True)
            self._threads.append(t)
            t.start()

    def _connection(self, client: socket.socket, port: int) -> None:
        """Serve one client connection (kept alive across requests) until either side closes it."""
        cin = client.makefile("rb")
        try:
            while True:
                try:
                    head, method, target, headers = read_head(cin, request=True)
                except Closed:
                    return
                if target.startswith(COUNTS_PATH):
                    with self._lock:
                        body = json.dumps(self.counts[port]).encode()
                    client.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                                   + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body)
                    return
                if headers.get("expect", "").lower() == "100-continue":  # answer it here, not upstream
                    client.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
                    head = drop_header(head, b"expect")
                body = read_body(cin, headers, method=method, status=None)
                req = self._decide(method, target, headers.get("range", ""))
                if req.fault in _ERRORS:
                    client.sendall(_error_response(req.fault, req.path, head_only=method == "HEAD"))
                elif not self._forward(client, port, req, head, body):
                    return
        except (OSError, Closed, ValueError):
            return  # either side went away; the client sees a dropped connection
        finally:  # the file first: a socket's descriptor closes with its last user
            close_quietly(cin)
            self._drop(client)

    def _forward(self, client: socket.socket, port: int, req: Request, head: bytes, body: bytes) -> bool:
        """One request to the server, on a connection of its own (never a kept-alive one the server may
        have closed meanwhile), counted, its fault applied; False when the client connection must close."""
        upstream = socket.create_connection(self.upstream)
        with self._lock:
            self._conns.add(upstream)
        uin = upstream.makefile("rb")
        try:
            if req.fault == "reset" and body:
                upstream.sendall(head + body[:len(body) // 2])
                linger0(client, upstream)
                return False
            upstream.sendall(head + body)
            rhead, _, status, rheaders = read_head(uin, request=False)
            rbody = read_body(uin, rheaders, method=req.method, status=int(status))
            # counted before the client hears back: what a client waited for is counted when it goes on
            self._count(port, req, head, body, int(status), rheaders, rbody)
            if req.fault == "reset":
                client.sendall(rhead + rbody[:len(rbody) // 2])
                linger0(client, upstream)
                return False
            if req.fault == "slow" and wait_for_hangup(client, self.hold_limit):
                return False
            closes = rheaders.get("connection", "").lower() == "close"
            framed = ("content-length" in rheaders or "chunked" in rheaders.get("transfer-encoding", "").lower()
                      or req.method == "HEAD" or int(status) in (204, 304))
            if closes and framed and self.keep_alive:  # the client's connection stays open, as S3's do
                rhead, closes = drop_header(rhead, b"connection"), False
            client.sendall(rhead + rbody)
            return not closes
        finally:
            close_quietly(uin)
            self._drop(upstream)

    def _count(self, port: int, req: Request, head: bytes, body: bytes, status: int, rheaders: dict[str, str],
               rbody: bytes) -> None:
        """Count a request the server answered (see :meth:`count`)."""
        kind = classify(req)
        self.count(port, kind)
        self.count(port, f"bytes:{kind}", len(body) + len(rbody))  # what went each way, headers aside
        self.count(port, f"prefix:{key_prefix(req)}")
        if kind == "LIST" and status == 200:
            plain = dechunk(rbody) if "chunked" in rheaders.get("transfer-encoding", "").lower() else rbody
            self.count(port, "keys_listed", keys_listed(plain))
        elif kind == "DELETE" and status // 100 == 2:
            n = len(re.findall(rb"<Key>", dechunk(body) if b"chunked" in head.lower() else body))
            self.count(port, "keys_deleted", n if req.method == "POST" else 1)

    def _drop(self, s: socket.socket) -> None:
        with self._lock:
            self._conns.discard(s)
        close_quietly(s)

    def close(self) -> None:
        """Stop accepting, drop every open connection, and join the threads."""
        for lst in self._listeners:
            try:
                lst.shutdown(socket.SHUT_RDWR)  # wakes accept()
            except OSError:
                pass
            close_quietly(lst)
        for t in self._accepts:
            t.join(timeout=10)
        with self._lock:
            conns = list(self._conns)
        for s in conns:  # shutdown wakes a thread blocked reading it; close alone would not
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for t in self._threads:
            t.join(timeout=10)

    def __enter__(self) -> "FaultProxy":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _error_response(kind: str, path: str, *, head_only: bool = False) -> bytes:
    """An S3 error response with its XML body (a response to HEAD has headers only)."""
    status, reason, code, message = _ERRORS[kind]
    body = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{message}</Message>'
            f"<Resource>{path}</Resource><RequestId>faultproxy</RequestId></Error>").encode()
    return (f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/xml\r\nContent-Length: {len(body)}\r\n"
            f"x-amz-request-id: faultproxy\r\n\r\n").encode() + (b"" if head_only else body)
