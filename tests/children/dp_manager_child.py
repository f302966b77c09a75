"""One rank of a data-parallel CheckpointManager job (gloo on localhost, each process its own node, RAM in
SHM/node<N>), saving through DCP.

    dp_manager_child.py SHM OBJ MODE LAYOUT
MODE: save (train and save steps 1 to 3; the last two are saved without DCP's planning, as the manager
replays an unchanged structure), restore (restore the newest step; the object tier may be gone).
LAYOUT: ddp (DistributedDataParallel: every rank holds the whole model and Adam state, plus a tensor of
its own), hsdp (FSDP2 ``fully_shard`` over a 2x2 mesh: shards within a pair of ranks, replicas across
the pairs). Prints one JSON line: the digest of the full state saved or restored, bytes per tier.
"""

import os
import sys
import warnings

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from tierfs import CheckpointManager
from tierfs.policies import LatestN
from tierfs.tiers import MemoryTier, ObjectTier, PeerTier

from _child import finish  # tests/children/ is the script's directory, first on sys.path
from _digest import state_digest as digest
from dp_child import CountingObjectTier, tensors, tree_bytes

warnings.filterwarnings("ignore")


def build(layout: str, seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.LayerNorm(64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 64), torch.nn.LayerNorm(64), torch.nn.Linear(64, 8))
    if layout == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    else:
        fully_shard(model, mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    return model, opt


def train(model, opt, step: int) -> None:
    g = torch.Generator().manual_seed(1000 + step + 7 * dist.get_rank())  # each rank its own batch
    model(torch.randn(8, 32, generator=g)).pow(2).sum().backward()
    opt.step()
    opt.zero_grad()


def state_of(model, opt, rank: int, step: int) -> dict:
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd, "mine": {f"rank{rank}": torch.full((100,), float(step * 10 + rank))}}


def main() -> None:
    shm, obj, mode, layout = sys.argv[1:5]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ram_dir = os.path.join(shm, f"node{rank}")
    tiers = [MemoryTier(ram_dir, keep=LatestN(1)), PeerTier(replicas=1)]
    if os.path.isdir(obj) or mode != "restore":
        tiers.append(CountingObjectTier(f"file://{obj}", keep=LatestN(1)))
    out = {"rank": rank}
    model, opt = build(layout, 0)
    with CheckpointManager(tiers) as mgr:
        if mode == "save":
            for step in (1, 2, 3):
                train(model, opt, step)
                state = state_of(model, opt, rank, step)
                assert mgr.save(step, state)
                mgr.wait_until_finished()
                out[f"objects{step}"] = tree_bytes(obj, f"step_{step:012d}")
            out["saved"] = digest(state)
            out["ram"] = tree_bytes(os.path.join(ram_dir, "step_000000000003"))
            out["replicas"] = tree_bytes(os.path.join(ram_dir, "peers"))
            out["state"] = sum(t.to_local().nbytes if hasattr(t, "to_local") else t.nbytes
                               for part in ("model", "optim", "mine") for t in tensors(state[part]))
        else:
            train(model, opt, 0)  # Adam's state exists; different values than saved
            target = state_of(model, opt, rank, -1)
            out["restored_step"] = mgr.restore(target)
            set_state_dict(model, opt, model_state_dict=target["model"], optim_state_dict=target["optim"])
            out["restored"] = digest(state_of(model, opt, rank, 3) | {"mine": target["mine"]})
            out["tier"] = mgr.last_restore_info.tier
            out["object_read"] = CountingObjectTier.read_bytes
    finish(out)


if __name__ == "__main__":
    main()
