"""One rank of a 2-process CheckpointManager job (gloo on localhost): an FSDP2 model (its weights and Adam
state DTensors, saved through DCP) and a data loader of the rank's own, saved with every step.

    loader_fsdp_child.py SHM_ROOT OBJ_DIR OUT

Each rank is its own node (``SHM_ROOT/node<rank>``); ``OBJ_DIR`` is a shared file:// object tier taking
every 2nd step. The rank's ``StatefulDataLoader`` draws 2 samples a step from 24 with a sampler seeded by
the rank (12 batches an epoch). The job trains 10 steps and saves steps 1 to 5 (``loader=`` the rank's
loader), so the batches of steps 6 to 10 are what an uninterrupted run sees after step 5. Then, in new
managers: restore the newest step from RAM into a fresh loader (step 5) and check that it yields the
batches of steps 6 to 10; remove this node's RAM and restore from the object tier (step 4): the batches of
steps 5 to 10. Rank 0 writes the full (unsharded) model weights of step 4 to ``OUT/full4.pt``.

Prints one JSON line: rank, the steps restored and the tiers that served them, and whether the batches
matched.
"""

import os
import shutil
import sys
import warnings

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.checkpoint.state_dict import get_state_dict
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import RandomSampler

from tierfs import CheckpointManager
from tierfs.policies import FixedIntervalPolicy, LatestN
from tierfs.tiers import MemoryTier, ObjectTier

from _child import finish  # tests/children/ is the script's directory, first on sys.path

warnings.filterwarnings("ignore")
DATA = list(range(24))


def loader(rank: int) -> StatefulDataLoader:
    return StatefulDataLoader(DATA, batch_size=2, sampler=RandomSampler(DATA, generator=torch.Generator().manual_seed(
        100 + rank)))


def main() -> None:
    shm, obj, out = sys.argv[1:4]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ram = os.path.join(shm, f"node{rank}")

    def tiers():
        return [MemoryTier(ram, keep=LatestN(2)), ObjectTier(f"file://{obj}", save=FixedIntervalPolicy(2))]

    dl, seen = loader(rank), []
    with CheckpointManager(tiers()) as mgr:
        batches = iter(dl)
        for step in range(1, 11):
            x = next(batches)
            seen.append(x.tolist())
            model(torch.randn(2, 6, generator=torch.Generator().manual_seed(int(x.sum())))).pow(2).sum().backward()
            opt.step()
            opt.zero_grad()
            if step <= 5:
                msd, osd = get_state_dict(model, opt)
                mgr.save(step, {"model": msd, "optim": osd}, loader=dl)
            if step == 4:
                full = {k: v.full_tensor() for k, v in model.state_dict().items()}
                if rank == 0:
                    torch.save(full, os.path.join(out, "full4.pt"))
        mgr.wait_until_finished()
    result = {"rank": rank}
    for where in ("ram", "object"):
        if where == "object":
            dist.barrier()  # every rank is done with RAM
            shutil.rmtree(ram)
        fresh = loader(rank)
        m2 = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
        fully_shard(m2, mesh=mesh)
        o2 = torch.optim.Adam(m2.parameters(), lr=1e-2)
        msd, osd = get_state_dict(m2, o2)
        with CheckpointManager(tiers()) as mgr:
            step = mgr.restore({"model": msd, "optim": osd}, loader=fresh)
            tier = mgr.last_restore_info.tier
        it = iter(fresh)
        rest = [next(it).tolist() for _ in range(10 - step)]
        result[where] = [step, tier, rest == seen[step:]]
    finish(result)


if __name__ == "__main__":
    main()
