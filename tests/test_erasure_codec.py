"""The erasure code of the erasure-coded peer tier (tierfs/tiers/_erasure.py): bit-exact round trips for
parity 1 (XOR) and 2-3 (Reed-Solomon through pyeclib), every loss a code survives, odd and empty
lengths, buffers given with out=, and the errors for too few pieces and bad arguments."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from tierfs.errors import ArgumentError
from tierfs.tiers import _erasure

needs_pyeclib = pytest.mark.skipif(not _erasure.available(), reason="pyeclib is not installed")


def _stripe(d: int, n: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed + 1000 * d + n)
    return [rng.integers(0, 256, n, dtype=np.uint8) for _ in range(d)]


def _params(parities: tuple[int, ...]) -> list[object]:
    return [pytest.param(p, marks=needs_pyeclib) if p > 1 else p for p in parities]


@pytest.mark.parametrize("parity", _params((1, 2, 3)))
@pytest.mark.parametrize("d", [1, 2, 4, 8])
@pytest.mark.parametrize("n", [0, 1, 7, 8, 13, 4096, 70001])
def test_round_trip_worst_losses(parity: int, d: int, n: int) -> None:
    data = _stripe(d, n)
    par = _erasure.encode(data, parity)
    assert len(par) == parity and all(a.dtype == np.uint8 and a.shape == (n,) for a in par)
    lost = list(range(min(parity, d)))  # data pieces lost first: the most to rebuild
    pieces = {i: a for i, a in enumerate(data + par) if i not in lost}
    got = _erasure.decode(pieces, d, parity, list(range(d)))
    assert sorted(got) == list(range(d))
    for i in range(d):
        assert np.array_equal(got[i], data[i])


@pytest.mark.parametrize("parity", _params((1, 2, 3)))
@pytest.mark.parametrize("d", [1, 2, 3, 4])
def test_every_survivable_loss(parity: int, d: int) -> None:
    data = _stripe(d, 37, seed=parity)
    stripe = data + _erasure.encode(data, parity)
    for k in range(parity + 1):
        for lost in itertools.combinations(range(d + parity), k):
            pieces = {i: a for i, a in enumerate(stripe) if i not in lost}
            got = _erasure.decode(pieces, d, parity, list(range(d)))
            assert all(np.array_equal(got[i], data[i]) for i in range(d)), lost


def test_xor_is_numpy_reduce() -> None:
    for n in (0, 5, 64, 1 << 20 | 3, (3 << 20) + 8):
        data = _stripe(5, n)
        (par,) = _erasure.encode(data, 1)
        assert np.array_equal(par, np.bitwise_xor.reduce(np.stack(data), axis=0))


@pytest.mark.parametrize("parity", _params((1, 2)))
def test_blocks_and_out_buffers(parity: int, monkeypatch: pytest.MonkeyPatch) -> None:
    data = _stripe(3, 10_007)
    expected = _erasure.encode(data, parity)
    monkeypatch.setattr(_erasure, "RS_BLOCK", 1000)  # 10 blocks and a short last one
    monkeypatch.setattr(_erasure, "XOR_BLOCK", 1000)
    out = [np.full(10_007, 0xAA, np.uint8) for _ in range(parity)]
    got = _erasure.encode(data, parity, out=out)
    assert all(g is not None and np.shares_memory(g, o) for g, o in zip(got, out))
    assert all(np.array_equal(o, e) for o, e in zip(out, expected))
    pieces = {i: a for i, a in enumerate(data + expected) if i not in range(parity)}  # 0 (and 1) lost
    into = {0: np.zeros(10_007, np.uint8), 2: np.zeros(10_007, np.uint8)}
    back = _erasure.decode(pieces, 3, parity, [2, 0], out=into)
    assert list(back) == [2, 0]
    for i in (0, 2):
        assert np.shares_memory(back[i], into[i]) and np.array_equal(into[i], data[i])


def test_pieces_as_bytes_of_any_array() -> None:
    data = [np.arange(6, dtype=np.float32) + k for k in range(3)]  # 24 bytes each
    (par,) = _erasure.encode(data, 1)
    assert par.shape == (24,)
    got = _erasure.decode({1: data[1], 2: data[2], 3: par}, 3, 1, [0, 1])
    assert np.array_equal(got[0].view(np.float32), data[0])
    assert np.shares_memory(got[1], data[1])  # a wanted piece that was given comes back as it was


def test_too_few_pieces() -> None:
    data = _stripe(4, 16)
    (par,) = _erasure.encode(data, 1)
    with pytest.raises(ValueError, match=r"3 pieces given .*4 of the 5 needed"):
        _erasure.decode({1: data[1], 2: data[2], 4: par}, 4, 1, [0])
    # nothing to rebuild: the wanted pieces are there
    assert np.array_equal(_erasure.decode({1: data[1]}, 4, 1, [1])[1], data[1])


@needs_pyeclib
def test_too_few_pieces_rs() -> None:
    data = _stripe(4, 16)
    par = _erasure.encode(data, 2)
    with pytest.raises(ValueError, match=r"3 pieces given .*4 of the 6 needed"):
        _erasure.decode({2: data[2], 4: par[0], 5: par[1]}, 4, 2, [0, 1])


@pytest.mark.parametrize("data, parity, match", [
    (0, 1, "data must be an int >= 1, got 0"),
    (4, 0, "parity must be an int >= 1, got 0"),
    (4, -1, "parity must be an int >= 1"),
    (True, 1, "data must be an int >= 1, got True"),
    (4, 1.0, "parity must be an int >= 1, got 1.0"),
    (4, "2", "parity must be an int >= 1"),
    (250, 7, "data \\+ parity must be at most 256 .*got 250 \\+ 7"),
])
def test_check_parity(data: object, parity: object, match: str) -> None:
    with pytest.raises(ArgumentError, match=match):
        _erasure.check_parity(data, parity)


def test_check_parity_accepts() -> None:
    for d, p in [(1, 1), (4, 1), (4, 2), (8, 3), (255, 1), (np.int64(4), np.int32(2))]:
        _erasure.check_parity(d, p)


def test_bad_arguments() -> None:
    data = _stripe(3, 8)
    with pytest.raises(ArgumentError, match=r"one length in bytes, got lengths \[8, 9\]"):
        _erasure.encode(data + [np.zeros(9, np.uint8)], 1)
    with pytest.raises(ArgumentError, match="at least|data must be an int >= 1"):
        _erasure.encode([], 1)
    with pytest.raises(ArgumentError, match="must be a numpy array"):
        _erasure.encode([b"12345678"] * 2, 1)
    with pytest.raises(ArgumentError, match="out must hold 1 arrays"):
        _erasure.encode(data, 1, out=[])
    with pytest.raises(ArgumentError, match="writable C-contiguous numpy arrays of 8 bytes"):
        _erasure.encode(data, 1, out=[np.zeros(7, np.uint8)])
    with pytest.raises(ArgumentError, match="must not overlap"):
        _erasure.encode(data, 1, out=[data[1]])
    (par,) = _erasure.encode(data, 1)
    with pytest.raises(ArgumentError, match="piece indices must be from 0 to 3"):
        _erasure.decode({0: data[0], 1: data[1], 4: par}, 3, 1, [2])
    with pytest.raises(ArgumentError, match="want must be data piece indices from 0 to 2"):
        _erasure.decode({0: data[0], 1: data[1], 3: par}, 3, 1, [3])
    with pytest.raises(ArgumentError, match="out may only hold wanted pieces"):
        _erasure.decode({0: data[0], 1: data[1], 3: par}, 3, 1, [2], out={1: np.zeros(8, np.uint8)})


def test_missing_library_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    _erasure._driver.cache_clear()
    monkeypatch.setitem(sys.modules, "pyeclib", None)  # import pyeclib raises ImportError
    monkeypatch.setitem(sys.modules, "pyeclib.ec_iface", None)
    try:
        with pytest.raises(ArgumentError, match=r"needs the pyeclib package: pip install 'tierfs\[erasure\]"):
            _erasure.encode(_stripe(2, 8), 2)
        assert not _erasure.available()
        (par,) = _erasure.encode(_stripe(2, 8), 1)  # XOR needs no library
    finally:
        _erasure._driver.cache_clear()
