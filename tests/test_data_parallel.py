"""Data-parallel replicas stored once: 4 gloo processes, each its own node with its own RAM directory,
RAM (LatestN(1)) + PeerTier(replicas=1) + a file:// object tier.

Layouts: every rank holding the same MLP and Adam state plus a tensor of its own (the direct API with
``replicated=``, and DDP through CheckpointManager and DCP), and HSDP (two replica groups of two shards:
declared, and FSDP2 ``fully_shard`` over a 2x2 mesh through CheckpointManager). For each: the bytes each
tier holds, a node that lost its RAM while the object tier is gone (every rank restores bit-exact from RAM
and peers), and a restore from the object tier alone, which reads each stored byte once."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest

import gloo_job
from tierfs.core.dataparallel import Sharing, _Packer, by_bundle, declared, place
from tierfs.errors import ArgumentError, FormatError
from tierfs.format import Entry, Manifest, step_dirname

HERE = Path(__file__).parent
CHILDREN = HERE / "children"


def _bytes(path: Path, step: str | None = None) -> int:
    """Bytes of the shard files under ``path`` (in folders named ``step`` alone, when given: a step's)."""
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs
               if f.endswith(".bin") and (step is None or Path(d).name == step))


def _lose_node_then_everything(child: str, layout: str, shm: Path, obj: Path) -> tuple[list, list]:
    """Node 1 loses its RAM and the object tier is gone: restore. Then every node loses its RAM and the
    object tier is back: restore."""
    shutil.rmtree(shm / "node1")
    gone = obj.with_name("gone")
    obj.rename(gone)
    from_peers = gloo_job.run_job(4, CHILDREN / child, str(shm), str(obj), "restore", layout)
    gone.rename(obj)
    for d in shm.iterdir():
        shutil.rmtree(d)
    return from_peers, gloo_job.run_job(4, CHILDREN / child, str(shm), str(obj), "restore", layout)


# HSDP declared by hand works alike (dp_child.py "hsdp"); the suite runs HSDP through FSDP2 below
@pytest.mark.parametrize("layout", ["dp"])
def test_declared_replicas_are_stored_once_and_restored_from_the_ranks_holding_them(layout, shm_dir, tmp_path):
    shm, obj = Path(shm_dir), tmp_path / "obj"
    saved = gloo_job.run_job(4, CHILDREN / "dp_child.py", str(shm), str(obj), "save", layout)
    state, unique = saved[0]["state"], saved[0]["unique"]
    distinct = (state - unique) * (1 if layout == "dp" else 2) + 4 * unique
    stored = _bytes(obj, step_dirname(2))  # the step's files, each rank's under its bucket
    assert distinct <= stored <= 1.02 * distinct
    for r in saved:
        assert r["ram"] <= 1.02 * state  # RAM keeps everything each rank needs, once
        assert r["replicas"] <= 1.02 * unique + 1024  # peers keep only what no other node holds
        # a rank whose copy diverged fails the commit on every rank; nothing of step 3 is listed
        pair = "0 and 1" if layout == "dp" else "1 and 3"  # rank 1 and a rank holding the same values
        assert f"ranks {pair} hold different values" in r["diverged"]
        assert r["steps"] == {"2": ["ram", "peer", "file"]}
    from_peers, from_object = _lose_node_then_everything("dp_child.py", layout, shm, obj)
    for r in from_peers:
        assert r["differ"] == [] and r["step"] == 2 and r["object_read"] == 0
        assert r["tier"] == ("peer" if r["rank"] == 1 else "ram")
    for r in from_object:
        assert r["differ"] == [] and r["tier"] == "file"
    assert sum(r["object_read"] for r in from_object) == stored  # each stored byte read once


# DDP through the manager works alike (dp_manager_child.py "ddp"; tests/test_peer.py restores a DDP manager
# state from RAM and peers); the suite runs HSDP, whose replicas are DTensor shards
@pytest.mark.parametrize("layout", ["hsdp"])
def test_checkpoint_manager_stores_dcp_replicas_once(layout, shm_dir, tmp_path):
    shm, obj = Path(shm_dir), tmp_path / "obj"
    saved = gloo_job.run_job(4, CHILDREN / "dp_manager_child.py", str(shm), str(obj), "save", layout)
    state = saved[0]["state"]
    unique = 400  # each rank's own tensor
    distinct = (state - unique) * (1 if layout == "ddp" else 2) + 4 * unique
    for r in saved:  # steps 2 and 3 replay step 1's plan: stored alike
        assert r["objects1"] == r["objects2"] == r["objects3"]
        assert distinct <= r["objects3"] <= 1.02 * distinct
        assert r["ram"] <= 1.03 * state
        assert r["replicas"] <= 2 * unique + 1024
    from_peers, from_object = _lose_node_then_everything("dp_manager_child.py", layout, shm, obj)
    for before, peers, objects in zip(saved, from_peers, from_object):
        assert peers["restored"] == objects["restored"] == before["saved"]
        assert peers["restored_step"] == objects["restored_step"] == 3 and peers["object_read"] == 0
    assert sum(r["object_read"] for r in from_object) == saved[0]["objects3"]


# -- the layout of bundles (no processes) -----------------------------------------------------------
def test_a_bundle_has_the_same_relative_layout_whatever_comes_before_it():
    sizes = [100, 7, 64, 1000]
    layouts = []
    for before in ([], [5], [900, 33], [4000]):
        pk = _Packer(0, 4096)
        for n in before:
            pk.add(n)
        where, parts = pk.bundle(sizes)
        (f, start, end), = parts
        assert all(w[0] == f for w in where)
        layouts.append(([w[1] - start for w in where], end - start))
    assert all(lay == layouts[0] for lay in layouts)
    # larger than a file: files of its own, from offset 0
    pk = _Packer(0, 1000)
    pk.add(10)
    where, parts = pk.bundle([600, 600, 100])
    assert [p[1] for p in parts] == [0, 0] and len({p[0] for p in parts}) == 2


def test_declared_owners_spread_the_bytes_over_the_group():
    names = [f"model/w{i}" for i in range(8)] + ["mine"]
    sizes = {i: 1000 for i in range(9)}
    s = [declared(names, sizes, ["model"], r, 4) for r in range(4)]
    assert all(x == s[0] for x in s)  # every rank works out the same owners
    owners = [s[0].owners[n][0] for n in names[:8]]
    assert sorted(owners) == [0, 0, 1, 1, 2, 2, 3, 3] and "mine" not in s[0].owners
    hs = declared(names, sizes, {"model": [1, 3]}, 1, 4)
    assert hs.groups == ((1, 3),) and {o for o, _ in hs.owners.values()} == {1, 3}


@pytest.mark.parametrize("replicated, needle", [
    ("model", "list of keys"), (["nope"], "names no array"), ({"model": [0, 9]}, "ranks of the job"),
    ({"model": [2, 3]}, "including this rank")])
def test_bad_replicated_declarations_are_clear_errors(replicated, needle):
    with pytest.raises(ArgumentError, match=needle):
        declared(["model/w"], {0: 8}, replicated, 0, 4)


def test_shared_tiers_hold_each_bundle_in_its_owners_shard_only():
    names = ["a", "b", "c", "u"]
    sharing = Sharing(((0, 1),), {"a": (0, 0), "b": (1, 0), "c": (1, 0)})
    order, where, files, bundles, groups, _ = place(names, {i: 100 for i in range(4)}, [0, 1, 2, 3],
                                                    sharing, 0, 1 << 20)
    assert order == [3, 0, 1, 2] and groups == [[0, 1]]
    entries = [Entry(names[i], "array", "numpy", "uint8", [100], f, o, 100, [0]) for i, (f, o) in zip(order, where)]
    m = Manifest(1, 0, 2, entries, files, groups=groups, bundles=bundles)
    m.validate()
    assert [[e.name for e in es] for es in by_bundle(m.entries, m.bundles)] == [["a"], ["b", "c"]]
    unique, owned, other = (where[0][0],), (where[1][0],), (where[2][0],)
    assert list(m.replica_files) == list(unique)
    assert set(m.held_files(False)) == set(unique + owned) and set(m.held_files(True)) == set(files)
    assert m.local_files == set(other)
    bad = Manifest(1, 0, 2, entries, files, groups=[[1]], bundles=bundles)
    with pytest.raises(FormatError, match="groups"):
        bad.validate()
    np.testing.assert_equal(Manifest.from_bytes(m.to_bytes()).bundles, bundles)
