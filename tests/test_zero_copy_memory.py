"""The memory of a process saving to a RAM tier stays flat while another process holds zero-copy views of it,
and goes at close; the views keep their bytes (tests/children/zero_copy_memory_child.py). What a save or a
restore handled goes when the caller drops it, by reference counting alone."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path
from typing import Any

import pytest

from tierfs import TieredStore
from tierfs.policies import LatestN
from tierfs.tiers import MemoryTier, ObjectTier

from _commandchild import CommandChild
from zero_copy_memory_child import STATE_BYTES, state_for

CHILD = Path(__file__).parent / "children" / "zero_copy_memory_child.py"
#: one state: noise (page tables, caches, an allocator without ``malloc_trim``) stays well under it, and a
#: store that kept each saved state would grow by eleven
SLACK = STATE_BYTES


class Child(CommandChild):
    """tests/children/zero_copy_memory_child.py in one role over ``ram``, started: its first answer comes once it
    is ready, then one JSON answer per command."""

    def __init__(self, ram: Path, role: str) -> None:
        super().__init__(CHILD.name, str(ram), role)


def total(m: dict[str, int]) -> int:
    """Anonymous memory and the tier's mappings together."""
    return m["anon"] + m["shmem"]


def test_the_writers_memory_stays_flat_beside_a_zero_copy_reader_and_goes_at_close(shm_dir):
    ram = Path(shm_dir) / "ram"
    writer, reader = Child(ram, "writer"), Child(ram, "reader")  # both start at once
    try:
        start = writer.answer()["memory"]
        assert reader.answer() == {"ready": True}
        warm = writer.ask("save 1 3")  # two steps kept and a spare set pooled: the tier's steady state
        assert warm["alive"] == 0
        base = warm["memory"]
        assert reader.ask("restore") == {"step": 3}
        after = [writer.ask("save 4 8")]  # step 3, leased by the reader, is deleted under its views
        assert reader.ask("restore") == {"step": 8}
        assert reader.ask("check") == {"same": [True, True]}
        after.append(writer.ask("save 9 14"))  # and step 8
        assert reader.ask("check") == {"same": [True, True]}
        for got in after:
            assert got["alive"] == 0, "the store kept saved states alive after save returned"
            m = got["memory"]
            assert total(m) - total(base) < SLACK, f"the writer grew by {total(m) - total(base)} bytes: {base} -> {m}"
            assert m["maps"] <= base["maps"] and m["deleted"] == 0, "the writer kept mappings of deleted files"
            # the steps kept and one spare set: the reader's steps left the directory (their pages are its own)
            assert got["tier_bytes"] <= 3 * STATE_BYTES + (1 << 20)
        closed = writer.ask("close")["memory"]
        assert closed["maps"] == 0 and closed["shmem"] < (4 << 20), closed
        assert closed["anon"] - start["anon"] < SLACK, f"still held after close: {start} -> {closed}"
        writer.close()
        assert reader.ask("check") == {"same": [True, True]}
        reader.close()
    finally:
        writer.kill()
        reader.kill()


def test_what_a_save_was_given_goes_when_the_caller_drops_it_without_the_collector(shm_dir):
    """Reference counting alone frees a saved state and a restored one: no cycle of the save or restore path
    holds them until the garbage collector next runs."""
    ram = Path(shm_dir) / "ram"
    with TieredStore([MemoryTier(ram, keep=LatestN(2)), ObjectTier(f"file://{shm_dir}/object")]) as store:
        store.save(1, state_for(1))
        store.wait_until_finished()
        gc.collect()
        gc.disable()
        try:
            left = []
            for step in range(2, 6):
                state = state_for(step)
                arrays = [weakref.ref(state["model"]["w"]), weakref.ref(state["opt"]["m"])]
                store.save(step, state)
                del state
                store.wait_until_finished()
                for zero_copy in (False, True):
                    out, _ = store.restore(zero_copy=zero_copy)
                    arrays += [weakref.ref(out["model"]["w"]), weakref.ref(out["opt"]["m"])]
                    del out
                left += [step for a in arrays if a() is not None]
            assert left == [], f"arrays of steps {sorted(set(left))} outlived their last reference"
        finally:
            gc.enable()


@pytest.mark.parametrize("use_dcp", [True, False], ids=["dcp", "store-format"])
def test_what_the_manager_saves_and_restores_into_goes_with_the_callers_last_reference(shm_dir, use_dcp):
    """The same through ``CheckpointManager``: a model's and optimizer's tensors saved (a new structure, then
    one saved before) and restored into are freed by reference counting alone."""
    import torch

    from tierfs import CheckpointManager, CheckpointManagerOptions

    def model_state() -> tuple[dict[str, Any], list[Any]]:
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
        opt = torch.optim.AdamW(model.parameters())
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        state = {"model": model.state_dict(), "optim": opt.state_dict(), "epoch": 3}
        return state, [weakref.ref(t) for t in model.state_dict().values()]

    opts = CheckpointManagerOptions(enable_async_checkpointing=False)
    with CheckpointManager([MemoryTier(Path(shm_dir) / "ram")], use_dcp=use_dcp, options=opts) as mgr:
        gc.collect()
        gc.disable()
        try:
            left = []
            for step in (1, 2, 3):
                state, refs = model_state()
                assert mgr.save(step, state)
                del state
                target, more = model_state()
                assert mgr.restore(target) == step
                del target
                left += [step for r in refs + more if r() is not None]
            assert left == [], f"tensors of steps {sorted(set(left))} outlived their last reference"
        finally:
            gc.enable()
