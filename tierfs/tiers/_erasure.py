"""The erasure code of the erasure-coded peer tier: ``parity`` pieces from ``data`` equal-length pieces,
and lost data pieces rebuilt from any ``data`` of the ``data + parity``. Systematic: pieces ``0 ..
data-1`` are the data. One parity piece is their XOR (numpy); more are Reed-Solomon over GF(2^8), Cauchy
matrix, by ISA-L through pyeclib (``pip install 'tierfs[erasure]'``; its Linux wheels bundle ISA-L),
imported on first use. Pieces go in blocks (:data:`XOR_BLOCK`, :data:`RS_BLOCK` bytes of each) that stay
in cache. Arrays are read as their bytes; ``out=`` arrays are written in place."""

from __future__ import annotations

import functools
from typing import Any, Mapping, Sequence

import numpy as np
from numpy.typing import NDArray

from ..util import args as _args
from ..errors import ArgumentError

MAX_PIECES = 256  #: the most pieces (data + parity) of a stripe: Reed-Solomon over GF(2^8) has 256
#: bytes of each piece XORed per step (1 MiB: ~10-40% faster than whole 64-256 MiB pieces)
XOR_BLOCK = 1 << 20
#: bytes of each piece per call into pyeclib, which copies a block a few times and allocates its results:
#: 256 KiB keeps them in cache (whole 64-256 MiB pieces measured 3-10 times slower; bench_codecs.py)
RS_BLOCK = 256 << 10
#: pyeclib's code: ISA-L's Reed-Solomon with a Cauchy matrix (MDS at any counts; ISA-L's Vandermonde is not)
EC_TYPE = "isa_l_rs_cauchy"
INSTALL = "pip install 'tierfs[erasure]' (or pyeclib)"

U8 = NDArray[np.uint8]
Arrays = Sequence["np.ndarray[Any, Any]"]


def check_parity(data: int, parity: int) -> None:
    """Refuse a bad code (ArgumentError): ``data``, ``parity`` >= 1, at most :data:`MAX_PIECES` together."""
    d, p = _args.integer(data, "data"), _args.integer(parity, "parity")
    if d + p > MAX_PIECES:
        raise ArgumentError(f"data + parity must be at most {MAX_PIECES} (Reed-Solomon over GF(2^8)), "
                            f"got {d} + {p}: use fewer nodes per group")


def available() -> bool:
    """Whether parity >= 2 works here: pyeclib is installed, with ISA-L."""
    try:
        return _driver(1, 1) is not None
    except ArgumentError:
        return False


def encode(data: Arrays, parity: int, *, out: Arrays | None = None) -> list[U8]:
    """The ``parity`` parity pieces of ``data``: pieces ``len(data) ..`` of the stripe.

    Parameters
    ----------
    data : sequence of numpy arrays
        The data pieces, at least one, read as bytes: all of one length in bytes.
    parity : int
        1 (the XOR of the data) or more (Reed-Solomon: needs pyeclib).
    out : sequence of ``parity`` numpy arrays, optional
        Where to write them: writable, C-contiguous, the data's length in bytes, overlapping no data.

    Returns
    -------
    list of numpy uint8 arrays
        The parity pieces (byte views of ``out`` when given). Bad counts, lengths or ``out``, and parity
        >= 2 without pyeclib, raise :class:`~tierfs.errors.ArgumentError` (a ValueError).
    """
    pieces = [_bytes(a, f"data[{i}]") for i, a in enumerate(data)]
    if not pieces:
        raise ArgumentError("data must hold at least one piece, got none")
    check_parity(d := len(pieces), parity)
    n = _length(pieces, "data pieces")
    outs = _outs(out, parity, n, pieces)
    if parity == 1:
        _xor_into(outs[0], pieces)
        return outs
    for s in range(0, n, RS_BLOCK):
        size = min(RS_BLOCK, n - s)
        frags = _driver(d, parity).encode(b"".join([a[s:s + size].data for a in pieces]))
        for o, f in zip(outs, frags[d:]):
            o[s:s + size] = _payload(f, size)
    return outs


def decode(pieces: Mapping[int, np.ndarray[Any, Any]], data: int, parity: int, want: Sequence[int], *,
           out: Mapping[int, np.ndarray[Any, Any]] | None = None) -> dict[int, U8]:
    """The data pieces ``want`` of a stripe, from the pieces left of it.

    Parameters
    ----------
    pieces : mapping of int to numpy array
        Pieces by index (``0 .. data+parity-1``), read as bytes, all of one length: at least ``data`` of
        them, unless every wanted piece is among them.
    data, parity : int
        The stripe's code, as it was encoded.
    want : sequence of int
        The data pieces to return (indices below ``data``).
    out : mapping of int to numpy array, optional
        Where to write some or all wanted pieces (as for :func:`encode`'s ``out``).

    Returns
    -------
    dict of int to numpy uint8 array
        Each wanted piece, in ``want``'s order: in ``out[i]`` when given, else as given (a byte view) or
        new. Too few pieces (the message says how many were given and needed), bad indices, lengths or
        ``out``, and parity >= 2 without pyeclib, raise :class:`~tierfs.errors.ArgumentError`.
    """
    check_parity(data, parity)
    have = {int(i): _bytes(a, f"pieces[{i}]") for i, a in pieces.items()}
    if any(not 0 <= i < data + parity for i in have):
        raise ArgumentError(f"piece indices must be from 0 to {data + parity - 1}, got {sorted(have)}")
    wanted = list(dict.fromkeys(int(w) for w in want))
    if any(not 0 <= w < data for w in wanted):
        raise ArgumentError(f"want must be data piece indices from 0 to {data - 1}, got {list(want)}")
    missing = sorted(w for w in wanted if w not in have)  # pyeclib rebuilds them in this order
    if missing and len(have) < data:
        raise ArgumentError(f"cannot rebuild data pieces {missing}: {len(have)} pieces given "
                            f"({sorted(have)}), {data} of the {data + parity} needed")
    n = _length(list(have.values()), "pieces")
    if out and set(out) - set(wanted):
        raise ArgumentError(f"out may only hold wanted pieces {wanted}, got {sorted(out)}")
    into = [w for w in wanted if out and w in out]
    outs = dict(zip(into, _outs([out[w] for w in into] if out else [], len(into), n, list(have.values()))))
    got = {w: outs[w] if w in outs else np.empty(n, np.uint8) for w in missing}
    if missing and parity == 1:
        _xor_into(got[missing[0]], list(have.values()))  # the other data pieces and the parity
    elif missing:
        use, driver = sorted(have)[:data], _driver(data, parity)
        for s in range(0, n, RS_BLOCK):
            size = min(RS_BLOCK, n - s)
            heads = _headers(data, parity, size)
            frags = [heads[i] + have[i][s:s + size].data for i in use]
            for w, f in zip(missing, driver.reconstruct(frags, list(missing))):
                got[w][s:s + size] = _payload(f, size)
    for w in set(wanted) & set(outs) - set(got):
        np.copyto(outs[w], have[w])
    return {w: got[w] if w in got else outs.get(w, have[w]) for w in wanted}


def _bytes(a: Any, what: str) -> U8:
    if not isinstance(a, np.ndarray):
        raise ArgumentError(f"{what} must be a numpy array, got {_args.shown(a)}")
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8)


def _length(pieces: list[U8], what: str) -> int:
    if len(lengths := sorted({a.size for a in pieces})) > 1:
        raise ArgumentError(f"{what} must all have one length in bytes, got lengths {lengths}")
    return lengths[0] if lengths else 0


def _outs(out: Arrays | None, count: int, n: int, inputs: list[U8]) -> list[U8]:
    if out is None:
        return [np.empty(n, np.uint8) for _ in range(count)]
    if len(out) != count:
        raise ArgumentError(f"out must hold {count} arrays, got {len(out)}")
    for o in out:
        if not (isinstance(o, np.ndarray) and o.flags.c_contiguous and o.flags.writeable and o.nbytes == n):
            raise ArgumentError(f"out arrays must be writable C-contiguous numpy arrays of {n} bytes, "
                                f"got {_args.shown(o)}")
        if any(np.may_share_memory(o, a) for a in inputs):
            raise ArgumentError("out arrays must not overlap the pieces they are computed from")
    return [o.reshape(-1).view(np.uint8) for o in out]


def _xor_into(acc: U8, pieces: list[U8]) -> None:
    """``acc`` = the XOR of ``pieces``, a block at a time: 8 bytes a step, the last ``n % 8`` one a step.
    The first two pieces are XORed straight into ``acc`` (no copy of the first: one pass less)."""
    whole = (n := acc.size) - n % 8
    for s in range(0, n, XOR_BLOCK):
        e = min(n, s + XOR_BLOCK)
        for lo, hi, dt in ((s, min(e, whole), np.uint64), (max(s, whole), e, np.uint8)):
            if lo < hi:
                o, first = acc[lo:hi].view(dt), pieces[0][lo:hi].view(dt)
                if len(pieces) == 1:
                    np.copyto(o, first)
                    continue
                np.bitwise_xor(first, pieces[1][lo:hi].view(dt), out=o)
                for a in pieces[2:]:
                    np.bitwise_xor(o, a[lo:hi].view(dt), out=o)


def _payload(fragment: bytes, size: int) -> U8:
    """A pyeclib fragment's piece: its last ``size`` bytes, after the fragment's header."""
    return np.frombuffer(fragment, np.uint8, count=size, offset=len(fragment) - size)


@functools.lru_cache(maxsize=None)
def _driver(data: int, parity: int) -> Any:
    try:
        from pyeclib.ec_iface import ECDriver
    except ImportError as e:
        raise ArgumentError(f"parity >= 2 needs the pyeclib package: {INSTALL} ({e})") from None
    try:
        return ECDriver(k=data, m=parity, ec_type=EC_TYPE)
    except Exception as e:  # ECBackendNotAvailable and the like: a pyeclib built without ISA-L
        raise ArgumentError(f"pyeclib cannot use ISA-L ({EC_TYPE}: {e}): install its wheel, which bundles "
                            f"ISA-L ({INSTALL})") from None


@functools.lru_cache(maxsize=64)
def _headers(data: int, parity: int, size: int) -> tuple[bytes, ...]:
    """The headers pyeclib puts before pieces of ``size`` bytes, by index: they depend on the code and the
    size only (no checksums are asked for), so pieces of any stripe are handed back with them."""
    return tuple(f[:len(f) - size] for f in _driver(data, parity).encode(bytes(data * size)))
