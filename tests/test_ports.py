"""The tests' port helper: ports for servers a test starts lie outside the kernel's ephemeral range (where
a socket binding port 0 or connecting could take one between the probe and the server's bind), and are
free."""

import socket

from _ports import _bindable, _ephemeral, free_port, free_ports


def test_ports_lie_outside_the_ephemeral_range_and_can_be_bound():
    lo, hi = _ephemeral()
    ports = free_ports(6)
    assert len(set(ports)) == 6
    base = free_ports(3, consecutive=True)
    assert base == list(range(base[0], base[0] + 3))
    for p in [*ports, *base, free_port()]:
        assert not lo <= p <= hi, (p, lo, hi)
        with socket.socket() as s:
            s.bind(("", p))


def test_a_port_in_use_is_not_free():
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        s.listen()
        assert not _bindable(port)
    assert _bindable(port)
