"""One rank of a job of several processes (gloo, each its own node and RAM directory under SHM) with a RAM
tier and a peer tier, in which rank VICTIM is SIGKILLed in the middle of its replica of step 3.

    peer_kill_child.py SHM VICTIM WHERE TIMEOUT

The replica moves in several messages of 4 MiB (``Wire(chunk=...)``). Step 2 is replicated whole first, while
the victim counts its messages (the ``transfer`` test hook runs before each); in step 3 it SIGKILLs itself
in that hook: ``WHERE`` ``first`` once its first message is out, ``middle`` halfway, ``last`` before its
last one. It first notes the time in ``SHM/struck_at``. Every other rank reports what its next call raised
and when, stays in the job until every other survivor has raised too (through the job's c10d store, rank
0's: the victim is never rank 0), so that none of them leaving can be what ended another's wait, then
closes the store and exits. Prints one JSON line.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any

import numpy as np
import torch.distributed as dist

from tierfs import TieredStore
from tierfs.policies import LatestN
from tierfs.testing import hooks
from tierfs.tiers import MemoryTier, PeerTier
from tierfs.tiers.peer import Wire

#: bytes per message: more than a loopback socket holds, so that a message is under way when the victim dies
CHUNK = 4 << 20
#: float32 values per array: a replica of 4 messages
SIZE = 900_000


def state_for(rank: int, step: int) -> dict[str, Any]:
    """About 14 MB per rank, in a few arrays."""
    rng = np.random.default_rng(100 * rank + step)
    return {f"w{i}": rng.standard_normal(SIZE + 1000 * i + rank).astype(np.float32) for i in range(4)} | \
        {"step": step}


def main() -> None:
    shm, victim, where, timeout = sys.argv[1], int(sys.argv[2]), sys.argv[3], float(sys.argv[4])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict[str, Any] = {"rank": rank}
    struck_at = os.path.join(shm, "struck_at")
    sent = {2: 0, 3: 0}  # the victim's messages of each step's replica

    def strike(step: int, tier: str, nbytes: int) -> None:
        if tier != "peer" or step not in sent:
            return
        sent[step] += 1  # this message is the sent[step]-th
        n = sent[2]
        at = {"first": 2, "middle": n // 2 + 1, "last": n}[where]
        if step == 3 and sent[3] == at:
            with open(struck_at + ".tmp", "w") as f:
                f.write(repr(time.time()))
            os.rename(struck_at + ".tmp", struck_at)
            os.kill(os.getpid(), signal.SIGKILL)

    store = TieredStore([MemoryTier(os.path.join(shm, f"node{rank}"), keep=LatestN(1)),
                         PeerTier(replicas=1, wire=Wire(chunk=CHUNK))], timeout=timeout)
    if rank == victim:
        hooks.add("transfer", strike)
    store.save(1, state_for(rank, 1))
    store.save(2, state_for(rank, 2))
    store.wait_until_finished()  # step 2 is replicated everywhere (the victim counted its messages)
    out["messages"] = sent[2]
    try:
        store.save(3, state_for(rank, 3))  # committed; the replication runs in the background
        store.wait_until_finished()  # the next call
        out["error"] = None
    except Exception as e:  # noqa: BLE001 - what this rank raised is the result
        cause = e.__cause__
        out["error"] = [type(e).__name__, str(e), type(cause).__name__, getattr(cause, "ranks", None),
                        getattr(cause, "stage", None)]
    now = time.time()
    with open(struck_at) as f:
        out["after"] = now - float(f.read())  # seconds from the kill to the error
    kv = dist.distributed_c10d._get_default_store()
    kv.set(f"test/raised/{rank}", "1")
    kv.wait([f"test/raised/{r}" for r in range(world) if r != victim])
    store.close()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
