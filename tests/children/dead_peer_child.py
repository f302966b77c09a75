"""One rank of a job of several processes (gloo, each its own node and RAM directory under SHM) with a RAM
tier and a peer tier, in which rank VICTIM is SIGKILLed, or stops answering, mid-replication of step 2.

    dead_peer_child.py SHM VICTIM MODE TIMEOUT

MODE ``kill``: the victim SIGKILLs itself in the ``transfer`` test hook, as it is about to send its first
bytes of step 2 to its peer; ``hang``: it waits there forever (the test kills it). Either way it first
notes the time in ``SHM/struck_at``. Every other rank reports what its next call raised and when, stays in
the job until every other survivor has raised too (through the job's c10d store, rank 0's: the victim is
never rank 0), so that none of them leaving can be what ended another's wait, then closes the store and
exits through the interpreter's own teardown (no ``os._exit``): its exit status says whether a rank that
closed cleanly exits cleanly. Prints one JSON line.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from typing import Any

import numpy as np
import torch.distributed as dist

from tierfs import TieredStore
from tierfs.policies import LatestN
from tierfs.testing import hooks
from tierfs.tiers import MemoryTier, PeerTier
from tierfs.tiers.peer import Wire


def state_for(rank: int, step: int) -> dict[str, Any]:
    rng = np.random.default_rng(100 * rank + step)
    return {"w": rng.standard_normal(200_000 + rank).astype(np.float32), "step": step}


def main() -> None:
    shm, victim, mode, timeout = sys.argv[1], int(sys.argv[2]), sys.argv[3], float(sys.argv[4])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict[str, Any] = {"rank": rank}
    struck_at = os.path.join(shm, "struck_at")

    def strike(step: int, tier: str, nbytes: int) -> None:
        if step == 2 and tier == "peer":
            with open(struck_at + ".tmp", "w") as f:
                f.write(repr(time.time()))
            os.rename(struck_at + ".tmp", struck_at)
            if mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            threading.Event().wait()  # a rank that stops answering

    # several messages per shard file: the victim is struck before its first one
    store = TieredStore([MemoryTier(os.path.join(shm, f"node{rank}"), keep=LatestN(1)),
                         PeerTier(replicas=1, wire=Wire(chunk=100_000))], timeout=timeout)
    store.save(1, state_for(rank, 1))
    store.wait_until_finished()  # step 1 is replicated everywhere
    if rank == victim:
        hooks.add("transfer", strike)
    try:
        store.save(2, state_for(rank, 2))  # committed; the replication runs in the background
        store.wait_until_finished()  # the next call
        out["error"] = None
    except Exception as e:  # noqa: BLE001 - what this rank raised is the result
        cause = e.__cause__
        out["error"] = [type(e).__name__, str(e), type(cause).__name__, getattr(cause, "ranks", None),
                        getattr(cause, "stage", None)]
    now = time.time()
    with open(struck_at) as f:
        out["after"] = now - float(f.read())  # seconds from the strike to the error
    kv = dist.distributed_c10d._get_default_store()
    kv.set(f"test/raised/{rank}", "1")
    kv.wait([f"test/raised/{r}" for r in range(world) if r != victim])
    store.close()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
