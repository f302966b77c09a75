"""Run by test_transformers.py: a tiny GPT-2 trained by a real ``transformers.Trainer`` on CPU.

``python hf_child.py CONFIG_JSON`` with keys:

- ``ram``, ``obj``, ``out``: the RAM tier's directory, the object tier's directory (``file://``), the
  Trainer's ``output_dir``; ``every``: the object tier's save interval; ``max_steps``;
- ``tiered``: use ``TieredTrainerCallback`` (else a plain run, the reference);
- ``resume``: resume through ``resume_path()``; ``hang_at``: block forever in ``on_save`` of that step,
  after the tierfs callback committed it (the test SIGKILLs the process there);
- ``result``: where to ``torch.save`` the final model and optimizer state dicts, and the resume path.

Under ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` (as torchrun sets them) the Trainer
initialises torch.distributed (gloo) itself.
"""

from __future__ import annotations

import json
import os
import sys
import threading

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 64, length: int = 8, vocab: int = 64) -> None:
        g = torch.Generator().manual_seed(1234)
        self.data = torch.randint(0, vocab, (n, length), generator=g)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.data[i], "labels": self.data[i]}


class Hang(TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_save(self, args, state, control, **kw):  # type: ignore[no-untyped-def]
        if state.global_step == self.step:
            print(f"hanging at {self.step}", flush=True)
            threading.Event().wait()  # until SIGKILL


def main() -> None:
    cfg = json.loads(sys.argv[1])
    torch.use_deterministic_algorithms(True)
    args = TrainingArguments(
        output_dir=cfg["out"], max_steps=cfg["max_steps"], per_device_train_batch_size=4,
        learning_rate=1e-2, lr_scheduler_type="linear", warmup_steps=2, weight_decay=0.01,
        save_strategy="steps", save_steps=1, logging_steps=1000, report_to="none", disable_tqdm=True,
        use_cpu=True, seed=7, data_seed=11, full_determinism=True, dataloader_num_workers=0)
    torch.manual_seed(7)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=16,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    callbacks: list[TrainerCallback] = []
    tiered = None
    if cfg["tiered"]:
        from tierfs.tiers import MemoryTier, ObjectTier
        from tierfs.adapters.transformers import TieredTrainerCallback
        from tierfs.policies import FixedIntervalPolicy

        tiered = TieredTrainerCallback([MemoryTier(cfg["ram"]),
                                        ObjectTier("file://" + cfg["obj"], save=FixedIntervalPolicy(cfg["every"]))],
                                       background_bandwidth=None)
        callbacks.append(tiered)
    if cfg.get("hang_at"):
        callbacks.append(Hang(cfg["hang_at"]))
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=callbacks)
    resume = None
    if cfg.get("resume"):
        assert tiered is not None
        resume = tiered.resume_path()
    trainer.train(resume_from_checkpoint=resume)
    if tiered is not None:
        tiered.close()
    if args.process_index == 0 and cfg.get("result"):
        torch.save({"model": model.state_dict(), "optimizer": trainer.optimizer.state_dict(), "resume": resume,
                    "step": trainer.state.global_step}, cfg["result"])
    print("done", flush=True)


if __name__ == "__main__":
    main()
