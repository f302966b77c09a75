"""One rank of a 3-rank job (gloo on localhost, each its own node and RAM directory under SHM) with a RAM
tier and ``PeerTier(replicas=1)``, ending through the interpreter's own teardown (no ``os._exit``), so
that its exit status says whether it exits cleanly.

    lost_exit_child.py SHM MODE

MODE ``run``: saves steps 1 and 2. ``lost`` (after the test removed nodes 1 and 2's RAM directories: rank
1's shard and its only replica are gone): a store's restore, then a manager's, each raising
``CheckpointLostError``. Prints one JSON line: the error class of each restore.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import numpy as np
import torch.distributed as dist

from tierfs import CheckpointManager, TieredStore, TierfsError
from tierfs.policies import LatestN
from tierfs.tiers import MemoryTier, PeerTier


def main() -> None:
    shm, mode = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank = dist.get_rank()

    def tiers() -> list[Any]:
        return [MemoryTier(os.path.join(shm, f"node{rank}"), keep=LatestN(2)), PeerTier(replicas=1)]
    out: dict[str, Any] = {"rank": rank}
    if mode == "run":
        with TieredStore(tiers(), timeout=60) as store:
            for step in (1, 2):
                store.save(step, {"w": np.full(1_000 + rank, step, np.float32), "step": step})
            store.wait_until_finished()
    else:
        with TieredStore(tiers(), timeout=60) as store:
            try:
                store.restore()
                out["store"] = None
            except TierfsError as e:
                out["store"] = type(e).__name__
        with CheckpointManager(tiers(), timeout=60) as mgr:
            try:
                mgr.restore({"w": np.zeros(1_000 + rank, np.float32), "step": 0})
                out["manager"] = None
            except TierfsError as e:
                out["manager"] = type(e).__name__
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
