"""One rank of a 2-node job for ``tierfs status``: a torch.nn model with AdamW saved to a RAM tier (SHM/node<N>)
and ``PeerTier(replicas=1)``. Step 1 is saved and replicated; step 2 is committed in RAM while its
replication is held before its first bytes move (a test hook). Then the rank prints ``READY`` and waits until
the test kills it. Nothing else is printed on stdout.

    status_peer_child.py SHM
"""

import os
import sys
import threading

import torch
import torch.distributed as dist

from tierfs import TieredStore
from tierfs.testing import hooks
from tierfs.tiers import MemoryTier, PeerTier


def main() -> None:
    shm = sys.argv[1]
    dist.init_process_group("gloo")
    torch.manual_seed(dist.get_rank())
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    opt = torch.optim.AdamW(model.parameters())
    never = threading.Event()

    def hold_step_2(step: int, tier: str, nbytes: int) -> None:
        if step == 2 and tier == "peer":
            never.wait()  # the replication of step 2 stays in flight until the process is killed

    store = TieredStore([MemoryTier(os.path.join(shm, f"node{os.environ['TIERFS_NODE_RANK']}")), PeerTier(replicas=1)])
    for step in (1, 2):
        model(torch.randn(4, 32)).sum().backward()
        opt.step()
        if step == 2:
            hooks.add("transfer", hold_step_2)
        store.save(step, {"model": model.state_dict(), "optim": opt.state_dict()})
        if step == 1:
            store.wait_until_finished()
    print("READY", flush=True)
    never.wait()


if __name__ == "__main__":
    main()
