"""Data-loader state saved with a step and given back on restore, without pickle: the CheckpointManager
(both paths, RAM and object tier, two FSDP ranks with loaders of their own), Lightning, the Hugging Face
Trainer callback and torchtitan's manager. Each resumes mid-epoch and must see exactly the batches an
uninterrupted run sees next.

The loaders draw with ``torchdata.stateful_dataloader.sampler.RandomSampler`` and a generator of its own:
with it torchdata 0.11 resumes bit-exact across epochs (``shuffle=True`` with ``generator=`` and no
workers resumes the current epoch exactly, but draws later epochs differently: torchdata's behaviour,
without tierfs too).
"""

from __future__ import annotations

import math
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torchdata")

from torchdata.stateful_dataloader import StatefulDataLoader  # noqa: E402
from torchdata.stateful_dataloader.sampler import RandomSampler  # noqa: E402

from tierfs import CheckpointManager, TieredStore  # noqa: E402
from tierfs.adapters import loaderstate  # noqa: E402
from tierfs.errors import ArgumentError, StateMismatchError  # noqa: E402
from tierfs.format import DCP_EXTRA_PREFIX  # noqa: E402
from tierfs.policies import FixedIntervalPolicy, LatestN  # noqa: E402
from tierfs.tiers import MemoryTier, ObjectTier  # noqa: E402

HERE = Path(__file__).parent
DATA = list(range(20))  # 7 batches of 3 an epoch


def make_loader(seed: int = 0, data: list[int] = DATA, batch_size: int = 3) -> StatefulDataLoader:
    return StatefulDataLoader(data, batch_size=batch_size,
                              sampler=RandomSampler(data, generator=torch.Generator().manual_seed(seed)))


def batches(loader: StatefulDataLoader, n: int) -> list[list[int]]:
    """The next ``n`` batches, across epochs."""
    out: list[list[int]] = []
    while len(out) < n:
        for b in loader:
            out.append(b.tolist())
            if len(out) == n:
                break
    return out


class Stateful:
    """A hand-written stateful object: any object with state_dict()/load_state_dict()."""

    def __init__(self) -> None:
        self.state: dict = {}

    def state_dict(self) -> dict:
        return self.state

    def load_state_dict(self, sd: dict) -> None:
        self.state = sd


# -- the encoding: types kept, no pickle ------------------------------------------------------------------
def test_a_loaders_state_round_trips_with_its_types_and_refuses_what_needs_pickle():
    state = {"gen": torch.arange(5, dtype=torch.uint8), "bf": torch.tensor([1.5, -2.0], dtype=torch.bfloat16),
             "scalar": torch.tensor(3), 7: ("a", 1, None), "nan": math.nan, "arr": np.arange(4, dtype=np.int16),
             "np": np.float32(0.25), "raw": b"\x00\xff", "nested": [{"k": True}], (1, 2): "tuple key"}
    arrays: list[np.ndarray] = []
    encoded = loaderstate.encode(state, arrays, "loader")
    import json
    back = loaderstate.decode(json.loads(json.dumps(encoded)), dict(enumerate(arrays)))
    assert list(back) == list(state)
    assert back["gen"].dtype == torch.uint8 and torch.equal(back["gen"], state["gen"])
    assert back["bf"].dtype == torch.bfloat16 and torch.equal(back["bf"], state["bf"])
    assert back["scalar"].shape == () and int(back["scalar"]) == 3
    assert back[7] == ("a", 1, None) and math.isnan(back["nan"]) and back["raw"] == b"\x00\xff"
    assert back["arr"].dtype == np.int16 and np.array_equal(back["arr"], state["arr"])
    assert type(back["np"]) is np.float32 and back["np"] == np.float32(0.25)
    assert back["nested"] == [{"k": True}] and back[(1, 2)] == "tuple key"
    with pytest.raises(ArgumentError, match=r"loader\['bad'\]: .*type object without pickle"):
        loaderstate.encode({"bad": object()}, [], "loader")
    with pytest.raises(ArgumentError, match="state_dict"):
        loaderstate.objects({"x": object()})


# -- CheckpointManager ------------------------------------------------------------------------------------
@pytest.mark.parametrize("torch_state", [False, True], ids=["store", "dcp"])
def test_manager_resumes_mid_epoch_from_ram_then_from_the_object_tier(shm_dir, tmp_path, torch_state):
    """Steps 1-9 saved (RAM every step, keeping 2; the object tier every 4th), the loader in its second epoch:
    a new manager restores step 9 from RAM, and with RAM gone step 8 from the object tier; each loader
    then yields what the uninterrupted loader yields after that step, into the epochs after."""
    def tiers():
        return [MemoryTier(shm_dir, keep=LatestN(2)), ObjectTier(f"file://{tmp_path}/obj", save=FixedIntervalPolicy(4))]

    full = batches(make_loader(), 30)
    state = {"w": torch.zeros(3) if torch_state else np.zeros(3), "step": 0}
    dl, extra = make_loader(), Stateful()
    with CheckpointManager(tiers()) as mgr:
        step = 0
        for _ in range(2):
            for b in dl:
                step += 1
                assert b.tolist() == full[step - 1]
                extra.state = {"step": step, "order": np.arange(step)}
                mgr.save(step, state, loader={"train": dl, "extra": extra})
                if step == 9:
                    break
        mgr.wait_until_finished()
    for expect in (9, 8):  # RAM, then the object tier
        if expect == 8:
            shutil.rmtree(shm_dir)
        fresh, other = make_loader(), Stateful()
        with CheckpointManager(tiers()) as mgr:
            assert mgr.restore(state, loader={"train": fresh, "extra": other}) == expect
            assert mgr.last_restore_info.tier == ("ram" if expect == 9 else "file")
            assert loaderstate.KEY not in state  # never left in the caller's state
        assert batches(fresh, 30 - expect) == full[expect:]
        assert other.state["step"] == expect and np.array_equal(other.state["order"], np.arange(expect))
    with CheckpointManager(tiers()) as mgr:  # a restore into a new state: the loader's state is not in it
        fresh = make_loader()
        out = mgr.restore(loader={"train": fresh, "extra": Stateful()})
        assert set(out) == {"w", "step"} and batches(fresh, 3) == full[8:11]
        with pytest.raises(StateMismatchError, match="holds no state for 'other'"):
            mgr.restore(state, loader={"other": Stateful()})


def test_a_step_saved_without_a_loader_restores_one_only_as_an_error(shm_dir):
    with CheckpointManager([MemoryTier(shm_dir)]) as mgr:
        mgr.save(1, {"x": np.zeros(2)})
        mgr.wait_until_finished()
        with pytest.raises(StateMismatchError, match="without loader="):
            mgr.restore({"x": np.zeros(2)}, loader=make_loader())
        with pytest.raises(ArgumentError, match="reserved"):
            mgr.save(2, {loaderstate.KEY: 1}, loader=make_loader())


@pytest.mark.slow
def test_fsdp_ranks_resume_their_own_loaders_and_the_sharded_step_exports_whole(shm_dir, tmp_path):
    """Two gloo ranks, an FSDP2 model through DCP, a loader per rank with its own order: each rank gets its
    own loader back (RAM, then the object tier); the step's sharded weights export as full tensors."""
    pytest.importorskip("safetensors")
    from safetensors.torch import load_file

    from tierfs.adapters.safetensors import export_safetensors

    sys.path.insert(0, str(HERE))
    import gloo_job

    out = tmp_path / "out"
    out.mkdir()
    results = gloo_job.run_job(2, HERE / "children" / "loader_fsdp_child.py", shm_dir, str(tmp_path / "obj"), str(out))
    for r in results:
        assert r["ram"] == [5, "ram", True] and r["object"] == [4, "file", True], r
    got = export_safetensors([ObjectTier(f"file://{tmp_path}/obj")], tmp_path / "hf", 4, prefix="model")
    full = torch.load(out / "full4.pt", weights_only=True)
    tensors = load_file(tmp_path / "hf" / "model.safetensors")
    assert got.files == ["model.safetensors"] and tensors.keys() == full.keys()
    for k in full:
        assert torch.equal(tensors[k], full[k]), k
    store = TieredStore([ObjectTier(f"file://{tmp_path}/obj")], cleanup=False)
    try:  # each rank's loader state is in its own shard, beside the DCP items, as JSON and arrays
        for rank in (0, 1):
            entries = store.read_manifest(4, rank)[0].entries
            assert any(e.name == DCP_EXTRA_PREFIX + "index" and e.kind == "json" for e in entries)
    finally:
        store.close()


# -- Lightning: the state Lightning saves already goes through the plugin ---------------------------------------
def test_lightning_resumes_a_stateful_dataloader_mid_epoch_from_ram_and_the_object_tier(shm_dir, tmp_path):
    pl = pytest.importorskip("lightning.pytorch")
    from lightning.pytorch.callbacks import ModelCheckpoint

    from tierfs.adapters.lightning import TieredCheckpointIO

    seen: list[list[int]] = []

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(1, 1)

        def training_step(self, batch, batch_idx):
            seen.append(batch.tolist())
            return self.net(batch.float()[:, None]).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.0)

        def train_dataloader(self):
            return make_loader()

    def fit(max_steps: int, ckpt: str | None = None) -> TieredCheckpointIO:
        seen.clear()
        io = TieredCheckpointIO([MemoryTier(shm_dir, keep=LatestN(2)),
                                 ObjectTier(f"file://{tmp_path}/obj", save=FixedIntervalPolicy(4))],
                                remove_from="first", background_bandwidth=None)
        cb = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=1, save_top_k=-1)
        trainer = pl.Trainer(accelerator="cpu", max_steps=max_steps, plugins=[io], callbacks=[cb], logger=False,
                             enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=True)
        trainer.fit(Model(), ckpt_path=ckpt)
        return io

    full = batches(make_loader(), 16)
    fit(9)
    assert seen == full[:9]
    for step, ckpt in ((9, str(tmp_path / "ckpt" / "last.ckpt")), (8, str(tmp_path / "ckpt" / "epoch=1-step=8.ckpt"))):
        if step == 8:  # another machine: RAM is empty, the object tier serves step 8
            shutil.rmtree(shm_dir)
        io = fit(16, ckpt if step == 8 else "last.ckpt")
        assert [io.last_restore_info.step, io.last_restore_info.tier] == [step, "ram" if step == 9 else "file"]
        assert seen == full[step:], step
    store = TieredStore([ObjectTier(f"file://{tmp_path}/obj")], cleanup=False)
    try:  # the loader's state (a generator state among it) went in without pickle
        assert store.manifest(8).metadata["lightning"]["pickles"] == 0
    finally:
        store.close()


# -- Hugging Face Trainer --------------------------------------------------------------------------------------
@pytest.mark.slow
def test_hf_trainer_resumes_its_data_and_the_stateful_objects_from_the_object_tier(shm_dir, tmp_path):
    """An uninterrupted run saves step 7 (mid epoch 2) and goes on to 10; a new process-like run resumes
    step 7 from the object tier (RAM and output_dir gone): the Trainer's own batches and an auxiliary
    StatefulDataLoader registered with stateful= continue exactly as in the uninterrupted run."""
    pytest.importorskip("transformers")
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    from tierfs.adapters.transformers import TieredTrainerCallback

    class Tokens(torch.utils.data.Dataset):
        data = torch.randint(0, 32, (20, 4), generator=torch.Generator().manual_seed(1))

        def __len__(self) -> int:
            return len(self.data)

        def __getitem__(self, i: int) -> dict:
            return {"input_ids": self.data[i], "labels": self.data[i]}

    class Record(TrainerCallback):
        def __init__(self, aux: StatefulDataLoader) -> None:
            self.aux, self.it, self.aux_seen = aux, None, []

        def on_step_begin(self, args, state, control, **kw):  # draws one auxiliary batch a step
            self.it = self.it or iter(self.aux)
            try:
                self.aux_seen.append(next(self.it).tolist())
            except StopIteration:
                self.it = iter(self.aux)
                self.aux_seen.append(next(self.it).tolist())

    class Model(GPT2LMHeadModel):
        def forward(self, input_ids=None, labels=None, **kw):
            seen.append(input_ids.tolist())
            return super().forward(input_ids=input_ids, labels=labels, **kw)

    seen: list = []

    def run(resume: bool) -> Record:
        seen.clear()
        torch.manual_seed(0)
        model = Model(GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=32, n_positions=8))
        args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=10, per_device_train_batch_size=4,
                                 save_strategy="steps", save_steps=7, report_to="none", disable_tqdm=True,
                                 use_cpu=True, seed=7, data_seed=11, logging_steps=1000)
        rec = Record(make_loader(3, list(range(10)), 2))
        tiered = TieredTrainerCallback([MemoryTier(shm_dir), ObjectTier(f"file://{tmp_path}/obj")],
                                       stateful={"aux": rec.aux}, background_bandwidth=None)
        trainer = Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[tiered, rec])
        path = tiered.resume_path(step=7) if resume else None  # (the Trainer saves step 10 at the end too)
        assert path == (str(tmp_path / "out" / "checkpoint-7") if resume else None)
        trainer.train(resume_from_checkpoint=path)
        tiered.close()
        return rec

    first = run(False)
    full, full_aux = list(seen), first.aux_seen
    shutil.rmtree(shm_dir)
    shutil.rmtree(tmp_path / "out")
    again = run(True)
    assert seen == full[7:] and again.aux_seen == full_aux[7:]


# -- torchtitan -----------------------------------------------------------------------------------------------
def test_torchtitan_keeps_the_dataloader_out_of_dcp_and_resumes_it(shm_dir, tmp_path):
    pytest.importorskip("torchtitan.components.checkpoint")
    from torch.distributed.checkpoint.stateful import Stateful as DcpStateful
    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.components.optimizer import OptimizersContainer, default_adamw

    from tierfs.adapters.torchtitan import TieredCheckpointManager

    class TrainState(DcpStateful):
        step = 0

        def state_dict(self):
            return {"step": torch.tensor(self.step)}

        def load_state_dict(self, sd):
            self.step = int(sd["step"])

    def run(stop: int) -> tuple[int, list]:
        torch.manual_seed(0)
        model = torch.nn.Linear(2, 2)
        train = TrainState()
        dl = ParallelAwareDataloader(DATA, dp_rank=0, dp_world_size=1, batch_size=3,
                                     sampler=RandomSampler(DATA, generator=torch.Generator().manual_seed(0)))
        config = TieredCheckpointManager.Config(
            enable=True, interval=1, folder="checkpoint", keep_latest_k=0, tier_policies=True,
            tiers=lambda: [MemoryTier(shm_dir, keep=LatestN(2)),
                           ObjectTier(f"file://{tmp_path}/obj", save=FixedIntervalPolicy(4))])
        ckpt = config.build(dataloader=dl, model_parts=[model], lr_schedulers=None, sd_adapter=None,
                            optimizers=OptimizersContainer(default_adamw(lr=1e-2), model_parts=[model]),
                            states={"train_state": train}, base_folder=str(tmp_path / "dump"))
        ckpt.load()
        loaded, out = train.step, []
        while train.step < stop:
            for b in dl:
                train.step += 1
                out.append(b.tolist())
                ckpt.save(train.step)
                if train.step == stop:
                    break
        ckpt.store.wait_until_finished()
        ckpt.close()
        return loaded, out

    full = batches(make_loader(), 16)
    assert run(9) == (0, full[:9])
    assert run(16) == (9, full[9:])  # from RAM
    shutil.rmtree(shm_dir)
    shutil.rmtree(tmp_path / "obj" / "step_000000000016", ignore_errors=True)
    shutil.rmtree(tmp_path / "obj" / "step_000000000012", ignore_errors=True)
    assert run(16) == (8, full[8:])  # RAM gone: the object tier's step 8
    store = TieredStore([ObjectTier(f"file://{tmp_path}/obj")], cleanup=False)
    try:  # no pickled loader state among DCP's items: JSON and arrays beside them
        md = store.read_manifest(8, 0)[0].metadata["dcp"]["state_dict_metadata"]
        assert not [k for k in md if k.startswith("dataloader")]
        assert loaderstate.read_dcp(store, 8)["index"]["objects"]["dataloader"]
    finally:
        store.close()


def test_a_rank_the_saving_job_did_not_have_takes_rank_0s_loader_state_and_says_so(caplog):
    """A job that grew past the saving job's ranks: a new rank takes rank 0's loader state (there is no
    other), and the log says so, naming the rank and the step, since its data order then repeats rank 0's."""
    from tierfs.adapters.loaderstate import _saved_rank

    assert _saved_rank(1, 2, 7) == 1 and not caplog.records
    assert _saved_rank(3, 2, 7) == 0
    assert any("rank 3: step 7 was saved by 2 ranks, so this rank takes rank 0's loader state" in r.getMessage()
               for r in caplog.records)
