"""tierfs as a storage layer for torch.distributed.checkpoint: TieredWriter / TieredReader."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from tierfs import TieredStore
from tierfs.adapters.dcp import TieredReader, TieredWriter, metadata_from_json, metadata_to_json
from tierfs.format import step_dirname
from tierfs.tiers import MemoryTier, ObjectTier

HERE = Path(__file__).parent
CHILDREN = HERE / "children"
sys.path.insert(0, str(HERE))
import gloo_job  # noqa: E402
from dcp_child import make_state, same  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


@pytest.fixture
def store(shm_dir, tmp_path):
    s = TieredStore([MemoryTier(shm_dir), ObjectTier(f"file://{tmp_path / 'obj'}")])
    yield s
    s.close()


def fresh():
    got = make_state(1, 1)
    got["extra"] = {"epoch": -1, "blob": b""}
    return got


def test_round_trip_is_bit_exact_and_an_ordinary_tierfs_step(store):
    want = make_state(7, 3)
    md = dcp.save(want, storage_writer=TieredWriter(store, 3))
    store.wait_until_finished()
    assert store.steps() == {3: ["ram", "file"]}
    for tier in ("ram", "file"):
        m = store.verify(3, tier)  # every crc32c checks out; metadata is plain JSON, no pickle
        assert json.loads(json.dumps(m.metadata["dcp"])) == m.metadata["dcp"]
    # the stored metadata is DCP's own, rebuilt without pickle
    stored = metadata_from_json(store.manifest(3).metadata["dcp"])
    assert stored.state_dict_metadata == md.state_dict_metadata
    assert stored.planner_data == md.planner_data
    assert stored.storage_data == md.storage_data
    got = fresh()
    reader = TieredReader(store)
    dcp.load(got, storage_reader=reader)
    assert same(want, got)
    assert reader.sources == {0: "ram"} and reader.skipped == []


def test_metadata_json_round_trip(store):
    md = dcp.save(make_state(7, 2), storage_writer=TieredWriter(store, 1))
    again = metadata_from_json(json.loads(json.dumps(metadata_to_json(md))))
    assert again.state_dict_metadata == md.state_dict_metadata and again.storage_data == md.storage_data


def test_async_save_round_trip(store):
    want = make_state(7, 3)
    fut = dcp.async_save(want, storage_writer=TieredWriter(store, 4))
    (fut.upload_completion if hasattr(fut, "upload_completion") else fut).result(timeout=60)
    got = fresh()
    dcp.load(got, storage_reader=TieredReader(store, step=4))
    assert same(want, got)


def test_corrupted_ram_copy_is_served_from_the_object_tier(store, shm_dir):
    want = make_state(7, 3)
    dcp.save(want, storage_writer=TieredWriter(store, 5))
    store.wait_until_finished()
    shard = Path(shm_dir) / step_dirname(5) / "rank_00000.0000.bin"
    with open(shard, "r+b") as f:
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 0xFF]))
    got = fresh()
    reader = TieredReader(store)
    dcp.load(got, storage_reader=reader)
    assert same(want, got)
    assert reader.sources == {0: "file"}
    assert [(t, s) for t, s, _ in reader.skipped] == [("ram", 5)] and "Checksum" in reader.skipped[0][2]


def test_existing_step_needs_overwrite_and_bad_ids_are_rejected(store):
    dcp.save(make_state(7, 1), storage_writer=TieredWriter(store, 2))
    store.wait_until_finished()
    with pytest.raises(CheckpointException) as ei:
        dcp.save(make_state(7, 1), storage_writer=TieredWriter(store, 2))
    assert [type(e).__name__ for e, _ in ei.value.failures.values()] == ["StepExistsError"]
    want = make_state(8, 1)
    dcp.save(want, storage_writer=TieredWriter(store, 2, overwrite=True))
    got = fresh()
    dcp.load(got, storage_reader=TieredReader(store, step=2))
    assert same(want, got)
    assert TieredWriter.validate_checkpoint_id("step_000000000002") and TieredReader.validate_checkpoint_id("7")
    assert not TieredWriter.validate_checkpoint_id("s3://bucket/x")
    with pytest.raises(ValueError):
        TieredWriter(store, "not-a-step")


def test_writer_options_policies_metrics_non_blocking_extra(shm_dir, tmp_path):
    from tierfs.policies import FixedIntervalPolicy

    store = TieredStore([MemoryTier(shm_dir, save=FixedIntervalPolicy(2)),
                         ObjectTier(f"file://{tmp_path / 'obj'}", save=FixedIntervalPolicy(4))])
    try:
        w = TieredWriter(store, 3, force=False)  # no tier's policy takes step 3: nothing is written
        dcp.save(make_state(7, 1), storage_writer=w)
        assert w.saved is False and store.steps() == {}
        want = make_state(7, 2)
        w = TieredWriter(store, 2, force=False, metrics={"loss": 0.5}, blocking=False,
                         extra={"note": "hi", "order": np.arange(3)})
        dcp.save(want, storage_writer=w)
        assert w.saved is True
        for t in want["model"].values():  # non-blocking: the tensors were copied before dcp.save returned
            t.add_(1.0)
        store.wait_until_finished()
        assert store.steps() == {2: ["ram"]}  # the object tier takes every 4th step only
        m = store.manifest(2)
        assert m.metrics == {"loss": 0.5}
        assert {e.name: e.value for e in m.entries if e.name == "x|note"} == {"x|note": "hi"}
        got = fresh()
        dcp.load(got, storage_reader=TieredReader(store, step=2))
        assert same(make_state(7, 2), got)
        dcp.save(make_state(7, 1), storage_writer=TieredWriter(store, 4, force=False, preempted=True))
        store.wait_until_finished()
        assert store.steps()[4] == ["ram", "file"]
        with pytest.raises(TypeError, match="str names"):
            TieredWriter(store, 5, extra={1: "x"})
    finally:
        store.close()


def run_job(world: int, shm: str, obj: str, mode: str) -> list[dict]:
    return gloo_job.run_job(world, CHILDREN / "dcp_child.py", shm, obj, mode, timeout=120)


def test_two_ranks_save_and_load_with_gloo(shm_dir, tmp_path):
    outs = run_job(2, shm_dir, str(tmp_path / "obj"), "save")
    assert all(o["exact"] and o["step"] == 3 for o in outs)
    # DCP plans each replicated tensor on one rank, but every rank kept its own copy in its shard
    # (replicated="local"): each node loads from its own RAM alone
    assert outs[0]["sources"] == {"0": "ram"}
    assert outs[1]["sources"] == {"1": "ram"}


@pytest.mark.parametrize("saved, loaded", [(2, 4), (4, 2)])
def test_load_with_another_world_size(saved, loaded, shm_dir, tmp_path):
    obj = str(tmp_path / "obj")
    assert all(o["exact"] for o in run_job(saved, shm_dir, obj, "save"))
    outs = run_job(loaded, shm_dir, obj, "load")
    assert [o["exact"] for o in outs] == [True] * loaded
    assert all(o["step"] == 3 for o in outs)


def test_unsupported_options_are_rejected_not_dropped(store):
    from torch.distributed.checkpoint import DefaultSavePlanner

    class OddPlanner(DefaultSavePlanner):  # metadata that does not follow from the plans
        def create_global_plan(self, all_plans):
            plans, md = super().create_global_plan(all_plans)
            md.state_dict_metadata.pop(next(iter(md.state_dict_metadata)))
            return plans, md

    with pytest.raises(CheckpointException) as ei:
        dcp.save(make_state(7, 1), storage_writer=TieredWriter(store, 6), planner=OddPlanner())
    assert [type(e).__name__ for e, _ in ei.value.failures.values()] == ["FormatError"]
    assert 6 not in store.steps()  # the step with the wrong metadata is gone
    with pytest.raises(ValueError, match="use_collectives"):
        dcp.save(make_state(7, 1), storage_writer=TieredWriter(store, 7), use_collectives=False)
    assert 7 not in store.steps()


# -- export to a plain DCP directory -------------------------------------------------------------------
def test_export_reads_with_a_plain_file_system_reader(store, tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    from tierfs.adapters.dcp import export_dcp

    want = make_state(7, 3)
    dcp.save(make_state(5, 1), storage_writer=TieredWriter(store, 2))
    dcp.save(want, storage_writer=TieredWriter(store, 3))
    store.wait_until_finished()
    out = tmp_path / "plain"
    done: list[int] = []
    md = export_dcp(store, out, progress=done.append)  # newest step
    assert sorted(p.name for p in out.iterdir()) == [".metadata", "__0_0.distcp"]
    assert sum(done) == sum(e.length for e in store.manifest(3).entries if e.kind == "array") > 0
    assert all(si.relative_path == "__0_0.distcp" for si in md.storage_data.values())
    got = fresh()
    dcp.load(got, storage_reader=FileSystemReader(str(out)))  # no tierfs involved
    assert same(want, got)
    # an older step, from the object tier only; an existing checkpoint needs overwrite=True
    with pytest.raises(FileExistsError):
        export_dcp(store, out, step=2)
    export_dcp(store, out, step=2, tiers=["file"], overwrite=True)
    got = fresh()
    dcp.load(got, storage_reader=FileSystemReader(str(out)))
    assert same(make_state(5, 1), got)


def test_export_of_a_two_rank_checkpoint_loads_in_one_process(shm_dir, tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    from tierfs.adapters.dcp import export_dcp

    obj = str(tmp_path / "obj")
    assert all(o["exact"] for o in run_job(2, shm_dir, obj, "save"))
    store = TieredStore([ObjectTier(f"file://{obj}")])  # any single process with access to a tier
    try:
        out = tmp_path / "plain"
        md = export_dcp(store, out)
    finally:
        store.close()
    assert sorted(p.name for p in out.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert {si.relative_path for si in md.storage_data.values()} <= {"__0_0.distcp", "__1_0.distcp"}
    got = fresh()
    dcp.load(got, storage_reader=FileSystemReader(str(out)))
    assert same(make_state(7, 3), got)


RAM_ONLY_CHILD = """
import json, os, sys, warnings
warnings.filterwarnings("ignore")
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
sys.path.insert(0, {here!r})
from dcp_child import make_state, same
from tierfs import TieredStore
from tierfs.adapters.dcp import TieredReader, TieredWriter
from tierfs.tiers import MemoryTier
dist.init_process_group("gloo")
rank = dist.get_rank()
store = TieredStore([MemoryTier(os.path.join(sys.argv[1], f"node{{rank}}"))])
want = {{f"r{{rank}}": make_state(7 + rank, 3)}}  # each rank its own items: a node's RAM has only its own
dcp.save(want, storage_writer=TieredWriter(store, 3))
got = {{f"r{{rank}}": make_state(1, 1)}}
got[f"r{{rank}}"]["extra"] = {{"epoch": -1, "blob": b""}}
reader = TieredReader(store)
dcp.load(got, storage_reader=reader)
print(json.dumps({{"rank": rank, "exact": same(want, got), "sources": {{str(k): v for k, v in reader.sources.items()}}}}), flush=True)
store.close()
dist.destroy_process_group()
"""


def test_two_ram_only_nodes_load_without_a_shared_tier(shm_dir, tmp_path):
    # each node's RAM holds only its own manifest: the ranks without the coordinator's get DCP's metadata
    # from one that has it (read_metadata is called on every rank by dcp.load)
    script = tmp_path / "child.py"
    script.write_text(RAM_ONLY_CHILD.format(here=str(CHILDREN)))
    outs = gloo_job.run_job(2, script, shm_dir, timeout=120)
    assert all(o["exact"] for o in outs)
    assert [o["sources"] for o in outs] == [{"0": "ram"}, {"1": "ram"}]


def test_async_save_with_two_ranks(shm_dir, tmp_path):
    outs = run_job(2, shm_dir, str(tmp_path / "obj"), "async-save")
    assert all(o["exact"] and o["step"] == 3 for o in outs)
    assert [o["sources"][str(o["rank"])] for o in outs] == ["ram", "ram"]
