"""Wrote tests/data/format2 (run with tierfs at format version 2, before the object tier spread its keys):
two steps of a small torch.nn model with AdamW, every rank's files under <root>/step_.../, in a local directory."""
import json, os, shutil, sys, zlib
import torch
from tierfs import CheckpointManager
from tierfs.tiers import ObjectTier
from torch.distributed.checkpoint.state_dict import get_state_dict

out = sys.argv[1]
shutil.rmtree(out, ignore_errors=True)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
crcs = {}
with CheckpointManager([ObjectTier(f"file://{os.path.abspath(out)}/run")]) as mgr:
    for step in (1, 2):
        loss = model(torch.randn(16, 32)).pow(2).mean()
        opt.zero_grad(); loss.backward(); opt.step()
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        mgr.save(step, state)
        mgr.wait_until_finished()
        flat = {f"model.{k}": v for k, v in msd.items()}
        flat.update({f"optim.state.{p}.{k}": v for p, s in osd["state"].items() for k, v in s.items()})
        crcs[step] = {k: f"{zlib.crc32(v.detach().reshape(-1).contiguous().view(torch.uint8).numpy()):08x}" for k, v in flat.items()}
json.dump(crcs, open(f"{out}/crc32.json", "w"), indent=1, sort_keys=True)
