"""One rank of a data-parallel job (every rank holds the same model and Adam state, as with DDP) that saves
through CheckpointManager (torch state -> DCP) to RAM + a peer tier only: no durable tier at all.

    ddp_child.py SHM MODE   (MODE: save | load)

save: 4 steps, saving each. load: restore the newest step into a fresh model. Prints one JSON line: rank,
restored step, whether model and optimizer equal a from-scratch run to that step bit for bit, the steps
in this rank's RAM after the restore, and the replicas it keeps.
"""

import os
import sys
import warnings

import torch
import torch.distributed as dist

from tierfs import CheckpointManager
from tierfs.policies import LatestN
from tierfs.tiers import MemoryTier, PeerTier

from _child import finish  # tests/children/ is the script's directory, first on sys.path

warnings.filterwarnings("ignore")


def build():
    torch.manual_seed(0)  # the same model on every rank
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 4))
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def train(model, opt, step: int) -> None:
    g = torch.Generator().manual_seed(1000 + step)
    model(torch.randn(8, 64, generator=g)).pow(2).sum().backward()
    opt.step()
    opt.zero_grad()


def flat(model, opt) -> list[torch.Tensor]:
    osd = opt.state_dict()["state"]
    return list(model.state_dict().values()) + [v for s in osd.values() for v in s.values()]


def main() -> None:
    shm, mode = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ram = MemoryTier(os.path.join(shm, f"node{os.environ['TIERFS_NODE_RANK']}"), keep=LatestN(2))
    peer = PeerTier(replicas=1)
    mgr = CheckpointManager([ram, peer])
    model, opt = build()
    out = {"rank": rank}
    if mode == "save":
        for step in range(1, 5):
            train(model, opt, step)
            mgr.save(step, {"model": model.state_dict(), "optim": opt.state_dict()})
        mgr.wait_until_finished()
    else:
        train(model, opt, 0)  # Adam's state exists: it is overwritten in place
        state = {"model": model.state_dict(), "optim": opt.state_dict()}
        step = mgr.restore(state)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        mgr.wait_until_finished()  # replicas a replaced node kept for others come back in the background
        ref_model, ref_opt = build()
        for s in range(1, step + 1):
            train(ref_model, ref_opt, s)
        out.update(step=step, exact=all(torch.equal(a, b) for a, b in zip(flat(model, opt), flat(ref_model, ref_opt))),
                   tier=mgr.last_restore_info.tier, skipped=[list(x) for x in mgr.last_restore_info.skipped],
                   ram=ram.committed_steps(), held={str(k): v for k, v in peer.holdings().items()})
    mgr.close()
    finish(out)


if __name__ == "__main__":
    main()
