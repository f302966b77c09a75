"""CheckpointManager through DCP: torch states are saved with dcp.save + TieredWriter and restored with
dcp.load + TieredReader; their non-tensor values are stored beside them without pickle."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tierfs import CheckpointManager, CheckpointManagerOptions, TieredStore
from tierfs.adapters.dcp import META_KEY, SHARD_KEY
from tierfs.errors import StateMismatchError
from tierfs.format import step_dirname
from tierfs.format.keys import key
from tierfs.policies import (AnySavePolicy, BestN, FixedIntervalPolicy, LatestN, PreemptionCheckpointingPolicy,
                             RestorePolicy)
from tierfs.testing import assert_states_equal
from tierfs.tiers import MemoryTier, ObjectTier

HERE = Path(__file__).parent
CHILDREN = HERE / "children"
sys.path.insert(0, str(HERE))
import gloo_job  # noqa: E402
from dcp_child import make_state  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


def full_state(seed: int) -> dict:
    """A model's state_dict and Adam's state (int keys, tuples in param_groups) plus every other kind of leaf."""
    s = make_state(seed, 3)
    s["extra"] = {"epoch": seed, "blob": b"\x00tier\xff", "betas": (0.9, 0.999), "best": float("inf"),
                  "none": None, "order": np.arange(6, dtype=np.int16) + seed, "scale": np.float32(0.5 + seed),
                  "by_id": {3: "three", 4: [1, 2]}, "names": ["a", "b"]}
    return s


def fresh() -> dict:
    """The same structure with other values (what a new process builds before restoring)."""
    s = full_state(1)
    for t in _tensors(s):
        t.zero_()
    s["extra"] = {"epoch": -1, "blob": b"", "betas": None, "best": 0.0, "none": 1,
                  "order": np.zeros(6, np.int16), "scale": np.float32(0), "by_id": {3: None, 4: None}, "names": None}
    return s


def _tensors(x):
    if isinstance(x, dict):
        for v in x.values():
            yield from _tensors(v)
    elif isinstance(x, torch.Tensor):
        yield x


def tiers(shm, tmp_path, ram_every=1, obj_every=2, obj_save=None, keep=None):
    return [MemoryTier(shm, save=FixedIntervalPolicy(ram_every), keep=keep or LatestN(3)),
            ObjectTier(f"file://{tmp_path}/obj", save=obj_save or FixedIntervalPolicy(obj_every))]


def test_model_and_adam_round_trip_through_dcp_bit_exact(shm_dir, tmp_path):
    with CheckpointManager(tiers(shm_dir, tmp_path)) as mgr:
        want = full_state(7)
        assert mgr.save(2, want, metrics={"loss": 0.25})
        mgr.wait_until_finished()
        assert mgr.store.steps() == {2: ["ram", "file"]}
        manifest = mgr.store.manifest(2)
        assert META_KEY in manifest.metadata and SHARD_KEY in manifest.metadata  # a DCP step
        assert all(e.name.startswith(("x|", "b|")) or "|" in e.name for e in manifest.entries)
        assert not any(e.name.startswith("b|") for e in manifest.entries), "DCP pickled a value"
        assert mgr.metrics(2) == {"loss": 0.25}
        got = fresh()
        w, order = got["model"]["0.weight"], got["extra"]["order"]
        assert mgr.restore(got) == 2  # in place
        assert_states_equal(full_state(7), got, key_order=True)
        assert got["model"]["0.weight"] is w and got["extra"]["order"] is order  # the same objects, overwritten
        assert mgr.last_restore_info.tier == "ram" and mgr.last_restore_info.skipped == []
        # a new state, rebuilt from the checkpoint alone
        assert_states_equal(full_state(7), mgr.restore(), key_order=True)
        mgr.restore_policy = RestorePolicy(prefer=["file"])
        got = fresh()
        assert mgr.restore(got) == 2 and mgr.last_restore_info.tier == "file"
        assert_states_equal(full_state(7), got, key_order=True)


def test_a_fresh_optimizers_empty_state_as_the_target_names_what_it_would_miss(shm_dir, tmp_path):
    """A new optimizer's state is empty until its first step: restoring into it through DCP says so, naming
    the key and what the step holds under it (not that the checkpoint lacks the key), before any read."""
    with CheckpointManager(tiers(shm_dir, tmp_path)) as mgr:
        mgr.save(2, full_state(7))
        mgr.wait_until_finished()
        got = fresh()
        got["optim"]["state"] = {}
        with pytest.raises(StateMismatchError, match=r"target state 'optim.state' is empty but step 2 holds \d+ "
                                                     r"entries under it \(e.g. 'optim.state.\d"):
            mgr.restore(got)
        assert all(not t.any() for t in _tensors(got["model"]))  # nothing read into the target


def test_async_save_through_dcp_holds_the_values_at_the_call(shm_dir, tmp_path):
    with CheckpointManager(tiers(shm_dir, tmp_path, obj_every=1)) as mgr:
        state = full_state(3)
        assert mgr.save(1, state)
        for t in _tensors(state):  # training goes on at once, in place
            t.add_(1.0)
        state["extra"]["epoch"] = 99
        mgr.wait_until_finished()
        for tier in ("ram", "file"):
            mgr.restore_policy = RestorePolicy(prefer=[tier])
            got = fresh()
            assert mgr.restore(got) == 1 and mgr.last_restore_info.tier == tier
            assert_states_equal(full_state(3), got, key_order=True)


def test_tier_policies_and_best_n_hold_through_dcp(shm_dir, tmp_path):
    losses = {0: 0.9, 1: 0.4, 2: 0.7, 3: 0.2, 4: 0.5, 5: 0.3, 6: 0.8}
    keep = BestN(lambda m: m["loss"], 2, "min")
    with CheckpointManager(tiers(shm_dir, tmp_path, ram_every=1, obj_every=3, keep=keep)) as mgr:
        for step, loss in losses.items():
            assert mgr.save(step, full_state(step), metrics={"loss": loss}) is True
        mgr.wait_until_finished()
        # RAM took every step and keeps the two best (3, 5); the object tier took 0, 3 and 6 only (and keeps
        # all); the newest, 6, stays in RAM only while it is nowhere else
        assert mgr.store.steps() == {0: ["file"], 3: ["ram", "file"], 5: ["ram"], 6: ["file"]}
        assert mgr.best_step() == 3
        for s in (0, 3, 5, 6):
            got = fresh()
            assert mgr.restore(got, step=s) == s
            assert_states_equal(full_state(s), got, key_order=True)
    with CheckpointManager(tiers(f"{shm_dir}/b", tmp_path / "b", ram_every=2, obj_every=4)) as mgr:
        did = [mgr.save(step, full_state(step)) for step in range(6)]
        assert did == [True, False, True, False, True, False]  # DCP is not even called for steps no tier takes
        mgr.wait_until_finished()
        assert mgr.store.steps() == {0: ["ram", "file"], 2: ["ram"], 4: ["ram", "file"]}


def test_preemption_and_force_through_dcp(shm_dir, tmp_path):
    pre = AnySavePolicy([FixedIntervalPolicy(100), PreemptionCheckpointingPolicy()])
    with CheckpointManager(tiers(shm_dir, tmp_path, ram_every=5, obj_save=pre), handle_sigterm=True) as mgr:
        assert mgr.save(1, full_state(1)) is False
        assert mgr.save(2, full_state(2), force=True) is True  # every tier
        assert not mgr.reached_preemption(3)
        signal.raise_signal(signal.SIGTERM)
        assert mgr.reached_preemption(3)
        assert mgr.save(3, full_state(3)) is True  # only the tier whose policy names preemption
        mgr.wait_until_finished()
        assert mgr.store.steps() == {2: ["ram", "file"], 3: ["file"]}
        got = fresh()
        assert mgr.restore(got) == 3
        assert_states_equal(full_state(3), got, key_order=True)


def test_resumed_run_overwrites_through_dcp(shm_dir, tmp_path):
    with CheckpointManager(tiers(shm_dir, tmp_path, keep=LatestN(5))) as mgr:
        for s in range(4):
            mgr.save(s, full_state(s))
        mgr.wait_until_finished()
        assert mgr.restore(fresh(), step=1) == 1
        assert mgr.save(1, full_state(50)) is False
        assert mgr.save(2, full_state(52)) is True  # replaces the old timeline's step 2 on every tier
        mgr.wait_until_finished()
        for tier in ("ram", "file"):
            mgr.restore_policy = RestorePolicy(prefer=[tier])
            assert_states_equal(full_state(52), mgr.restore(step=2), key_order=True)


def test_damaged_copies_fall_back_to_another_tier_then_an_older_step(shm_dir, tmp_path):
    with CheckpointManager(tiers(shm_dir, tmp_path, obj_every=1)) as mgr:
        mgr.save(1, full_state(1))
        mgr.save(2, full_state(2))
        mgr.wait_until_finished()

        def flip(shard: Path) -> None:
            data = bytearray(shard.read_bytes())
            data[100] ^= 0xFF
            shard.write_bytes(bytes(data))

        flip(Path(shm_dir) / step_dirname(2) / "rank_00000.0000.bin")
        got = fresh()
        assert mgr.restore(got) == 2
        assert_states_equal(full_state(2), got, key_order=True)
        assert mgr.last_restore_info.tier == "file"
        assert [(t, s) for t, s, _ in mgr.last_restore_info.skipped] == [("ram", 2)]
        flip(tmp_path / "obj" / key(2, "rank_00000.0000.bin"))  # the object tier's keys
        got = fresh()
        assert mgr.restore(got) == 1  # no verified copy of step 2 left
        assert_states_equal(full_state(1), got, key_order=True)
        assert {s for _, s, _ in mgr.last_restore_info.skipped} == {2}


def test_which_states_go_through_dcp(shm_dir, tmp_path):
    with CheckpointManager([MemoryTier(shm_dir, keep=LatestN(10))]) as mgr:
        mgr.save(1, {"x": np.arange(4)})  # no tensor: the store directly
        mgr.save(2, {"w": torch.ones(3)})
        mgr.wait_until_finished()
        assert SHARD_KEY not in mgr.store.manifest(1).metadata
        assert SHARD_KEY in mgr.store.manifest(2).metadata
        assert mgr.restore(step=1)["x"].tolist() == [0, 1, 2, 3]  # each step read in its own format
        assert mgr.restore(step=2)["w"].tolist() == [1.0, 1.0, 1.0]
        with pytest.raises(TypeError, match="without pickle"):
            mgr.save(3, {"w": torch.ones(3), "bad": object()})
        with pytest.raises(StateMismatchError, match="lacks"):
            mgr.restore({"w": torch.zeros(3), "more": 1}, step=2)
        assert mgr.all_steps() == [1, 2]
    with CheckpointManager([MemoryTier(shm_dir, keep=LatestN(10))], use_dcp=False) as mgr:
        mgr.save(3, {"w": torch.ones(3)})
        mgr.wait_until_finished()
        assert SHARD_KEY not in mgr.store.manifest(3).metadata
    with pytest.raises(ValueError, match="use_dcp"):
        CheckpointManager([MemoryTier(shm_dir)], use_dcp="yes")


def test_orbax_options_through_dcp(tmp_path):
    opts = CheckpointManagerOptions(save_interval_steps=2, max_to_keep=2, enable_async_checkpointing=False)
    with CheckpointManager(directory=str(tmp_path / "ckpt"), options=opts) as mgr:
        for step in range(7):
            mgr.save(step, full_state(step))
        assert mgr.all_steps() == [4, 6]  # synchronous: committed when save returns
        assert_states_equal(full_state(6), mgr.restore(), key_order=True)


def test_a_plain_dcp_step_is_readable_by_the_manager_only_through_dcp(shm_dir):
    import torch.distributed.checkpoint as dcp

    from tierfs.adapters.dcp import TieredWriter

    store = TieredStore([MemoryTier(shm_dir)])
    try:
        dcp.save({"w": torch.ones(2)}, storage_writer=TieredWriter(store, 1))
    finally:
        store.close()
    with CheckpointManager([MemoryTier(shm_dir)]) as mgr:
        with pytest.raises(StateMismatchError, match="dcp.save directly"):
            mgr.restore({"w": torch.zeros(2)})


# -- several processes, FSDP2 (DTensor) ----------------------------------------------------------------
def run_job(world: int, shm: str, obj: str, mode: str) -> list[dict]:
    return gloo_job.run_job(world, CHILDREN / "manager_dcp_child.py", shm, obj, mode, timeout=180)


def test_fsdp2_sharded_state_with_two_ranks_then_four_then_one(shm_dir, tmp_path):
    obj = str(tmp_path / "obj")
    outs = run_job(2, shm_dir, obj, "save")
    saved = outs[0]["saved"]
    assert all(o["saved"] == saved for o in outs)  # digests of the full (unsharded) state per step
    # RAM took steps 1-3 and keeps 2; the object tier every 2nd step
    assert outs[0]["steps"] == {"2": ["ram", "file"], "3": ["ram"]}
    # step 3 is only in the nodes' RAM, each node holding its own rank's shard; DCP plans each replicated
    # item (Adam's step counters) on one rank only, but every rank kept its copy: both restore step 3
    for o in outs:
        assert o["restored_step"] == 3 and o["restored"] == saved["3"], o
        r = o["rank"]  # each rank gets its own values back
        assert o["loader"] == {"rank": r, "position": 300 + r, "order": [r + i for i in range(4)], "dtype": "int32"}
        assert o["metrics"] == {"loss": 1 / 3}
    # one rank's target does not match: every rank raises, none waits forever in DCP's collectives
    assert [o["error"] for o in run_job(2, shm_dir, obj, "mismatch")] == ["StateMismatchError"] * 2
    for world in (4, 1):  # resharded by DCP to another world size
        outs = run_job(world, shm_dir, obj, "load")
        assert [o["restored_step"] for o in outs] == [2] * world
        assert all(o["restored"] == saved["2"] for o in outs)
        # ranks the saving job lacked get rank 0's values
        assert [o["loader"]["rank"] for o in outs] == [r if r < 2 else 0 for r in range(world)]
