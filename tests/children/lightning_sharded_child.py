"""One Lightning run on CPU, 2 processes (gloo), FSDP2 ``fully_shard`` under TieredModelParallelStrategy
(run by tests/test_lightning_sharded.py; Lightning re-runs this script for rank 1).

    python lightning_sharded_child.py CONFIG_JSON

CONFIG: ram (dir), obj (file:// URL or ""), ckpt_dir, max_steps, resume ("" or a path), out (result file,
written by rank 0: the full model and optimizer state dicts gathered at the end), sleep (seconds per step).
Every step trains on the same fixed batch, so a resumed run can be compared bit for bit with an
uninterrupted one.
"""

import json
import sys
import time

import torch
import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
from torch.distributed.fsdp import fully_shard

from tierfs.adapters.lightning import TieredModelParallelStrategy
from tierfs.policies import FixedIntervalPolicy, LatestN
from tierfs.tiers import MemoryTier, ObjectTier


class Model(pl.LightningModule):
    def __init__(self, out: str, sleep: float = 0.0) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

    def configure_model(self):
        mesh = self.device_mesh["data_parallel"]
        for m in self.net:
            if isinstance(m, torch.nn.Linear):
                fully_shard(m, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        if self.hparams.sleep:
            time.sleep(self.hparams.sleep)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.9)
        # per step: a checkpoint is taken at a batch end, before an epoch-interval scheduler would step, and
        # Lightning's own ModelParallelStrategy then resumes off the uninterrupted run as well
        return [opt], [{"scheduler": sched, "interval": "step"}]

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)  # one batch per epoch: a run resumed at any step sees the same
        x = torch.randn(16, 4, generator=g)
        y = x.sum(1, keepdim=True) + 0.1 * torch.randn(16, 1, generator=g)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16, shuffle=False)

    def on_train_start(self):
        if self.trainer.ckpt_path:  # the restored state (an optimizer with no state yet would be initialised)
            self._dump(self.hparams.out + ".start")

    def on_train_end(self):
        self._dump(self.hparams.out)

    def _dump(self, path):
        # collective: the full (unsharded) states, written by rank 0
        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        opt = self.trainer.optimizers[0]
        model_sd = get_model_state_dict(self.net, options=opts)
        optim_sd = get_optimizer_state_dict(self.net, opt, options=opts)
        if self.global_rank == 0:
            torch.save({"model": model_sd, "optim": optim_sd, "step": self.trainer.global_step,
                        "lr": opt.param_groups[0]["lr"]}, path)


def main() -> None:
    cfg = json.loads(sys.argv[1])
    pl.seed_everything(0, workers=True)
    tiers = [MemoryTier(cfg["ram"] or "/dev/shm/unused", keep=LatestN(3))]  # not opened for "plain"
    if cfg.get("obj"):
        tiers.append(ObjectTier(cfg["obj"], save=FixedIntervalPolicy(cfg.get("obj_every", 2)), keep=LatestN(3)))
    strategy = TieredModelParallelStrategy(tiers, remove_from="first", background_bandwidth=None, exit_timeout=60)
    if cfg.get("plain"):  # Lightning's own strategy, checkpoints as DCP directories (for comparison)
        strategy = pl.strategies.ModelParallelStrategy()
    cb = ModelCheckpoint(dirpath=cfg["ckpt_dir"], every_n_train_steps=1, save_top_k=2, monitor="step",
                         mode="max", save_last=True)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=cfg["max_steps"],
                         callbacks=[cb], logger=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0)
    trainer.fit(Model(cfg["out"], cfg.get("sleep", 0.0)), ckpt_path=cfg.get("resume") or None)
    if trainer.global_rank == 0:
        with open(cfg["out"] + ".json", "w") as f:
            json.dump({"last": cb.last_model_path, "restored": getattr(strategy, "last_restore_info", None) and
                       {"step": strategy.last_restore_info["step"],
                        "sources": strategy.last_restore_info["sources"]}}, f)


if __name__ == "__main__":
    main()
