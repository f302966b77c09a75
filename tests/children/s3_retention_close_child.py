"""One rank of a job of a few processes (gloo, each its own node) saving steps 1-5 to a RAM tier and an S3
object tier, each keeping the latest 2, then waiting for every background copy and deletion; twice:

    s3_retention_close_child.py SHM CLOSED_URL ENDED_URL

first to CLOSED_URL, then closing the store; then to ENDED_URL, ending the process with that store still
open (a job cut off after its last save's copies and deletions were done). Storage options as JSON in
``TIERFS_TEST_STORAGE_OPTIONS``. Prints one JSON line: the rank.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import torch.distributed as dist

from tierfs import TieredStore
from tierfs.policies import LatestN
from tierfs.tiers import MemoryTier, ObjectTier

from _child import finish  # tests/children/ is the script's directory, first on sys.path


def state_for(rank: int, step: int) -> dict:
    rng = np.random.default_rng(100 * rank + step)
    return {"w": rng.standard_normal(2_000 + rank).astype(np.float32), "step": step}


def saved(ram: str, url: str, rank: int) -> TieredStore:
    """A store on ``ram`` and ``url`` holding steps 1-5 as its keep policies leave them, its work done."""
    opts = json.loads(os.environ["TIERFS_TEST_STORAGE_OPTIONS"])
    store = TieredStore([MemoryTier(os.path.join(ram, f"node{rank}"), keep=LatestN(2)),
                         ObjectTier(url, storage_options=opts, keep=LatestN(2))], timeout=60)
    for step in range(1, 6):
        store.save(step, state_for(rank, step))
    store.wait_until_finished()
    return store


def main() -> None:
    shm, closed, ended = sys.argv[1:4]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    saved(os.path.join(shm, "closed"), closed, rank).close()
    saved(os.path.join(shm, "ended"), ended, rank)
    finish({"rank": rank})  # the process ends here, the second store still open


if __name__ == "__main__":
    main()
