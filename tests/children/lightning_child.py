"""One Lightning training run on CPU with TieredCheckpointIO (run by tests/test_lightning.py).

    python lightning_child.py CONFIG_JSON

CONFIG: ram (dir), obj (file:// URL), ckpt_dir, max_steps, resume ("", a path, or "auto": the plugin's
last_checkpoint()), out (result file), sleep (seconds per step), obj_every (object tier interval), devices,
strategy, top_k, wipe_ram, data_seed (the batch: another seed makes another run).
Every epoch is one batch (the same full batch), so each step's data is fixed and a resumed run can be
compared bit for bit with an uninterrupted one.
"""

import json
import os
import sys
import time

import torch
import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint

from tierfs.adapters.lightning import TieredCheckpointIO
from tierfs.policies import FixedIntervalPolicy, LatestN
from tierfs.tiers import MemoryTier, ObjectTier


class Model(pl.LightningModule):
    def __init__(self, sleep: float = 0.0, hidden: int = 8, data_seed: int = 0) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1))
        self.sleep, self.data_seed = sleep, data_seed

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        if self.sleep:
            time.sleep(self.sleep)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.9)
        return [opt], [sched]

    def train_dataloader(self):
        g = torch.Generator().manual_seed(self.data_seed)
        x = torch.randn(32, 4, generator=g)
        y = x.sum(1, keepdim=True) + 0.1 * torch.randn(32, 1, generator=g)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32, shuffle=False)


def main() -> None:
    cfg = json.loads(sys.argv[1])
    pl.seed_everything(0, workers=True)
    io = TieredCheckpointIO([MemoryTier(cfg["ram"], keep=LatestN(2)),
                             ObjectTier(cfg["obj"], save=FixedIntervalPolicy(cfg.get("obj_every", 3)),
                                        keep=LatestN(3))],
                            remove_from=cfg.get("remove_from", "first"), background_bandwidth=None, exit_timeout=60)
    cb = ModelCheckpoint(dirpath=cfg["ckpt_dir"], every_n_train_steps=1, save_top_k=cfg.get("top_k", 2),
                         monitor="step", mode="max", save_last=cfg.get("save_last", True))
    trainer = pl.Trainer(accelerator="cpu", devices=cfg.get("devices", 1), strategy=cfg.get("strategy", "auto"),
                         max_steps=cfg["max_steps"], plugins=[io], callbacks=[cb], logger=False,
                         enable_progress_bar=False, enable_model_summary=False, deterministic=True)
    model = Model(cfg.get("sleep", 0.0), data_seed=cfg.get("data_seed", 0))
    resume = io.last_checkpoint() if cfg.get("resume") == "auto" else cfg.get("resume") or None
    trainer.fit(model, ckpt_path=resume)
    if trainer.is_global_zero:
        opt = trainer.optimizers[0]
        result = {"model": {k: v.clone() for k, v in model.state_dict().items()},
                  "optim": opt.state_dict(), "global_step": trainer.global_step,
                  "last_model_path": cb.last_model_path,
                  "restored": ([io.last_restore_info.step, io.last_restore_info.tier]
                               if io.last_restore_info is not None else None)}
        torch.save(result, cfg["out"])
    if cfg.get("rank_file"):
        with open(f"{cfg['rank_file']}.{trainer.global_rank}", "w") as f:
            json.dump({"rank": trainer.global_rank, "step": trainer.global_step,
                       "w": model.net[0].weight.sum().item()}, f)


if __name__ == "__main__":
    main()
