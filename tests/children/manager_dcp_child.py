"""One rank of a multi-process CheckpointManager job (gloo on localhost) whose model is sharded with FSDP2
(``fully_shard`` on a CPU device mesh): its model and Adam state are DTensors, saved through DCP.

    manager_dcp_child.py SHM_ROOT OBJ_DIR MODE   (MODE: save | load | mismatch)

Each rank is its own node with its own RAM directory (``SHM_ROOT/node<rank>``); ``OBJ_DIR`` is a shared
file:// object tier. Tiers: RAM takes every step and keeps 2, the object tier every 2nd step.

save: train 3 steps, saving each through the manager (asynchronously, the default), changing the model
right after each save; then restore the newest step into a differently initialised model and optimizer.
load: restore the newest common step into a fresh model and optimizer (any world size).
mismatch: rank 1's target has a value the checkpoint lacks: every rank must raise (none may hang in DCP).

Prints one JSON line: rank, world, the digest of the full (unsharded) state saved or restored, the
restored step, the tier that served it, the steps per tier, and the restored per-rank values.
"""

import os
import sys
import warnings

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from tierfs import CheckpointManager
from tierfs.policies import FixedIntervalPolicy, LatestN
from tierfs.tiers import MemoryTier, ObjectTier

from _child import finish  # tests/children/ is the script's directory, first on sys.path
from _digest import state_digest

warnings.filterwarnings("ignore")


def build(seed: int, mesh) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def train(model, opt, step: int) -> None:
    g = torch.Generator().manual_seed(1000 + step)  # the same batch on every rank
    model(torch.randn(4, 16, generator=g)).pow(2).sum().backward()
    opt.step()
    opt.zero_grad()


def state_of(model, opt, rank: int, step: int) -> dict:
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd, "loader": {"rank": rank, "position": step * 100 + rank,
                                                   "order": np.arange(4, dtype=np.int32) + rank}}


def digest(model, opt) -> str:
    """sha256 over every full (unsharded) tensor and every other value of the model and optimizer."""
    msd, osd = get_state_dict(model, opt)
    return state_digest({"model": msd, "optim": osd})


def restore(mgr, model, opt, target, rank, out) -> None:
    """Restore in place, then report what came back."""
    out["restored_step"] = mgr.restore(target)
    set_state_dict(model, opt, model_state_dict=target["model"], optim_state_dict=target["optim"])
    out["restored"] = digest(model, opt)
    out["tier"] = mgr.last_restore_info.tier
    out["loader"] = {"rank": target["loader"]["rank"], "position": target["loader"]["position"],
                     "order": target["loader"]["order"].tolist(), "dtype": str(target["loader"]["order"].dtype)}
    out["metrics"] = mgr.metrics(out["restored_step"]) if rank < 2 else None


def main() -> None:
    shm, obj, mode = sys.argv[1:4]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    tiers = [MemoryTier(os.path.join(shm, f"node{rank}"), save=FixedIntervalPolicy(1), keep=LatestN(2)),
             ObjectTier(f"file://{obj}", save=FixedIntervalPolicy(2))]
    out = {"rank": rank, "world": world}
    with CheckpointManager(tiers) as mgr:
        if mode == "save":
            model, opt = build(0, mesh)
            saved = {}
            for step in range(1, 4):
                train(model, opt, step)
                saved[step] = digest(model, opt)
                assert mgr.save(step, state_of(model, opt, rank, step), metrics={"loss": 1.0 / step})
                with torch.no_grad():  # training goes on at once; the checkpoint must not see this
                    for p in model.parameters():
                        p.add_(1.0)
            mgr.wait_until_finished()
            dist.barrier()
            out["saved"] = {str(k): v for k, v in saved.items()}
            out["steps"] = {str(k): v for k, v in mgr.store.steps().items()}
        model, opt = build(5, mesh)  # different weights; one step so that Adam's state exists
        train(model, opt, 0)
        target = state_of(model, opt, -1, -1)
        if mode == "mismatch":
            if rank == 1:
                target["loader"]["seed"] = 0
            try:
                mgr.restore(target)
                out["error"] = None
            except Exception as e:  # noqa: BLE001 - reported to the test
                out["error"] = type(e).__name__
        else:
            restore(mgr, model, opt, target, rank, out)
    finish(out)


if __name__ == "__main__":
    main()
