"""Saves of an unchanged structure reuse their layout (file placement, manifest entries, typed views of the
RAM tier's reused buffers); the manager replays its previous DCP plan; restores of a matching target take a
fast path. These tests change the structure in every way a user can between saves, go back to earlier
structures, reuse buffers through the pool, run two stores and managers side by side in one process, damage
a byte under the fast verification path, and run a 2-process DCP job where one rank alone changes its
structure: every step restores bit for bit, with the right dtypes and shapes.

Nothing is mocked: real stores on fresh tmpfs directories (``shm_dir``), a real ``torch.nn`` model and
``AdamW`` state after real steps. Values differ from step to step, so stale bytes would be caught.
"""

from __future__ import annotations

import copy
import os
import re
import sys
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch

from tierfs import (CheckpointManager, ChecksumError, RestoreError, StateMismatchError, TieredStore)
from tierfs.core.layouts import MAX_LAYOUTS
from tierfs.format import step_dirname
from tierfs.policies import LatestN, PreserveAll
from tierfs.testing import assert_states_equal
from tierfs.tiers import MemoryTier, ObjectTier

HERE = Path(__file__).parent
CHILDREN = HERE / "children"
sys.path.insert(0, str(HERE))
import gloo_job  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


# ----------------------------------------------------------------------------------------- states


def trained(seed: int, extra_layer: bool = False) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A small model and its AdamW state after one real step; every value depends on ``seed``."""
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = [torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4)]
    if extra_layer:
        layers += [torch.nn.ReLU(), torch.nn.Linear(4, 6)]
    model = torch.nn.Sequential(*layers)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(seed + 7)
    model(torch.randn(3, 8, generator=g)).pow(2).sum().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def torch_form(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """The state a user hands the manager (DCP path): int keys, param_groups with tuples and all."""
    return {"model": model.state_dict(), "optim": opt.state_dict()}


def store_form(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """The same state as ``TieredStore.save`` takes it (string keys, JSON leaves)."""
    osd = opt.state_dict()
    return {"model": dict(model.state_dict()),
            "optim": {str(i): dict(s) for i, s in osd["state"].items()},
            "lr": osd["param_groups"][0]["lr"]}


#: the structures a run goes through, in order, then back to earlier ones (more than MAX_LAYOUTS ago too)
VARIANTS = ["base", "added", "removed", "transposed", "resized", "float64", "int32", "reordered", "numpy",
            "json_str", "base", "numpy", "json_str", "added", "base"]
assert MAX_LAYOUTS < 10, "the sequence goes back to structures more than MAX_LAYOUTS saves ago"


def variant(name: str, seed: int, form: Callable[..., dict[str, Any]]) -> dict[str, Any]:
    """A state of structure ``name`` whose values all depend on ``seed``."""
    model, opt = trained(seed, extra_layer=name == "added")
    state = form(model, opt)
    g = torch.Generator().manual_seed(seed + 13)
    x: Any = torch.randn(4, 8, generator=g)
    n: Any = seed
    if name == "transposed":  # the same bytes, another shape
        x = torch.randn(8, 4, generator=g)
    elif name == "resized":
        x = torch.randn(6, 8, generator=g)
    elif name == "float64":
        x = torch.randn(4, 8, generator=g, dtype=torch.float64)
    elif name == "int32":  # the same bytes, another dtype
        x = torch.randint(-(1 << 30), 1 << 30, (4, 8), generator=g, dtype=torch.int32)
    elif name == "numpy":  # the same dtype and shape, another library
        x = x.numpy()
    elif name == "json_str":
        n = f"epoch-{seed}"
    # a non-contiguous tensor and a bfloat16 one beside the probe
    state["probe"] = {"x": x, "n": n, "v": torch.randn(6, 10, generator=g)[:, ::2],
                      "h": torch.randn(3, 3, generator=g).to(torch.bfloat16)}
    if name == "removed":
        del state["probe"]["x"]
        del state["model"]["2.bias"]
    if name == "reordered":
        state = {"probe": dict(reversed(list(state["probe"].items()))), "optim": state["optim"],
                 "model": dict(reversed(list(state["model"].items())))}
    return state


def snapshot(state: Any) -> Any:
    """A deep copy sharing no memory with ``state``."""
    return copy.deepcopy(state)


def leaves(state: Any) -> list[Any]:
    """Every tensor and numpy array of a nested state."""
    if isinstance(state, dict):
        return [x for v in state.values() for x in leaves(v)]
    if isinstance(state, (list, tuple)):
        return [x for v in state for x in leaves(v)]
    return [state] if isinstance(state, (torch.Tensor, np.ndarray)) else []


def scribble(state: Any) -> None:
    """Change every value of ``state`` in place (training goes on right after a save)."""
    with torch.no_grad():
        for x in leaves(state):
            if isinstance(x, torch.Tensor):
                x.add_(1) if x.dtype != torch.bool else x.logical_not_()
            else:
                x += 1


def fqns(state: Any, prefix: str = "") -> dict[str, tuple[list[int], str]]:
    """DCP's flattened key of every tensor, with its size and dtype."""
    out: dict[str, tuple[list[int], str]] = {}
    for k, v in (state.items() if isinstance(state, dict) else enumerate(state)):
        if isinstance(v, torch.Tensor):
            out[f"{prefix}{k}"] = (list(v.shape), str(v.dtype).removeprefix("torch."))
        elif isinstance(v, dict) or (isinstance(v, list) and any(isinstance(x, torch.Tensor) for x in v)):
            out.update(fqns(v, f"{prefix}{k}."))
    return out


def dcp_tensors(store: TieredStore, step: int) -> dict[str, tuple[list[int], str]]:
    """The tensors (size, dtype) that the DCP metadata stored with ``step`` lists."""
    md = store.read_manifest(step, 0)[0].metadata["dcp"]["state_dict_metadata"]
    return {f: (m["size"], m["properties"]["dtype"]) for f, m in md.items()}


def same_objects(before: list[Any], after: list[Any]) -> None:
    """A restore in place kept every tensor and array object of the target."""
    assert len(before) == len(after) and all(a is b for a, b in zip(before, after))


# ----------------------------------------------------------------- 1. the structure changes between saves


@pytest.mark.parametrize("blocking", [True, False])
def test_store_saves_of_changing_structures_restore_bit_exact(shm_dir, blocking):
    saved: dict[int, tuple[str, dict]] = {}
    with TieredStore([MemoryTier(shm_dir, keep=PreserveAll())]) as store:
        for step, name in enumerate(VARIANTS, start=1):
            state = variant(name, step, store_form)
            saved[step] = (name, snapshot(state))
            assert store.save(step, state, blocking=blocking)
            scribble(state)  # the caller may change the state as soon as save returns
            state["probe"]["n"] = None
            store.wait_until_finished()
            check_store_step(store, step, *saved[step])
        for step, (name, want) in saved.items():  # later saves (reused layouts) left earlier steps alone
            check_store_step(store, step, name, want)


def check_store_step(store: TieredStore, step: int, name: str, want: dict) -> None:
    out, info = store.restore(step)
    assert info.step == step
    assert_states_equal(out, want, key_order=True)
    target = variant(name, 1000 + step, store_form)  # the same structure, other values
    objs = leaves(target)
    assert store.restore_into(target, step).step == step
    assert_states_equal(target, want, key_order=True)
    same_objects(objs, leaves(target))


@pytest.mark.parametrize("use_dcp", [None, False], ids=["dcp", "store"])
def test_manager_saves_of_changing_structures_restore_bit_exact(shm_dir, use_dcp):
    form = torch_form if use_dcp is None else store_form
    saved: dict[int, tuple[str, dict]] = {}
    with CheckpointManager([MemoryTier(shm_dir, keep=PreserveAll())], use_dcp=use_dcp) as mgr:
        for step, name in enumerate(VARIANTS, start=1):
            state = variant(name, step, form)
            saved[step] = (name, snapshot(state))
            assert mgr.save(step, state)  # asynchronous: returns once staged
            scribble(state)
            mgr.wait_until_finished()
            check_manager_step(mgr, step, *saved[step], dcp=use_dcp is None)
        for step, (name, want) in saved.items():
            check_manager_step(mgr, step, name, want, dcp=use_dcp is None)


def check_manager_step(mgr: CheckpointManager, step: int, name: str, want: dict, dcp: bool) -> None:
    if dcp:  # the DCP metadata stored with the step is this step's, not a replayed older one
        assert dcp_tensors(mgr.store, step) == fqns(want)
    assert_states_equal(mgr.restore(step=step), want)
    assert mgr.last_restore_info.step == step
    form = torch_form if dcp else store_form
    target = variant(name, 1000 + step, form)
    objs = leaves(target)
    assert mgr.restore(target, step=step) == step
    assert_states_equal(target, want)
    same_objects(objs, leaves(target))


def test_dcp_plan_is_replayed_only_for_the_same_structure(shm_dir):
    """Saves alternating between structures that differ only in a dtype, a shape or the order, with runs of
    the same structure in between (the replayed plan)."""
    seq = ["base", "base", "int32", "int32", "base", "transposed", "transposed", "reordered", "base", "base"]
    saved = {}
    with CheckpointManager([MemoryTier(shm_dir, keep=PreserveAll())]) as mgr:
        for step, name in enumerate(seq, start=1):
            state = variant(name, step, torch_form)
            saved[step] = (name, snapshot(state))
            assert mgr.save(step, state)
            scribble(state)
        mgr.wait_until_finished()
        for step, (name, want) in saved.items():
            check_manager_step(mgr, step, name, want, dcp=True)


# ------------------------------------------------------------------- 2. one structure, buffers reused


@pytest.mark.parametrize("blocking", [True, False])
def test_repeated_saves_of_one_structure_reuse_buffers_and_restore_bit_exact(shm_dir, blocking):
    saved = {}
    with TieredStore([MemoryTier(shm_dir, keep=LatestN(2))]) as store:
        for step in range(1, 15):
            state = variant("base", step, store_form)
            saved[step] = snapshot(state)
            assert store.save(step, state, blocking=blocking)
            scribble(state)
            store.wait_until_finished()
            check_store_step(store, step, "base", saved[step])
            if step == 4:
                check_store_step(store, 3, "base", saved[3])
            if step in (6, 10):  # delete the older kept step, and the newest once
                store.delete(step - 1 if step == 6 else step)
                assert sorted(store.steps()) == ([6] if step == 6 else [9])
                check_store_step(store, 6 if step == 6 else 9, "base", saved[6 if step == 6 else 9])
        assert sorted(store.steps()) == [13, 14]
        for step in (13, 14):
            check_store_step(store, step, "base", saved[step])
        assert store.tier("ram").stats()["reused"] >= 10, "the pool's buffers were reused"


EQUAL_FILES = {  # states spread over shard files of 4096 bytes each (file_size=4096), one entry per file
    "torch-torch": lambda step: {"a": torch.arange(1024, dtype=torch.float32) + step * 0.5,
                                 "b": torch.arange(1024, dtype=torch.int32) * 3 + step},
    "torch-numpy": lambda step: {"a": torch.arange(1024, dtype=torch.float32) + step * 0.5,
                                 "c": np.arange(512, dtype=np.float64) - step},
    "two-entries": lambda step: {"a": torch.arange(1024, dtype=torch.float32) + step * 0.5,
                                 "b": torch.arange(512, dtype=torch.int32) + step,
                                 "c": torch.arange(256, dtype=torch.float64) - step},
}


@pytest.mark.parametrize("kind", list(EQUAL_FILES))
def test_repeated_saves_with_shard_files_of_equal_size(shm_dir, kind):
    """A state spread over shard files of one size (small ``file_size``) whose entries differ (dtype, library,
    or how many share a file): the pool hands a deleted step's buffers to the next step by size, whichever
    of the step's files they held."""
    with TieredStore([MemoryTier(shm_dir, keep=LatestN(2))], file_size=4096) as store:
        for step in range(1, 13):
            want = EQUAL_FILES[kind](step)
            assert store.save(step, want)
            assert set(store.manifest(step).files.values()) == {4096}
            out, _ = store.restore(step)
            assert_states_equal(out, want)
        assert store.tier("ram").stats()["reused"] > 0


def test_restore_into_the_same_target_many_times_then_another_then_a_misfit(shm_dir):
    with TieredStore([MemoryTier(shm_dir, keep=PreserveAll())]) as store:
        for step in (1, 2, 3):
            store.save(step, variant("base", step, store_form))
        want = variant("base", 2, store_form)
        target = variant("base", 500, store_form)
        objs = leaves(target)
        for i in range(25):  # the same step into the same target: its views are cached
            scribble(target)
            target["probe"]["n"] = i
            assert store.restore_into(target, 2).step == 2
            assert_states_equal(target, want)
            same_objects(objs, leaves(target))
            if i % 5 == 4:  # another step in between
                assert store.restore_into(target, 3 if i % 10 == 4 else 1).step in (1, 3)
        other = variant("base", 501, store_form)  # a different object of the same structure
        assert store.restore_into(other, 2).step == 2
        assert_states_equal(other, want)

        # one tensor of another shape or dtype (the same number of bytes), late in key order or in the
        # middle: a StateMismatchError naming it, raised before anything is loaded (the target is unchanged)
        for bad_key, bad in (("probe/x", torch.zeros(8, 4)), ("model/2.weight", torch.zeros(16, 4)),
                             ("probe/x", torch.zeros(4, 8, dtype=torch.int32))):
            misfit = variant("base", 502, store_form)
            parent, leaf = (misfit["probe"], "x") if bad_key == "probe/x" else (misfit["model"], "2.weight")
            parent[leaf] = bad
            before = snapshot(misfit)
            with pytest.raises(StateMismatchError, match=re.escape(repr(bad_key))):
                store.restore_into(misfit, 2)
            assert_states_equal(misfit, before)
        assert store.restore_into(target, 2).step == 2  # still fine afterwards
        assert_states_equal(target, want)


# --------------------------------------------------------------------------- 3. two stores, one process


@pytest.mark.parametrize("blocking", [True, False])
def test_two_stores_in_one_process_never_share_layouts(shm_dir, blocking):
    dirs = [os.path.join(shm_dir, "a"), os.path.join(shm_dir, "b")]
    saved: list[dict[int, dict]] = [{}, {}]
    stores = [TieredStore([MemoryTier(d, keep=LatestN(3))]) for d in dirs]
    try:
        for step in range(1, 11):
            for i in (0, 1) if step % 2 else (1, 0):  # alternate, and alternate who goes first
                state = variant("base", step + 100 * i, store_form)  # one structure, other values
                saved[i][step] = snapshot(state)
                assert stores[i].save(step, state, blocking=blocking)
                scribble(state)
            for i in (0, 1):
                stores[i].wait_until_finished()
                check_store_step(stores[i], step, "base", saved[i][step])
        for i in (0, 1):
            assert sorted(stores[i].steps()) == [8, 9, 10]
            for step in (8, 9, 10):
                check_store_step(stores[i], step, "base", saved[i][step])
    finally:
        for s in stores:
            s.close()


def test_one_directory_opened_by_one_store_after_another(shm_dir):
    saved = {}
    for run in range(3):  # each run a new store on the same directory, same structure, other values
        with TieredStore([MemoryTier(shm_dir, keep=PreserveAll())]) as store:
            for step in range(3 * run + 1, 3 * run + 4):
                state = variant("base", step + 50 * run, store_form)
                saved[step] = snapshot(state)
                assert store.save(step, state)
                scribble(state)
            for step, want in saved.items():
                check_store_step(store, step, "base", want)


def test_two_managers_with_different_structures_alternate_through_dcp(shm_dir):
    names = ["base", "added"]
    saved: list[dict[int, dict]] = [{}, {}]
    mgrs = [CheckpointManager([MemoryTier(os.path.join(shm_dir, n), keep=PreserveAll())]) for n in names]
    try:
        for step in range(1, 7):
            for i in (0, 1):
                state = variant(names[i], step + 100 * i, torch_form)
                saved[i][step] = snapshot(state)
                assert mgrs[i].save(step, state)
                scribble(state)
        for i in (0, 1):
            mgrs[i].wait_until_finished()
            for step, want in saved[i].items():
                check_manager_step(mgrs[i], step, names[i], want, dcp=True)
    finally:
        for m in mgrs:
            m.close()


# ------------------------------------------------------------------------ 4. a damaged byte in RAM


def flip(root: str, step: int, manifest, key: str, at: int) -> None:
    """Flip one bit of byte ``at`` of entry ``key``'s bytes in its shard file of ``step`` under ``root``."""
    e = next(e for e in manifest.entries if e.name == key)
    assert at < e.length
    path = Path(root) / step_dirname(step) / e.file
    with open(path, "r+b") as f:
        f.seek(e.offset + at)
        b = f.read(1)
        f.seek(e.offset + at)
        f.write(bytes([b[0] ^ 0x10]))


@pytest.mark.parametrize("block_size,key", [(4 << 20, "model/0.weight"), (4 << 20, "probe/x"),
                                            (256, "model/0.weight")],
                         ids=["small", "small-probe", "multi-block"])
def test_damaged_byte_in_ram_is_caught_on_the_fast_path(shm_dir, block_size, key):
    with TieredStore([MemoryTier(shm_dir, keep=PreserveAll())], block_size=block_size) as store:
        for step in (1, 2):
            store.save(step, variant("base", step, store_form))
        want1, want2 = variant("base", 1, store_form), variant("base", 2, store_form)
        target = variant("base", 77, store_form)
        for _ in range(3):  # the read views of step 2 are made and kept
            store.restore_into(target, 2)
        assert_states_equal(target, want2)
        flip(shm_dir, 2, store.manifest(2), key, 100)
        with pytest.raises(ChecksumError, match="checksum mismatch"):
            store.verify(2, "ram")
        with pytest.raises(RestoreError, match="checksum mismatch"):
            store.restore_into(target, 2)
        with pytest.raises(RestoreError):
            store.restore(2)
        # without a step, the restore falls back to the newest step that verifies
        target = variant("base", 78, store_form)
        info = store.restore_into(target)
        assert info.step == 1 and [(t, s) for t, s, _ in info.skipped] == [("ram", 2)]
        assert "checksum mismatch" in info.skipped[0][2] and repr(key) in info.skipped[0][2]
        assert_states_equal(target, want1)


def test_damaged_byte_in_ram_is_served_from_the_object_tier(shm_dir, tmp_path):
    with TieredStore([MemoryTier(shm_dir, keep=PreserveAll()),
                      ObjectTier(f"file://{tmp_path}/obj", keep=PreserveAll())]) as store:
        for step in (1, 2):
            store.save(step, variant("base", step, store_form))
        store.wait_until_finished()
        assert store.steps() == {1: ["ram", "file"], 2: ["ram", "file"]}
        want = variant("base", 2, store_form)
        target = variant("base", 77, store_form)
        objs = leaves(target)
        store.restore_into(target, 2)
        for key in ("model/0.bias", "optim/1/exp_avg_sq"):
            flip(shm_dir, 2, store.manifest(2), key, 3)
            scribble(target)
            info = store.restore_into(target)
            assert info.step == 2 and info.tier == "file"
            assert [(t, s) for t, s, _ in info.skipped] == [("ram", 2)] and repr(key) in info.skipped[0][2]
            assert_states_equal(target, want)
            same_objects(objs, leaves(target))
            out, info = store.restore(2)
            assert info.tier == "file"
            assert_states_equal(out, want)
            flip(shm_dir, 2, store.manifest(2), key, 3)  # repaired: RAM serves again
            info = store.restore_into(target)
            assert info.tier == "ram" and info.skipped == []
            assert_states_equal(target, want)


# ------------------------------------------------------- 5. two processes, one rank changes structure


def test_one_rank_changing_structure_makes_every_rank_save_through_dcp(tmp_path, shm_dir):
    outs = gloo_job.run_job(2, CHILDREN / "structure_child.py", shm_dir, timeout=60)
    for o in outs:
        assert o["errors"] == {}, o
        assert o["restored"] == [1, 2, 3, 4, 5, 6, 7]
    # rank 0's manifest holds DCP's metadata: step 5 and 6 list rank 1's new tensor, the others do not
    meta = outs[0]["fqns"]
    for step in ("1", "2", "3", "4", "7"):
        assert sorted(meta[step]) == sorted(outs[0]["base_fqns"] + ["mine.r1"])
    for step in ("5", "6"):
        assert sorted(meta[step]) == sorted(outs[0]["base_fqns"] + ["mine.r1", "mine.extra1"])


# -- the reuse itself: planned once per structure ------------------------------------------------------
def test_a_layout_is_planned_once_per_structure_and_dcp_runs_only_when_it_changes(shm_dir, monkeypatch):
    """The fast paths are taken: the store plans a layout only for a structure it has not seen recently,
    and the manager calls dcp.save only when the structure changed (every save still restores bit-exact)."""
    import torch.distributed.checkpoint as dcp

    from tierfs.core.layout import ShardLayout as Layout

    plans, dcp_saves = [0], [0]
    real_plan, real_save = Layout.plan.__func__, dcp.save  # type: ignore[attr-defined]

    def counting_plan(cls, *args, **kwargs):
        plans[0] += 1
        return real_plan(cls, *args, **kwargs)

    def counting_save(*args, **kwargs):
        dcp_saves[0] += 1
        return real_save(*args, **kwargs)

    monkeypatch.setattr(Layout, "plan", classmethod(counting_plan))
    monkeypatch.setattr(dcp, "save", counting_save)
    model, opt = trained(0)
    with CheckpointManager([MemoryTier(shm_dir, keep=LatestN(2))]) as mgr:
        for step in range(4):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)
            mgr.save(step, torch_form(model, opt))
        mgr.wait_until_finished()
        assert dcp_saves[0] == 1 and plans[0] == 1, (dcp_saves, plans)
        bigger, bigger_opt = trained(1, extra_layer=True)
        mgr.save(4, torch_form(bigger, bigger_opt))
        mgr.wait_until_finished()
        assert dcp_saves[0] == 2 and plans[0] == 2, (dcp_saves, plans)
        target = torch_form(*trained(2))
        assert mgr.restore(target, step=3) == 3
        assert_states_equal(target, torch_form(model, opt))
