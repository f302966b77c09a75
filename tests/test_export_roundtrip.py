"""``export_dcp`` / ``tierfs export --dcp`` of a CheckpointManager step: the non-tensor values the manager keeps
beside DCP's items (``x|`` entries) come out as DCP's own bytes items, so plain ``dcp.load`` with
``FileSystemReader`` gets the whole state back (an optimizer's param_groups included), laid out as a plain
``dcp.save`` of the same state would lay it out. Real torch, real directories, nothing mocked."""

from __future__ import annotations

import copy
import math
import os
import pickle
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex

from tierfs import CheckpointManager, TieredStore
from tierfs.adapters.dcp import export_dcp
from tierfs.cli import main as cli_main
from tierfs.policies import FixedIntervalPolicy
from tierfs.testing import assert_states_equal
from tierfs.tiers import MemoryTier, ObjectTier

HERE = Path(__file__).parent
CHILDREN = HERE / "children"
sys.path.insert(0, str(HERE))
import gloo_job  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


def model_and_adamw(seed: int, steps: int, lr: float = 3e-3) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.8, 0.95), eps=1e-7, weight_decay=0.05)
    for _ in range(steps):
        model(torch.randn(5, 8)).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def tiers(shm: str, tmp_path: Path) -> list:
    return [MemoryTier(shm, save=FixedIntervalPolicy(1)),
            ObjectTier(f"file://{tmp_path}/obj", save=FixedIntervalPolicy(1))]


def saved_by_manager(shm: str, tmp_path: Path, state: dict, step: int = 1) -> TieredStore:
    """``state`` saved by a CheckpointManager; returns a new store over the same tiers (the manager is closed)."""
    with CheckpointManager(tiers(shm, tmp_path)) as mgr:
        assert mgr.save(step, state)
        mgr.wait_until_finished()
        assert mgr.store.manifest(step).is_dcp
        assert any(e.name.startswith("x|") for e in mgr.store.manifest(step).entries)
    return TieredStore(tiers(shm, tmp_path))


def plain_metadata(state: dict, directory: Path) -> Metadata:
    """The ``.metadata`` a plain ``dcp.save`` of ``state`` writes (the reference for the export's)."""
    dcp.save(state, storage_writer=FileSystemWriter(str(directory)))
    with open(directory / ".metadata", "rb") as f:
        return pickle.load(f)


def kinds(md: Metadata) -> dict[str, str]:
    return {k: type(v).__name__ for k, v in md.state_dict_metadata.items()}


def item_bytes(directory: Path, md: Metadata, fqn: str) -> bytes:
    si = md.storage_data[MetadataIndex(fqn)]
    with open(directory / si.relative_path, "rb") as f:
        f.seek(si.offset)
        return f.read(si.length)


def assert_laid_out_as_plain_save(out: Path, plain: Path) -> None:
    """The export's metadata has the keys, item kinds and planner data of a plain dcp.save of the same
    state, and every bytes item holds the bytes that save wrote (``torch.save`` of the value)."""
    with open(out / ".metadata", "rb") as f:
        got = pickle.load(f)
    with open(plain / ".metadata", "rb") as f:
        want = pickle.load(f)
    assert kinds(got) == kinds(want)
    assert got.planner_data == want.planner_data
    for fqn, m in want.state_dict_metadata.items():
        if isinstance(m, BytesStorageMetadata):
            assert item_bytes(out, got, fqn) == item_bytes(plain, want, fqn), fqn
        else:
            assert got.state_dict_metadata[fqn].size == m.size
            assert got.state_dict_metadata[fqn].properties.dtype == m.properties.dtype


# -- a model and AdamW ---------------------------------------------------------------------------------
def test_model_and_adamw_round_trip_bit_exact_with_param_groups(shm_dir, tmp_path):
    model, opt = model_and_adamw(7, 3)
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    want = copy.deepcopy(state)
    store = saved_by_manager(shm_dir, tmp_path, state)
    out = tmp_path / "plain"
    try:
        md = export_dcp(store, out)
    finally:
        store.close()
    assert sorted(p.name for p in out.iterdir()) == [".metadata", "__0_0.distcp"]
    assert isinstance(md.state_dict_metadata["optim.param_groups.0.lr"], BytesStorageMetadata)

    # a fresh model and optimizer (other weights, other hyperparameters, one step so Adam's state exists)
    model2, opt2 = model_and_adamw(99, 1, lr=0.5)
    sd = {"model": model2.state_dict(), "optim": opt2.state_dict()}
    dcp.load(sd, storage_reader=FileSystemReader(str(out)))  # plain DCP: no tierfs involved
    model2.load_state_dict(sd["model"])
    opt2.load_state_dict(sd["optim"])
    got = {"model": model2.state_dict(), "optim": opt2.state_dict()}
    assert_states_equal(want, got)  # weights, exp_avg, exp_avg_sq, step, and every param_group value
    group = got["optim"]["param_groups"][0]
    assert group["lr"] == 3e-3 and group["betas"] == (0.8, 0.95) and type(group["betas"]) is tuple
    assert group["eps"] == 1e-7 and group["weight_decay"] == 0.05 and group["params"] == [0, 1, 2, 3]
    # and it trains on exactly as the original would
    torch.manual_seed(5)
    x = torch.randn(5, 8)
    for m, o in ((model, opt), (model2, opt2)):
        m(x).pow(2).sum().backward()
        o.step()
    assert_states_equal(model.state_dict(), model2.state_dict())

    plain_metadata(want, tmp_path / "reference")
    assert_laid_out_as_plain_save(out, tmp_path / "reference")


def test_metadata_keys_equal_a_plain_dcp_save(shm_dir, tmp_path):
    model, opt = model_and_adamw(3, 2)
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    plain = tmp_path / "reference"
    want = plain_metadata(state, plain)
    store = saved_by_manager(shm_dir, tmp_path, state)
    try:
        got = export_dcp(store, tmp_path / "plain")
    finally:
        store.close()
    assert set(got.state_dict_metadata) == set(want.state_dict_metadata)
    assert kinds(got) == kinds(want)
    assert got.planner_data == want.planner_data
    assert {k for k, v in kinds(got).items() if v == "BytesStorageMetadata"} == {
        f"optim.param_groups.0.{k}" for k in state["optim"]["param_groups"][0]}
    assert_laid_out_as_plain_save(tmp_path / "plain", plain)


# -- every kind of non-tensor value --------------------------------------------------------------------
def nested_state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {"w": torch.randn(3, 4, generator=g), "b": torch.randn(4, generator=g).to(torch.bfloat16)},
        "extra": {
            "int": 7 + seed, "float": 0.1 * seed, "inf": float("inf"), "nan": float("nan"), "neg0": -0.0,
            "str": f"run-{seed}", "none": None, "flag": True, "big": 2 ** 70 + seed,
            "tuple": (1, (2.5, "a"), [3, None]), "empty_list": [], "empty_dict": {},
            "groups": [{"lr": 0.01 * seed, "params": [0, 1], "betas": (0.9, 0.99)}, {"name": "second", "x": None}],
            "array": (np.arange(6, dtype=np.int16) + seed).reshape(2, 3), "zero_d": np.array(2.5 + seed),
            "scalar": np.float32(0.5 + seed), "blob": b"\x00tier\xff" + bytes([seed]),
            "by_id": {3: "three", 4: [1, 2], 5: {"deep": (seed,)}},
            "nested_lists": [[1, 2], [3, [4, 5]]],
        },
        # a list holding tensors: walked by both; its other items are values of their own
        "mixed": [torch.full((2,), float(seed)), 7 + seed, {"k": f"v{seed}", "t": torch.ones(1) * seed}, [1, seed]],
        "top": seed,
    }


def fresh_nested() -> dict:
    """The same structure, other values (what a new process builds before loading)."""
    s = nested_state(1)
    s["extra"] = {k: v if isinstance(v, dict) and not v else None for k, v in s["extra"].items()}  # {} stays
    s["extra"]["groups"] = [{"lr": None, "params": None, "betas": None}, {"name": None, "x": 0}]
    s["extra"]["by_id"] = {3: None, 4: None, 5: {"deep": None}}
    s["extra"]["nested_lists"] = [[0, 0], [0, [0, 0]]]
    s["mixed"][1], s["mixed"][2]["k"], s["mixed"][3] = None, None, [None, None]
    s["top"] = None
    for t in (s["model"]["w"], s["model"]["b"], s["mixed"][0], s["mixed"][2]["t"]):
        t.zero_()
    return s


def test_nested_non_tensor_values_round_trip(shm_dir, tmp_path):
    want = nested_state(4)
    store = saved_by_manager(shm_dir, tmp_path, nested_state(4))
    out = tmp_path / "plain"
    try:
        export_dcp(store, out)
    finally:
        store.close()
    got = fresh_nested()
    dcp.load(got, storage_reader=FileSystemReader(str(out)))
    plain = tmp_path / "reference"
    plain_metadata(nested_state(4), plain)
    from_plain = fresh_nested()
    dcp.load(from_plain, storage_reader=FileSystemReader(str(plain)))
    assert_states_equal(from_plain, got, key_order=True)  # what plain DCP gives back, exactly

    # DCP sets a non-tensor value under an int key by its string ("3"), beside the target's own key
    assert got["extra"].pop("by_id") == {3: None, 4: None, 5: {"deep": None}, "3": "three", "4": [1, 2],
                                         "5": {"deep": (4,)}}
    want["extra"].pop("by_id")
    assert_states_equal(want, got)  # types too: tuples stay tuples, arrays arrays, numpy scalars and bytes
    assert math.isnan(got["extra"]["nan"]) and math.copysign(1.0, got["extra"]["neg0"]) == -1.0
    assert got["extra"]["array"].dtype == np.int16 and got["extra"]["zero_d"].shape == ()
    assert type(got["extra"]["scalar"]) is np.float32 and type(got["extra"]["tuple"]) is tuple

    assert_laid_out_as_plain_save(out, plain)
    # the planner data is a plain save's: DCP rebuilds the same state from either without a target
    # (lists come back as lists: their indices are ints)
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(out), str(tmp_path / "from_export.pt"))
    dcp_to_torch_save(str(plain), str(tmp_path / "from_plain.pt"))
    a = torch.load(tmp_path / "from_export.pt", weights_only=False)
    b = torch.load(tmp_path / "from_plain.pt", weights_only=False)
    assert_states_equal(b, a)
    assert isinstance(a["mixed"], list) and a["mixed"][1] == 11 and a["extra"]["groups"][1]["name"] == "second"


def test_a_step_saved_by_dcp_save_directly_exports_as_before(shm_dir, tmp_path):
    from tierfs.adapters.dcp import TieredWriter

    want = nested_state(2)
    with TieredStore(tiers(shm_dir, tmp_path)) as store:
        dcp.save(want, storage_writer=TieredWriter(store, 1))  # DCP's own bytes items (b| entries)
        store.wait_until_finished()
        md = export_dcp(store, tmp_path / "plain")
    assert md.planner_data == plain_metadata(nested_state(2), tmp_path / "reference").planner_data
    got = fresh_nested()
    dcp.load(got, storage_reader=FileSystemReader(str(tmp_path / "plain")))
    got["extra"].pop("by_id")  # DCP's int keys: see above
    want["extra"].pop("by_id")
    assert_states_equal(want, got)
    assert_laid_out_as_plain_save(tmp_path / "plain", tmp_path / "reference")


# -- the command line ----------------------------------------------------------------------------------
def test_cli_export_dcp_of_a_manager_step(shm_dir, tmp_path, capsys):
    model, opt = model_and_adamw(11, 2)
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "epoch": 4}
    want = copy.deepcopy(state)
    with CheckpointManager([MemoryTier(shm_dir)]) as mgr:
        assert mgr.save(3, state)
        mgr.wait_until_finished()
    out = tmp_path / "plain"
    code = cli_main(["export", shm_dir, str(out), "--dcp"])
    text, err = capsys.readouterr()
    assert code == 0, err
    assert "1 .distcp file(s)" in text and "FileSystemReader" in text
    model2, opt2 = model_and_adamw(12, 1, lr=1.0)
    sd = {"model": model2.state_dict(), "optim": opt2.state_dict(), "epoch": -1}
    dcp.load(sd, storage_reader=FileSystemReader(str(out)))
    model2.load_state_dict(sd["model"])
    opt2.load_state_dict(sd["optim"])
    assert_states_equal(want, {"model": model2.state_dict(), "optim": opt2.state_dict(), "epoch": sd["epoch"]})


# -- two ranks -----------------------------------------------------------------------------------------
def test_two_rank_fsdp2_manager_step_loads_in_one_process(shm_dir, tmp_path):
    """An FSDP2 job of two ranks (tests/children/manager_dcp_child.py): the export loads into a plain model and Adam in
    one process, weights, Adam's state and param_groups as the job saved them; per-rank values are rank 0's."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from manager_dcp_child import digest, train

    obj = str(tmp_path / "obj")
    outs = gloo_job.run_job(2, CHILDREN / "manager_dcp_child.py", shm_dir, obj, "save", timeout=180)
    saved = outs[0]["saved"]
    store = TieredStore([ObjectTier(f"file://{obj}")])  # the object tier took every 2nd step
    out = tmp_path / "plain"
    try:
        md = export_dcp(store, out)
    finally:
        store.close()
    assert sorted(p.name for p in out.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    # each non-tensor value once, from rank 0
    assert {md.storage_data[MetadataIndex(k)].relative_path for k, v in md.state_dict_metadata.items()
            if isinstance(v, BytesStorageMetadata)} == {"__0_0.distcp"}

    torch.manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    opt = torch.optim.Adam(model.parameters(), lr=0.5)
    train(model, opt, 0)
    msd, osd = get_state_dict(model, opt)
    target = {"model": msd, "optim": osd, "loader": {"rank": -1, "position": -1, "order": np.zeros(4, np.int32)}}
    dcp.load(target, storage_reader=FileSystemReader(str(out)))
    set_state_dict(model, opt, model_state_dict=target["model"], optim_state_dict=target["optim"])
    assert digest(model, opt) == saved["2"]  # every full tensor and every other value, lr included
    assert opt.param_groups[0]["lr"] == 1e-2
    assert target["loader"]["rank"] == 0 and target["loader"]["position"] == 200
    assert_states_equal(target["loader"]["order"], np.arange(4, dtype=np.int32))

    plain = tmp_path / "reference"
    want = plain_metadata(target, plain)  # the same state saved by plain DCP in one process
    assert kinds(md) == kinds(want) and md.planner_data == want.planner_data


RANK_VALUES_CHILD = """
import os, sys, warnings
warnings.filterwarnings("ignore")
import numpy as np
import torch
import torch.distributed as dist
sys.path.insert(0, {here!r})
from _child import finish
from tierfs import CheckpointManager
from tierfs.tiers import ObjectTier
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
state = {{"model": torch.nn.Linear(4, 2).state_dict(), "rank": {{"id": rank, "order": np.arange(3) + rank}},
          "shared": (1, "two")}}
if rank == 1:
    state["only1"] = {{"note": "rank one", "pair": (1, 2), "blob": b"\\x01"}}
with CheckpointManager([ObjectTier("file://" + sys.argv[1])]) as mgr:
    assert mgr.save(1, state)
    mgr.wait_until_finished()
finish({{"rank": rank}})
"""


def test_values_only_another_rank_has_come_from_that_rank(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(RANK_VALUES_CHILD.format(here=str(CHILDREN)))
    obj = str(tmp_path / "obj")
    gloo_job.run_job(2, script, obj, timeout=120)
    out = tmp_path / "plain"
    with TieredStore([ObjectTier(f"file://{obj}")]) as store:
        md = export_dcp(store, out)
    where = {k: md.storage_data[MetadataIndex(k)].relative_path for k, v in md.state_dict_metadata.items()
             if isinstance(v, BytesStorageMetadata)}
    assert where == {"rank.id": "__0_0.distcp", "rank.order": "__0_0.distcp", "shared": "__0_0.distcp",
                     "only1.note": "__1_0.distcp", "only1.pair": "__1_0.distcp", "only1.blob": "__1_0.distcp"}
    assert md.planner_data is not None and md.planner_data["only1.pair"] == ("only1", "pair")
    torch.manual_seed(3)
    got = {"model": torch.nn.Linear(4, 2).state_dict(), "rank": {"id": None, "order": None}, "shared": None,
           "only1": {"note": None, "pair": None, "blob": None}}
    dcp.load(got, storage_reader=FileSystemReader(str(out)))
    torch.manual_seed(0)
    want = {"model": torch.nn.Linear(4, 2).state_dict(), "rank": {"id": 0, "order": np.arange(3)}, "shared": (1, "two"),
            "only1": {"note": "rank one", "pair": (1, 2), "blob": b"\x01"}}
    assert_states_equal(want, got)
    assert sorted(os.listdir(out)) == [".metadata", "__0_0.distcp", "__1_0.distcp"]


def test_two_values_of_one_flattened_key_are_one_clear_error(shm_dir, tmp_path):
    from tierfs.errors import TierfsError

    store = saved_by_manager(shm_dir, tmp_path, {"a.b": 1, "a": {"b": 2}, "t": torch.ones(2)})  # dcp.save rejects it
    try:
        with pytest.raises(TierfsError, match="both flatten to 'a.b'"):
            export_dcp(store, tmp_path / "plain")
    finally:
        store.close()
    assert not (tmp_path / "plain" / ".metadata").exists()  # no checkpoint: .metadata comes last
