"""TieredWriter with DCP's plan caching: ``DefaultSavePlanner(enable_plan_caching=True)``.

DCP keeps its plan cache in class attributes of ``SavePlanner`` (one per process, keyed by the planner's
class name): each test starts without it and leaves none behind. Every step is loaded back with
``dcp.load`` + ``TieredReader`` and compared bit for bit, and the metadata stored with each cached step
is compared with that of an uncached save of the same state.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.planner import SavePlanner

from tierfs import TieredStore
from tierfs.adapters.dcp import TieredReader, TieredWriter
from tierfs.policies import PreserveAll
from tierfs.tiers import MemoryTier

HERE = Path(__file__).parent
CHILDREN = HERE / "children"
sys.path.insert(0, str(HERE))
import gloo_job  # noqa: E402
from dcp_child import make_state, same  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

_CACHES = ("_cached_save_plan", "_cached_final_save_plan", "_cached_all_plans", "_cached_global_plan",
           "_cached_metadata")


def _clear_plan_cache() -> None:
    for name in _CACHES:
        getattr(SavePlanner, name).clear()


@pytest.fixture(autouse=True)
def cold_plan_cache():
    _clear_plan_cache()
    yield
    _clear_plan_cache()


def open_store(root: str) -> TieredStore:
    return TieredStore([MemoryTier(root, keep=PreserveAll())])


@pytest.fixture
def store(shm_dir):
    s = open_store(shm_dir)
    yield s
    s.close()


def caching() -> DefaultSavePlanner:
    return DefaultSavePlanner(enable_plan_caching=True)


def target(state: dict) -> dict:
    """A state of the same structure, dtypes and shapes as ``state``, every value different."""
    out = copy.deepcopy(state)

    def scrub(d: dict) -> None:
        for k, v in d.items():
            if isinstance(v, dict):
                scrub(v)
            elif isinstance(v, torch.Tensor):
                v.fill_(-3)
    scrub(out)
    out["extra"] = {"epoch": -1, "blob": b""}
    return out


def stored(store: TieredStore, step: int) -> dict:
    return store.manifest(step).metadata["dcp"]


def check_step(store: TieredStore, step: int, want: dict) -> None:
    """``step`` loads back bit-exact, and its metadata is that of an uncached save of ``want``."""
    got = target(want)
    dcp.load(got, storage_reader=TieredReader(store, step=step))
    assert same(want, got), step
    dcp.save(want, storage_writer=TieredWriter(store, 1000 + step))  # no plan caching
    assert stored(store, step) == stored(store, 1000 + step), step
    store.delete(1000 + step)  # a scratch step: gone before the next save (below it, from another thread)


def test_repeated_cached_saves_new_writers_reused_writer_new_planners(store):
    planner = caching()
    metas = []
    for step in (1, 2, 3):  # a new writer per save, the planner reused (as CheckpointManager does)
        want = make_state(7, step)
        metas.append(dcp.save(want, storage_writer=TieredWriter(store, step), planner=planner))
        check_step(store, step, want)
    assert metas[0] is metas[1] is metas[2]  # DCP's cached metadata: the later saves were cached
    writer = TieredWriter(store, 0)  # one writer, reused with checkpoint_id
    for step in (4, 5):
        want = make_state(7, step)
        dcp.save(want, checkpoint_id=step, storage_writer=writer, planner=planner)
        check_step(store, step, want)
    want = make_state(7, 6)  # a new planner: DCP's cache is per class, so still cached
    assert dcp.save(want, storage_writer=TieredWriter(store, 6), planner=caching()) is metas[0]
    check_step(store, 6, want)


def test_structure_changes_between_cached_saves(store):
    planner = caching()
    want = make_state(7, 1)
    steps = []

    def save(step: int, state: dict) -> None:
        dcp.save(state, storage_writer=TieredWriter(store, step), planner=planner)
        steps.append((step, copy.deepcopy(state)))

    save(1, want)
    want["model"]["head.scale"] = torch.linspace(0, 1, 5)  # a tensor added
    save(2, want)
    save(3, want)
    want["model"]["head.scale"] = torch.linspace(0, 1, 9)  # its shape changed
    save(4, want)
    # its dtype changed, nothing else: DCP's cache does not compare dtypes and returns its old metadata,
    # the stored metadata has the dtype written
    want["model"]["head.scale"] = torch.linspace(0, 1, 9, dtype=torch.float64)
    md = dcp.save(want, storage_writer=TieredWriter(store, 5), planner=planner)
    steps.append((5, copy.deepcopy(want)))
    assert md.state_dict_metadata["model.head.scale"].properties.dtype == torch.float32
    assert stored(store, 5)["state_dict_metadata"]["model.head.scale"]["properties"]["dtype"] == "float64"
    read = TieredReader(store, step=5).read_metadata()
    assert read.state_dict_metadata["model.head.scale"].properties.dtype == torch.float64
    want["model"]["head.scale"] = want["model"]["head.scale"].to(torch.bfloat16) + 1  # again, and back
    save(6, want)
    want["model"]["head.scale"] = want["model"]["head.scale"].float()
    save(7, want)
    del want["model"]["head.scale"]  # removed
    save(8, want)
    for step, state in steps:
        check_step(store, step, state)


def test_async_save_with_plan_caching(store):
    planner = caching()
    for step in (1, 2, 3):
        want = make_state(7, step)
        live = copy.deepcopy(want)
        res = dcp.async_save(live, storage_writer=TieredWriter(store, step), planner=planner)
        getattr(res, "upload_completion", res).result(timeout=60)
        for t in live["model"].values():
            t.add_(1.0)
        check_step(store, step, want)


def test_a_cache_warmed_elsewhere_fits_another_store(shm_dir, tmp_path):
    # DCP's cache is per process: a FileSystemWriter save, then another store, warm it for this one
    want = make_state(7, 2)
    dcp.save(want, storage_writer=FileSystemWriter(str(tmp_path / "fs")), planner=caching())
    first = open_store(str(Path(shm_dir) / "a"))
    other = open_store(str(Path(shm_dir) / "b"))
    try:
        for s in (first, other, first):
            step = 1 + len(s.steps())
            want = make_state(8, step)
            dcp.save(want, storage_writer=TieredWriter(s, step, replicated="dedup"), planner=caching())
            check_step(s, step, want)
    finally:
        first.close()
        other.close()


def test_wrong_metadata_and_a_planner_without_its_global_plan_are_rejected(store):
    class OddPlanner(DefaultSavePlanner):  # metadata that does not follow from the plans
        def create_global_plan(self, all_plans):
            plans, md = super().create_global_plan(all_plans)
            md.state_dict_metadata.pop(next(iter(md.state_dict_metadata)), None)
            return plans, md

    class Forgetful(DefaultSavePlanner):  # caches plans but keeps no global plan
        def create_global_plan(self, all_plans):
            out = super().create_global_plan(all_plans)
            del self.global_plan
            return out

    for step in (1, 2):  # uncached, then cached: finish's check holds both times
        with pytest.raises(CheckpointException) as ei:
            dcp.save(make_state(7, 1), storage_writer=TieredWriter(store, step),
                     planner=OddPlanner(enable_plan_caching=True))
        assert [type(e).__name__ for e, _ in ei.value.failures.values()] == ["FormatError"]
    want = make_state(7, 1)
    dcp.save(want, storage_writer=TieredWriter(store, 3), planner=Forgetful(enable_plan_caching=True))
    with pytest.raises(CheckpointException) as ei:  # deltas, and no plan to derive the metadata from
        dcp.save(want, storage_writer=TieredWriter(store, 4), planner=Forgetful(enable_plan_caching=True))
    assert "global plan" in str(next(iter(ei.value.failures.values()))[0])
    assert sorted(store.steps()) == [3]
    check_step(store, 3, want)


# -- two processes (gloo) ------------------------------------------------------------------------------
TWO_RANK_CHILD = """
import copy, os, sys, warnings
warnings.filterwarnings("ignore")
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner
sys.path.insert(0, {here!r})
from _child import finish
from dcp_child import make_state, same
from tierfs import TieredStore
from tierfs.adapters.dcp import TieredReader, TieredWriter
from tierfs.policies import PreserveAll
from tierfs.tiers import MemoryTier

dist.init_process_group("gloo")
rank = dist.get_rank()
store = TieredStore([MemoryTier(os.path.join(sys.argv[1], f"node{{rank}}"), keep=PreserveAll())])
planner = DefaultSavePlanner(enable_plan_caching=True)
writer = TieredWriter(store, 0)
own = f"r{{rank}}"
want = make_state(7, 1)  # the model and optimizer are replicated; own is this rank's alone
want[own] = {{"w": torch.full((4, 3), float(rank + 1)), "i": torch.arange(6) * (rank + 1)}}
steps = {{}}
metas = []


def target(state):
    out = copy.deepcopy(state)
    for part in ("model", own):
        for t in out[part].values():
            t.fill_(-3)
    out["extra"] = {{"epoch": -1, "blob": b""}}
    return out


def save(step, how="new"):
    global want
    if how == "async":
        live = copy.deepcopy(want)
        res = dcp.async_save(live, storage_writer=TieredWriter(store, step), planner=planner)
        getattr(res, "upload_completion", res).result(timeout=60)
        for t in live[own].values():
            t.add_(1)
    elif how == "reused":
        metas.append(dcp.save(want, checkpoint_id=step, storage_writer=writer, planner=planner))
    else:
        metas.append(dcp.save(want, storage_writer=TieredWriter(store, step), planner=planner))
    steps[step] = copy.deepcopy(want)
    want = copy.deepcopy(want)
    want[own]["w"].add_(10)


save(1)
save(2)
save(3, "reused")
save(4, "async")
if rank == 1:  # a tensor added on one rank only
    want[own]["more"] = torch.ones(2, 2)
save(5)
want["model"]["0.bias"] = torch.arange(40, dtype=torch.float32)  # a replicated tensor's shape changed
save(6)
# dtype changes DCP's cache misses: on rank 1's own tensor only, and on a replicated tensor
if rank == 1:
    want[own]["w"] = want[own]["w"].double()
want["model"]["2.bias"] = want["model"]["2.bias"].half()
save(7)
save(8, "reused")
out = {{"rank": rank, "cached": metas[0] is metas[1] is metas[2], "exact": [], "sources": [],
        "same_meta": []}}
for step, state in steps.items():
    got = target(state)
    reader = TieredReader(store, step=step)
    dcp.load(got, storage_reader=reader)
    out["exact"].append(same(state, got))
    out["sources"].append({{str(k): v for k, v in reader.sources.items()}})
    dcp.save(state, storage_writer=TieredWriter(store, 100 + step))  # no plan caching
    if rank == 0:
        out["same_meta"].append(store.manifest(step).metadata["dcp"] == store.manifest(100 + step).metadata["dcp"])
meta = TieredReader(store, step=7).read_metadata().state_dict_metadata
out["dtypes"] = [str(meta["r1.w"].properties.dtype), str(meta["model.2.bias"].properties.dtype)]
store.close()
finish(out)
"""


def test_two_ranks_cached_saves_with_structure_changes(shm_dir, tmp_path):
    script = tmp_path / "child.py"
    script.write_text(TWO_RANK_CHILD.format(here=str(CHILDREN)))
    outs = gloo_job.run_job(2, script, shm_dir, timeout=120)
    for o in outs:
        assert o["exact"] == [True] * 8, o
        # replicated="local" on cached saves too: each rank's shard has all it holds, so each loads
        # from its own RAM alone
        assert o["sources"] == [{str(o["rank"]): "ram"}] * 8, o
        assert o["dtypes"] == ["torch.float64", "torch.float16"], o
    assert outs[0]["cached"]  # DCP reused its cached metadata (on the coordinator)
    assert outs[0]["same_meta"] == [True] * 8
