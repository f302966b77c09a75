"""One rank of a multi-process job (gloo on localhost), each its own node with its own RAM directory.

    mp_child.py SHM_ROOT OBJ_DIR MODE   (MODE: save-sync | save-async | restore | fail-rank1 |
                                         shared-node | one-step)
Prints one JSON line with what it saw.
"""

import os
import sys

import numpy as np
import torch.distributed as dist

from tierfs import TieredStore
from tierfs.policies import FixedIntervalPolicy, LatestN
from tierfs.tiers import MemoryTier, ObjectTier

from _child import finish  # tests/children/ is the script's directory, first on sys.path


def state_for(rank: int, step: int) -> dict:
    rng = np.random.default_rng(1000 * rank + step)
    return {"w": rng.standard_normal(50_000 + 1000 * rank).astype(np.float32), "step": step, "rank": rank}


def main() -> None:
    shm, obj, mode = sys.argv[1:4]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    budget = 1000 if mode == "fail-rank1" and rank == 1 else None  # rank 1 cannot hold a step
    ram = MemoryTier(os.path.join(shm, f"node{os.environ['TIERFS_NODE_RANK']}"), keep=LatestN(2), budget=budget)
    store = TieredStore([ram,
                         ObjectTier(f"file://{obj}", save=FixedIntervalPolicy(2), keep=LatestN(2))])
    out = {"rank": rank}
    if mode == "fail-rank1":
        for blocking in (True, False):
            try:
                store.save(7, state_for(rank, 7), blocking=blocking)
                store.wait_until_finished()
                out[f"blocking={blocking}"] = "saved"
            except Exception as e:  # noqa: BLE001 - reported to the test
                out[f"blocking={blocking}"] = type(e).__name__
        out["steps"] = store.tiers[0].list_steps()
        store.close()
        finish(out)
    if mode == "one-step":  # step 10 of every rank, for the CLI to read
        store.save(10, {"w": np.full(3000, float(rank), np.float32), "other": np.arange(10)})
        store.close()
        finish(out)
    if mode == "shared-node":  # every rank's buffers are reused although only one rank owns the directory
        for step in range(8):
            store.save(step, state_for(rank, step))
            store.wait_until_finished()
            if step == 3:
                warm = ram.stats()["created"]
        dist.barrier()
        out["fresh_after_warmup"] = ram.stats()["created"] - warm
        out["ram_steps"] = sorted(os.listdir(ram.path))
    if mode.startswith("save"):
        for step in range(5):
            store.save(step, state_for(rank, step), blocking=(mode == "save-sync"))
        store.wait_until_finished()
        dist.barrier()  # rank 0 applies retention on the shared tier: list after every rank is done
        out["steps"] = {str(k): v for k, v in store.steps().items()}
    target = {"w": np.zeros(50_000 + 1000 * rank, np.float32), "step": -1, "rank": -1}
    info = store.restore_into(target)
    want = state_for(rank, info.step)
    out.update(step=info.step, tier=info.tier, exact=target["w"].tobytes() == want["w"].tobytes()
               and target["rank"] == rank and target["step"] == info.step)
    info = store.restore_into(target, tiers=["file"])
    out.update(obj_step=info.step, obj_exact=target["w"].tobytes() == state_for(rank, info.step)["w"].tobytes())
    store.close()
    finish(out)


if __name__ == "__main__":
    main()
