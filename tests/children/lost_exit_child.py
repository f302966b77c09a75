"""One rank of a 3-rank job (gloo on localhost, each its own node and RAM directory under SHM) with a RAM
tier and ``PeerTier(replicas=1)``, ending through the interpreter's own teardown (no ``os._exit``), so
that its exit status says whether it exits cleanly.

    lost_exit_child.py SHM MODE

MODE ``run``: saves steps 1 and 2. ``lost`` (after the test removed nodes 1 and 2's RAM directories: rank
1's shard and its only replica are gone): a store's restore, then a manager's, each raising
``CheckpointLostError``. Prints one JSON line: the error class of each restore, and how many of gloo's
threads the process has before the stores open, while one is open and once both are closed (the store
objects still referenced: their groups must be gone all the same, not left to the interpreter's teardown).
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


def gloo_threads() -> int:
    """This process's threads of gloo's groups (their workers and I/O loops)."""
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # ended meanwhile
            pass
    return sum(1 for n in names if "gloo" in n)


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
        dist.barrier()  # the default group's own threads start on its first use: they are there before
        before = gloo_threads()
        with TieredStore(tiers(), timeout=60) as store:
            during = gloo_threads()
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
        out["gloo_threads"] = [before, during, gloo_threads()]
        out["kept"] = [store, mgr] is not None  # both objects live on to the end of main
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
