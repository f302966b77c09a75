"""One rank of a 2-process gloo job driving tierfs's torchtitan checkpoint manager the way torchtitan's
trainer does (``config.checkpoint.build(...)``, ``save(step)``, ``load(step=-1)``).

    torchtitan_child.py SHM_ROOT OBJ_DIR DUMP MODE ASYNC   (MODE: save | load; ASYNC: disabled | async)

save: trains a tiny model 4 steps, checkpointing every 2 (steps 2 and 4), changing the weights right after
each save. load: a fresh model and optimizer, ``load()`` of the newest step; prints whether the state
equals the one saved at step 4, the step loaded, and the tier that served each saving rank.
"""

import os
import sys
import warnings

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful

from tierfs.adapters.torchtitan import TieredCheckpointManager
from tierfs.tiers import MemoryTier, ObjectTier

from _child import finish  # tests/ is the script's directory, first on sys.path

warnings.filterwarnings("ignore")


class Optimizers(Stateful):
    """A stand-in for torchtitan's OptimizersContainer (which needs spmd_types): a Stateful optimizer."""

    def __init__(self, model):
        self.opt = torch.optim.Adam(model.parameters(), lr=1e-2)

    def state_dict(self):
        return self.opt.state_dict()

    def load_state_dict(self, sd):
        self.opt.load_state_dict(sd)


class TrainState(Stateful):
    def __init__(self):
        self.step = 0

    def state_dict(self):
        return {"step": torch.tensor(self.step)}

    def load_state_dict(self, sd):
        self.step = int(sd["step"])


def main() -> None:
    shm, obj, dump, mode, async_mode = sys.argv[1:6]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0 if mode == "save" else 99)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opts = Optimizers(model)
    train = TrainState()
    config = TieredCheckpointManager.Config(
        enable=True, interval=2, folder="checkpoint", initial_load_model_only=False, async_mode=async_mode, keep_latest_k=0,
        tiers=lambda: [MemoryTier(os.path.join(shm, f"node{rank}")), ObjectTier(f"file://{obj}")])
    ckpt = config.build(dataloader=None, model_parts=[model], optimizers=opts, lr_schedulers=None,
                        states={"train_state": train}, sd_adapter=None, base_folder=dump)
    assert isinstance(ckpt, TieredCheckpointManager)
    os.makedirs(dump, exist_ok=True)
    ref = os.path.join(dump, f"ref{rank}.pt")
    out = {"rank": rank}
    if mode == "save":
        assert ckpt.load() is False  # fresh start
        for step in range(1, 5):
            torch.manual_seed(step)
            model(torch.randn(4, 8)).pow(2).sum().backward()
            opts.opt.step()
            opts.opt.zero_grad()
            train.step = step
            if step == 4:
                torch.save({"model": {k: v.clone() for k, v in model.state_dict().items()},
                            "exp_avg": [s["exp_avg"].clone() for s in opts.opt.state.values()]}, ref)
            ckpt.save(step)
            with torch.no_grad():  # touch the model right after the save (torchtitan #930)
                for p in model.parameters():
                    p.add_(1000.0)
        ckpt.maybe_wait_for_saving()
        ckpt.store.wait_until_finished()
        out["steps"] = sorted(ckpt.store.steps())
        out["folder_listing"] = sorted(os.listdir(dump))
    else:
        assert ckpt.load() is True
        want = torch.load(ref)
        got = model.state_dict()
        out["same_model"] = all(torch.equal(got[k], v) for k, v in want["model"].items())
        out["same_optim"] = all(torch.equal(s["exp_avg"], e)
                                for s, e in zip(opts.opt.state.values(), want["exp_avg"]))
        out["train_step"] = train.step
        out["sources"] = {str(k): v for k, v in ckpt.last_reader.sources.items()}
    ckpt.close()
    finish(out)


if __name__ == "__main__":
    main()
