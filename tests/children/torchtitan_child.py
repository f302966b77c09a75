"""One rank of a 2-process gloo job driving tierfs's torchtitan checkpoint manager the way torchtitan's
trainer does (``config.build(...)``, ``load()``, ``save(step)`` every step), with torchtitan's own
``OptimizersContainer``.

    torchtitan_child.py SHM_ROOT OBJ_DIR DUMP ASYNC TOTAL SLEEP

Loads the newest step every rank holds (a fresh start when there is none), then trains up to step TOTAL
(each step's batch is seeded by the step, so a resumed run repeats an uninterrupted one), saving every
step: RAM takes each, the object tier every 2nd (the tiers' own policies). After each save the weights are
touched until the next step's forward (a save must not see them). SLEEP seconds pass after each step (a
job to kill). At the end the final model and optimizer state go to DUMP/final<rank>.pt; prints the step
loaded and the tier that served each saving rank.
"""

import os
import sys
import time
import warnings

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful
from torchtitan.components.optimizer import OptimizersContainer, default_adamw

from tierfs.adapters.torchtitan import TieredCheckpointManager
from tierfs.policies import FixedIntervalPolicy
from tierfs.tiers import MemoryTier, ObjectTier

from _child import finish  # tests/children/ is the script's directory, first on sys.path

warnings.filterwarnings("ignore")


class TrainState(Stateful):
    def __init__(self):
        self.step = 0

    def state_dict(self):
        return {"step": torch.tensor(self.step)}

    def load_state_dict(self, sd):
        self.step = int(sd["step"])


def main() -> None:
    shm, obj, dump, async_mode, total, sleep = sys.argv[1:7]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opts = OptimizersContainer(default_adamw(lr=1e-2), model_parts=[model])
    train = TrainState()
    config = TieredCheckpointManager.Config(
        enable=True, interval=1, folder="checkpoint", initial_load_model_only=False, async_mode=async_mode,
        keep_latest_k=0, tier_policies=True,
        tiers=lambda: [MemoryTier(os.path.join(shm, f"node{rank}")),
                       ObjectTier(f"file://{obj}", save=FixedIntervalPolicy(2))])
    ckpt = config.build(dataloader=None, model_parts=[model], optimizers=opts, lr_schedulers=None,
                        states={"train_state": train}, sd_adapter=None, base_folder=dump)
    assert isinstance(ckpt, TieredCheckpointManager)
    os.makedirs(dump, exist_ok=True)
    out = {"rank": rank, "loaded": ckpt.load() and train.step,
           "sources": {str(k): v for k, v in ckpt.last_reader.sources.items()} if ckpt.last_reader else {}}
    for step in range(train.step + 1, int(total) + 1):
        g = torch.Generator().manual_seed(step)
        model(torch.randn(4, 8, generator=g)).pow(2).sum().backward()
        opts.step()
        opts.zero_grad()
        train.step = step
        ckpt.save(step)
        saved = [p.detach().clone() for p in model.parameters()]
        with torch.no_grad():  # touch the model right after the save (torchtitan #930), then put it back
            for p in model.parameters():
                p.add_(1000.0)
        ckpt.maybe_wait_for_saving()
        with torch.no_grad():
            for p, s in zip(model.parameters(), saved):
                p.copy_(s)
        time.sleep(float(sleep))
    ckpt.store.wait_until_finished()
    torch.save({"model": model.state_dict(), "optim": opts.state_dict()}, os.path.join(dump, f"final{rank}.pt"))
    out["folder_listing"] = sorted(os.listdir(dump))
    ckpt.close()
    finish(out)


if __name__ == "__main__":
    main()
