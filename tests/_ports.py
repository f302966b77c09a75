"""Ports for servers the tests start (a job's rendezvous, metrics, SeaweedFS), chosen outside the kernel's
ephemeral range.

A port the OS handed out for ``bind(0)`` and released may be handed out again at once, to any socket that
binds port 0 or connects (gloo's pairs, s3fs's connections, the emulators), before the test's server binds
it. A port below the ephemeral range is never handed out that way, so probing it free and binding it later
is safe from the rest of the suite's sockets. Where the kernel's range covers nearly every port, port 0's
choice is used as before.
"""

from __future__ import annotations

import random
import socket

_LOW = 10000  # below this, well-known services (and root-only ports below 1024)


def _ephemeral() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def _bindable(port: int) -> bool:
    with socket.socket() as s:  # no SO_REUSEADDR: a port with connections still closing is not free
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def free_ports(n: int = 1, consecutive: bool = False) -> list[int]:
    """``n`` distinct free ports outside the ephemeral range (``consecutive``: ``p, p+1, ..., p+n-1``)."""
    lo, hi = _ephemeral()
    spans = [(a, b) for a, b in ((_LOW, lo - 1), (hi + 1, 65535)) if b - a + 1 >= 100 * n]
    if not spans:  # the ephemeral range covers nearly every port: the OS's choice
        return _os_ports(n, consecutive)
    pick = random.SystemRandom()
    got: list[int] = []
    for _ in range(10000):
        a, b = pick.choice(spans)
        if consecutive:
            base = pick.randint(a, b - n + 1)
            if all(_bindable(p) for p in range(base, base + n)):
                return list(range(base, base + n))
        else:
            p = pick.randint(a, b)
            if p not in got and _bindable(p):
                got.append(p)
                if len(got) == n:
                    return got
    raise RuntimeError(f"no {n} free ports found outside the ephemeral range {lo}-{hi}")


def free_port() -> int:
    """One free port outside the ephemeral range."""
    return free_ports(1)[0]


def _os_ports(n: int, consecutive: bool) -> list[int]:
    while True:
        socks = [socket.socket() for _ in range(1 if consecutive else n)]
        try:
            for s in socks:
                s.bind(("127.0.0.1", 0))
            ports = [s.getsockname()[1] for s in socks]
        finally:
            for s in socks:
                s.close()
        if not consecutive:
            return ports
        base = ports[0]
        if base + n <= 65536 and all(_bindable(p) for p in range(base, base + n)):
            return list(range(base, base + n))
