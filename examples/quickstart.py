import getpass
import os
import tempfile
import zlib

import torch
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from tierfs import CheckpointManager
from tierfs.policies import FixedIntervalPolicy, LatestN
from tierfs.tiers import MemoryTier, ObjectTier

user = getpass.getuser()
ram_dir = os.environ.get("TIERFS_QUICKSTART_RAM", f"/dev/shm/tierfs-quickstart-{user}")
# any fsspec URL, e.g. s3://bucket/run (the s3 extra; an existing bucket; credentials set as for boto3)
object_url = os.environ.get("TIERFS_QUICKSTART_URL", f"file://{tempfile.gettempdir()}/tierfs-quickstart-{user}")

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
opt = torch.optim.Adam(model.parameters(), lr=1e-3)


def checkpoint_state():  # DCP's state dicts: Adam's state exists even before its first step, to restore into
    model_sd, optim_sd = get_state_dict(model, opt)
    return {"model": model_sd, "optim": optim_sd}


def crc32():  # of the weights and Adam's state, to see that a restore gives back exactly what was saved
    tensors = [*model.parameters(), *(t for s in opt.state.values() for t in s.values())]
    return f"{zlib.crc32(torch.cat([t.detach().flatten() for t in tensors]).numpy()):08x}"


with CheckpointManager([
    MemoryTier(ram_dir, save=FixedIntervalPolicy(2), keep=LatestN(2)),      # every 2nd step, newest 2 kept
    ObjectTier(object_url, save=FixedIntervalPolicy(10), keep=LatestN(3)),  # every 10th, in the background
]) as mgr:
    state = checkpoint_state()
    start = mgr.restore(state) or 0  # the newest step, loaded into `state` in place (None: nothing saved yet)
    if start:
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        print(f"restored {mgr.last_restore_info}, state crc32 {crc32()}")
    for step in range(start + 1, start + 11):
        x = torch.randn(64, 32, generator=torch.Generator().manual_seed(step))  # each step's data: its own seed
        loss = torch.nn.functional.mse_loss(model(x), x.pow(2).mean(1, keepdim=True))
        opt.zero_grad()
        loss.backward()
        opt.step()
        mgr.save(step, checkpoint_state(), metrics={"loss": loss.item()})  # returns after a copy into RAM
    mgr.wait_until_finished()
    print(f"trained steps {start + 1}..{step}, loss {loss.item():.4f}, state crc32 {crc32()}")
    for tier in mgr.store.tiers:
        print(f"{tier.name:5} holds steps {tier.committed_steps()} in {tier.location}")
