"""One rank of a job with an erasure-coded tier (gloo on localhost, each process its own node, RAM in
SHM/node<N>).

    erasure_child.py SHM OBJ MODE DATA:PARITY [STEPS]

MODE: save (steps 1..STEPS, non-blocking, then wait), restore (restore_into a zeroed target). OBJ: a
directory for a file:// object tier, or - for none. Prints one JSON line with what it saw.
"""

import os
import sys

import numpy as np
import torch.distributed as dist

from tierfs import TieredStore
from tierfs.errors import TierfsError
from tierfs.policies import LatestN
from tierfs.tiers import ErasureCodedTier, MemoryTier, ObjectTier

from _child import finish  # tests/children/ is the script's directory, first on sys.path


def state_for(rank: int, step: int) -> dict:
    """Shards of different sizes (the group pads to the longest), several files and an empty array, and one
    array large enough that a restore lands it in the target's own array; rank 0's also 120 small arrays,
    so its manifest (in the head every member sends the others) is longer than one first message and takes
    the second round."""
    rng = np.random.default_rng(1000 * rank + step)
    many = {f"small{k:02d}": rng.integers(0, 255, 3 + k, dtype=np.uint8) for k in range(120 if rank == 0 else 0)}
    return {"b": rng.integers(0, 255, 5000 + 37 * rank, dtype=np.uint8),
            "w": rng.standard_normal(150_000 + 1000 * rank).astype(np.float32),
            "h": rng.standard_normal((300, 7)).astype(np.float16), "empty": np.zeros(0), "step": step,
            "large": rng.standard_normal(300_000 + 8 * rank).astype(np.float32), **many}


def main() -> None:
    shm, obj, mode = sys.argv[1], sys.argv[2], sys.argv[3]
    data, _, parity = sys.argv[4].partition(":")
    steps = int(sys.argv[5]) if len(sys.argv) > 5 else 2
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ram = MemoryTier(os.path.join(shm, f"node{os.environ['TIERFS_NODE_RANK']}"), keep=LatestN(2))
    node_rank = int(os.environ["TIERFS_NODE_RANK"]) if mode == "half-node-rank" and rank == 0 else None
    ec = ErasureCodedTier(data=int(data), parity=int(parity), block=64 << 10, node_rank=node_rank)
    tiers = [ram, ec] + ([ObjectTier(f"file://{obj}")] if obj != "-" else [])
    if mode == "half-node-rank":  # given on rank 0 alone: every rank hears of it, none hangs
        try:
            TieredStore(tiers)
        except TierfsError as e:
            finish({"rank": rank, "error": f"{type(e).__name__}: {e}"})
            return
    store = TieredStore(tiers, file_size=256 << 10, block_size=32 << 10)
    out = {"rank": rank, "group": ec.members()}
    if mode == "save":
        for step in range(1, steps + 1):
            store.save(step, state_for(rank, step), blocking=False)
        store.wait_until_finished()
        dist.barrier()
        out["steps"] = {str(k): v for k, v in store.steps().items()}
        out["held"] = {str(k): v for k, v in ec.holdings().items()}
        out["ram_bytes"] = sum(f.stat().st_size for f in ram.path.rglob("*") if f.is_file())
    else:
        want = state_for(rank, steps)
        target = {k: np.zeros_like(v) if isinstance(v, np.ndarray) else -1 for k, v in want.items()}
        try:
            info = store.restore_into(target)
            want = state_for(rank, info.step)
            out.update(step=info.step, tier=info.tier, skipped=[list(x) for x in info.skipped],
                       exact=all(target[k].tobytes() == v.tobytes() for k, v in want.items()
                                 if isinstance(v, np.ndarray))
                       and target["step"] == info.step)
            store.wait_until_finished()  # the replaced node's parity pieces are computed again meanwhile
            out["ranks"] = info.ranks
            out["held"] = {str(k): v for k, v in ec.holdings().items()}
        except TierfsError as e:
            out["error"] = f"{type(e).__name__}: {e}"
    store.close()
    finish(out)


if __name__ == "__main__":
    main()
