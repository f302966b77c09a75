"""The collector is off while tierfs makes its many short-lived objects, in the caller's save and in the
background work of a step: a full collection walks every object of the process and holds the GIL, so one
set off by a background thread stalls training. The pause is shared by every thread's blocks, and ends
(as the next block starts) once it has lasted ``nogc.LONGEST``, so the training loop's own garbage is
never left for long."""

from __future__ import annotations

import gc

import numpy as np
import pytest

from tierfs import TieredStore
from tierfs.testing import hooks
from tierfs.tiers import MemoryTier, ObjectTier
from tierfs.util import nogc


@pytest.fixture(autouse=True)
def collector_on():
    was = gc.isenabled()
    gc.enable()
    yield
    (gc.enable if was else gc.disable)()


def test_blocks_share_one_pause_and_the_collector_comes_back_after_the_last():
    with nogc.paused():
        assert not gc.isenabled()
        with nogc.paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()


def test_a_pause_past_its_longest_ends_when_the_next_block_starts(monkeypatch):
    monkeypatch.setattr(nogc, "LONGEST", 0.0)  # every pause is already too long when the next block starts
    with nogc.paused():  # (a long background copy)
        assert not gc.isenabled()
        with nogc.paused():  # (a save)
            assert gc.isenabled()
        assert gc.isenabled()
    assert gc.isenabled()
    with nogc.paused():  # a new pause
        assert not gc.isenabled()
    assert gc.isenabled()


def test_a_collector_the_program_turned_off_stays_off(monkeypatch):
    gc.disable()
    monkeypatch.setattr(nogc, "LONGEST", 0.0)
    with nogc.paused():
        with nogc.paused():
            assert not gc.isenabled()
    assert not gc.isenabled()


def test_a_steps_background_work_runs_with_the_collector_paused(shm_dir, tmp_path):
    seen: list[tuple[str, bool]] = []

    def note(stage, step, tier):
        if stage in ("checksum", "copy"):  # the commit worker's checksums, the copy worker's upload
            seen.append((stage, gc.isenabled()))
    state = {f"w{i}": np.full(1000, i, np.float32) for i in range(50)}
    with hooks.on("stage", note), TieredStore([MemoryTier(shm_dir), ObjectTier(f"file://{tmp_path}/o")]) as store:
        store.save(1, state, blocking=False)
        store.wait_until_finished()
    assert sorted(seen) == [("checksum", False), ("copy", False)], seen
    assert gc.isenabled()
