"""The conformance suite every tier passes: subclass :class:`TierTests` for your backend.

    import pytest
    from tierfs.testing import TierTests

    class TestMyTier(TierTests):
        @pytest.fixture
        def make_tier(self, tmp_path):
            return lambda **kw: MyTier(tmp_path / "tier", **kw)

pytest collects the subclass (its name starts with ``Test``) and runs every test below against it. tierfs
runs it for the RAM tier and the object tier on memory://, file://, S3 (moto) and GCS (an emulator).
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import numpy as np
import pytest

from ..errors import FormatError
from ..format import MARKER, Manifest, Marker, manifest_filename
from ..store import TieredStore
from ..tiers import Capacity, MemoryTier, Tier
from ..tiers.capabilities import staging
from .states import assert_states_equal

__all__ = ["TierTests"]

#: ``make_tier(**kw) -> Tier``: a new, unopened tier; every call points at the same place
MakeTier = Callable[..., Tier]


class TierTests:
    """Tests every :class:`~tierfs.tiers.Tier` passes: its primitives (list, size, write, read, ranged
    read, marker, delete), validated file names, and a :class:`~tierfs.TieredStore` over it (a bit-exact
    round trip, the marker and manifest it wrote, a copy to it from a RAM tier).

    Subclass it with a name starting with ``Test`` and override the :meth:`make_tier` fixture; nothing
    else is needed. The subclass may add tests of its own, and use pytest marks on the class.

    Notes
    -----
    The store tests save tensors and skip where torch is not installed. Each test gets fresh fixtures:
    ``make_tier`` must point at an empty place each time it is set up.
    """

    @pytest.fixture
    def make_tier(self) -> MakeTier:
        """The backend under test: a factory of tiers, overridden by every subclass.

        Returns
        -------
        Callable[..., Tier]
            ``make_tier(**kw)``: a new, unopened tier. Every call of one fixture instance must return a
            tier on the same place (a directory, a bucket prefix), empty when the fixture is set up.
            ``kw`` are passed to the tier's constructor: ``name`` (a label), ``save`` and ``keep``
            (policies), as :class:`~tierfs.tiers.Tier` takes them.

        Notes
        -----
        Being a fixture, it can use others (``tmp_path``, servers) and clean up after a ``yield``.
        """
        raise NotImplementedError(f"{type(self).__name__} must override the make_tier fixture: "
                                  "@pytest.fixture def make_tier(self, tmp_path): return lambda **kw: MyTier(...)")

    @pytest.fixture
    def tier(self, make_tier: MakeTier) -> Iterator[Tier]:
        """An opened tier of the backend, closed after the test."""
        t = make_tier()
        t.open()
        yield t
        t.close()

    # -- the primitives -----------------------------------------------------------------------------
    def test_empty_tier_lists_nothing(self, tier: Tier) -> None:
        assert tier.list_steps() == {}
        assert tier.committed_steps() == []
        assert isinstance(tier.capacity(), Capacity)

    def test_files_round_trip_and_commit(self, tier: Tier) -> None:
        rng = np.random.default_rng(1)
        # gcp-storage-emulator drops a trailing b"\r" of small uploads (real GCS does not): end with \x00.
        files = {"rank_00000.0000.bin": rng.bytes(3 << 20), "rank_00000.0001.bin": rng.bytes(999) + b"\x00",
                 "rank_00000.0002.bin": b""}
        _fill(tier, 7, files)
        tier.write_file(7, "rank_00000.manifest.json", b'{"x": 1}')
        assert tier.list_steps() == {7: False}, "a step without its marker is not committed"
        tier.write_marker(7, b"marker")
        assert tier.list_steps() == {7: True}
        assert tier.committed_steps() == [7]
        sizes = tier.file_sizes(7)
        assert sizes == {**{n: len(b) for n, b in files.items()}, "rank_00000.manifest.json": 8, MARKER: 6}
        for n, b in files.items():
            assert bytes(tier.read_file(7, n)) == b
        got = tier.read_files(7, list(files))
        assert {n: bytes(v) for n, v in got.items()} == files
        big = files["rank_00000.0000.bin"]
        assert tier.read_range(7, "rank_00000.0000.bin", 12345, 2 << 20) == big[12345:2 << 20]
        # what a rank confirms before its marker: its own files, only those asked for, a missing one left out
        _fill(tier, 7, {"rank_00001.0000.bin": b"other rank"})
        asked = ["rank_00000.0001.bin", "rank_00000.0002.bin", "rank_00000.0009.bin", "rank_00000.manifest.json"]
        assert tier.sizes_of(7, asked) == {"rank_00000.0001.bin": 1000, "rank_00000.0002.bin": 0,
                                           "rank_00000.manifest.json": 8}
        assert tier.sizes_of(7, [MARKER]) == {MARKER: 6}

    def test_steps_sort_and_delete(self, tier: Tier) -> None:
        for s in (3, 12, 100):
            _fill(tier, s, {"rank_00000.0000.bin": bytes([s]) * 100})
            tier.write_marker(s, b"m")
        _fill(tier, 200, {"rank_00000.0000.bin": b"partial"})
        assert tier.list_steps() == {3: True, 12: True, 100: True, 200: False}
        tier.delete_step(12)
        tier.delete_step(200)
        assert tier.list_steps() == {3: True, 100: True}
        with pytest.raises(FileNotFoundError):
            tier.read_file(12, "rank_00000.0000.bin")

    def test_names_are_validated(self, tier: Tier) -> None:
        for bad in ("../escape", "/etc/passwd", "a/b", "..", ".hidden", ""):
            with pytest.raises(FormatError):
                tier.write_file(1, bad, b"x")
            with pytest.raises(FormatError):
                staging(tier).buffers(1, {bad: 1})
        with pytest.raises(FormatError):
            tier.write_file(-1, "ok.bin", b"x")

    def test_missing_file_raises_file_not_found(self, tier: Tier) -> None:
        _fill(tier, 1, {"rank_00000.0000.bin": b"abc"})
        with pytest.raises(FileNotFoundError):
            tier.read_file(1, "rank_00000.0001.bin")

    # -- a store over the tier ----------------------------------------------------------------------
    def test_store_round_trip_bit_exact(self, make_tier: MakeTier) -> None:
        with TieredStore([make_tier()], file_size=1 << 20, block_size=64 << 10) as store:
            state = _state(0)
            store.save(5, state, metadata={"lr": 3e-4})
            store.wait_until_finished()
            assert store.steps() == {5: [store.tiers[0].name]}
            out, info = store.restore()
            assert info.step == 5 and info.tier == store.tiers[0].name and info.metadata == {"lr": 3e-4}
            # bytes come back as a uint8 array
            assert_states_equal({**state, "blob": state["blob"]}, {**out, "blob": out["blob"].tobytes()})
            target = _unlike(state)
            for _, saved, other in _leaves(state, target):  # so the restore must write every one
                if _has_content(saved):
                    with pytest.raises(AssertionError):
                        assert_states_equal(saved, other)
            info = store.restore_into(target)
            blob = target["blob"]
            assert_states_equal(state, {**target, "blob": blob.tobytes() if isinstance(blob, np.ndarray) else blob})

    def test_marker_and_manifest_are_what_the_store_wrote(self, make_tier: MakeTier) -> None:
        with TieredStore([make_tier()]) as store:
            store.save(2, {"x": np.arange(1000, dtype=np.float32)})
            t = store.tiers[0]
            assert isinstance(t, Tier)
            marker = t.read_marker(2)
            assert isinstance(marker, Marker) and marker.step == 2 and marker.world_size == 1
            m = Manifest.from_bytes(bytes(t.read_file(2, manifest_filename(0))))
            assert [e.name for e in m.entries] == ["x"] and m.entries[0].length == 4000

    def test_copy_between_tiers(self, make_tier: MakeTier, tmp_path: Any) -> None:
        with TieredStore([MemoryTier(str(tmp_path / "ram")), make_tier(name="target")]) as store:
            state = _state(3)
            store.save(1, state)
            store.wait_until_finished()
            assert store.steps() == {1: ["ram", "target"]}
            out, info = store.restore(tiers=["target"])
            assert info.tier == "target"
            assert_states_equal({k: v for k, v in state.items() if k != "blob"},
                                {k: v for k, v in out.items() if k != "blob"})


def _fill(tier: Tier, step: int, files: dict[str, bytes]) -> None:
    """A step's files written as the store writes them: staged (in the tier's own buffers where it has
    them), then persisted."""
    stage = staging(tier)
    bufs = stage.buffers(step, {n: len(b) for n, b in files.items()})
    for n, b in files.items():
        bufs[n][:] = np.frombuffer(b, dtype=np.uint8)
    stage.persist(step)


def _state(seed: int) -> dict[str, Any]:
    """Every kind of leaf: float, bfloat16 and int tensors, numpy arrays (bool, empty), bytes, scalars."""
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    return {
        "model": {"w": torch.randn(256, 300, generator=g), "b": torch.randn(7, generator=g).to(torch.bfloat16),
                  "i": torch.arange(10, dtype=torch.int64)},
        "opt.exp_avg": rng.standard_normal((513, 9)).astype(np.float32),
        "mask": rng.integers(0, 2, 33).astype(bool),
        "empty": np.zeros((0, 4), np.float64),
        "blob": b"\x00\x01binary\xff",
        "lr": 3e-4, "name": "run", "epoch": 4,
    }


def _unlike(x: Any) -> Any:
    """A state of the same structure, types, dtypes and shapes as ``x`` whose every leaf differs from
    ``x``'s in every element (every byte of an array flipped); an empty array is copied."""
    if isinstance(x, dict):
        return {k: _unlike(v) for k, v in x.items()}
    if isinstance(x, np.ndarray):
        if x.dtype == bool:
            return ~x
        y = x.copy()
        y.reshape(-1).view(np.uint8)[:] ^= 0xFF
        return y
    if isinstance(x, bytes):
        return bytes(255 - c for c in x)
    if isinstance(x, bool):
        return not x
    if isinstance(x, (int, float)):
        return x + 1
    if isinstance(x, str):
        return x + "~"
    import torch

    if isinstance(x, torch.Tensor):
        if x.dtype == torch.bool:
            return ~x
        t = x.clone()
        if t.numel():
            t.reshape(-1).view(torch.uint8).bitwise_not_()
        return t
    raise TypeError(f"no differing value for a {type(x).__name__}")


def _leaves(a: Any, b: Any, path: str = "") -> Iterator[tuple[str, Any, Any]]:
    """``(key path, leaf of a, leaf of b)`` of two states of the same structure."""
    if isinstance(a, dict):
        for k in a:
            yield from _leaves(a[k], b[k], f"{path}[{k!r}]")
    else:
        yield path, a, b


def _has_content(x: Any) -> bool:
    size = getattr(x, "size", None)
    n = x.numel() if hasattr(x, "numel") else (size if isinstance(size, int) else 1)
    return n > 0
