"""HTTP/1.1 on the wire, as the test proxies need it: messages read only as far as their framing
(Content-Length or chunked bodies; the bytes kept as they came, so signatures and checksums stay valid),
headers dropped, and sockets closed gently or with a reset.
"""

from __future__ import annotations

import select
import socket
import struct

#: the longest start or header line read
MAX_HEADER = 64 << 10


class Closed(Exception):
    """The other side closed the connection."""


def read_head(f, *, request: bool) -> tuple[bytes, str, str, dict[str, str]]:
    """Read a request's or response's start line and headers: (raw bytes, method or version, target or
    status, lower-cased headers). Skips 1xx interim responses."""
    while True:
        line = f.readline(MAX_HEADER)
        if not line:
            raise Closed()
        if request and line in (b"\r\n", b"\n"):
            continue  # stray blank line between requests
        raw = [line]
        headers: dict[str, str] = {}
        while True:
            h = f.readline(MAX_HEADER)
            if not h:
                raise Closed()
            raw.append(h)
            if h in (b"\r\n", b"\n"):
                break
            k, _, v = h.decode("latin-1").partition(":")
            headers[k.strip().lower()] = v.strip()
        parts = line.decode("latin-1").split(" ", 2)
        if len(parts) < 2:
            raise ValueError(f"malformed start line {line!r}")
        if not request and parts[1].startswith("1"):
            continue  # 100 Continue from the server: the request was sent whole already
        return b"".join(raw), parts[0], parts[1], headers


def read_body(f, headers: dict[str, str], *, method: str, status: int | None) -> bytes:
    """A message body, raw (chunked framing kept): by Content-Length, chunks, or (responses) to EOF."""
    if status is not None and (method == "HEAD" or status in (204, 304) or 100 <= status < 200):
        return b""
    if "chunked" in headers.get("transfer-encoding", "").lower():
        out = []
        while True:
            line = f.readline(MAX_HEADER)
            if not line:
                raise Closed()
            out.append(line)
            size = int(line.split(b";")[0].strip() or b"0", 16)
            if size == 0:
                while True:  # trailers, then the blank line
                    t = f.readline(MAX_HEADER)
                    if not t:
                        raise Closed()
                    out.append(t)
                    if t in (b"\r\n", b"\n"):
                        return b"".join(out)
            out.append(read_exact(f, size + 2))
    if "content-length" in headers:
        return read_exact(f, int(headers["content-length"]))
    if status is None:
        return b""  # a request without a length has no body
    return f.read()  # a response delimited by the connection closing


def read_exact(f, n: int) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise Closed()
    return data


def drop_header(head: bytes, name: bytes) -> bytes:
    lines = head.split(b"\r\n")
    return b"\r\n".join(ln for ln in lines if not ln.lower().startswith(name + b":"))


def dechunk(raw: bytes) -> bytes:
    """The data of a chunked body."""
    out, i = [], 0
    while i < len(raw):
        j = raw.find(b"\r\n", i)
        if j < 0:
            break
        size = int(raw[i:j].split(b";")[0].strip() or b"0", 16)
        if size == 0:
            break
        out.append(raw[j + 2:j + 2 + size])
        i = j + 2 + size + 2
    return b"".join(out)


def wait_for_hangup(client: socket.socket, limit: float) -> bool:
    """Wait until the client closes its end (its read timeout fired), at most ``limit`` s; True if it did."""
    readable, _, _ = select.select([client], [], [], limit)
    if not readable:
        return False
    try:
        return client.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True


def linger0(*socks: socket.socket | None) -> None:
    """Make closing these sockets send a TCP reset (SO_LINGER 0), as a crashed peer or a middlebox would."""
    for s in socks:
        try:
            if s is not None:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass


def close_quietly(s) -> None:
    try:
        s.close()
    except OSError:
        pass
