"""One rank of a 2-rank gloo job (each process its own node and RAM directory) in which one rank fails at a
given stage of tierfs's work, through the documented test hook ``stage``.

    fault_child.py SHM OBJ STAGE FAILING_RANK [TIER]

Save-side stages (staging, checksum, manifest, marker, copy, retention, replication) fail during the save
of step 2; restore-side stages (planning, read) during a restore; fetch, localize and reseed during the
restore of a job whose rank 1 lost its RAM (a replaced node), with a peer tier. Every call's outcome is
recorded (``["ok", value]`` or ``[exception type, message]``), then the store must still work: a later
step is saved and restored bit-exact. Modes ``kill`` and ``hang``: rank 1 is SIGKILLed, or stops (waits
forever), in the manifest stage of step 2; rank 0 reports what it raised. Prints one JSON line.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import sys
import threading
from typing import Any, Callable

import numpy as np
import torch.distributed as dist

from tierfs import TieredStore, TierfsError
from tierfs.policies import LatestN, PreserveAll
from tierfs.testing import assert_states_equal, hooks
from tierfs.tiers import MemoryTier, ObjectTier, PeerTier

from _child import finish  # tests/children/ is the script's directory, first on sys.path

PEER = {"replication", "fetch", "localize", "reseed"}
LOST_NODE = {"fetch", "localize", "reseed"}


def state_for(rank: int, step: int) -> dict[str, Any]:
    rng = np.random.default_rng(100 * rank + step)
    return {"w": rng.standard_normal(20_000 + rank).astype(np.float32), "step": step}


def main() -> None:
    shm, obj, stage, failing = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    only_tier = sys.argv[5] if len(sys.argv) > 5 else None
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    out: dict[str, Any] = {"rank": rank, "calls": {}, "warnings": []}
    handler = logging.Handler()
    handler.emit = lambda r: out["warnings"].append(r.getMessage()) if r.levelno >= logging.WARNING else None
    logging.getLogger("tierfs").addHandler(handler)
    armed = threading.Event()

    def hook(stage: str, step: int | None, tier: str | None) -> None:
        if armed.is_set() and rank == failing and stage == want and (only_tier is None or tier == only_tier):
            armed.clear()
            if mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if mode == "hang":
                threading.Event().wait()  # a rank that stops answering (the test kills it)
            raise TierfsError(f"injected failure at {stage}")

    mode = stage if stage in ("kill", "hang") else "fail"
    want = "manifest" if mode != "fail" else stage
    hooks.add("stage", hook)

    def open_store() -> TieredStore:
        tiers: list[Any] = [MemoryTier(os.path.join(shm, f"node{rank}"), keep=LatestN(1))]
        if stage in PEER:
            tiers.append(PeerTier())
        tiers.append(ObjectTier(f"file://{obj}", keep=PreserveAll()))
        return TieredStore(tiers, timeout=3 if mode == "hang" else 60)

    def call(name: str, fn: Callable[[], Any]) -> Any:
        try:
            value = fn()
            out["calls"][name] = ["ok", value if isinstance(value, (bool, int, str, type(None))) else None]
            return value
        except Exception as e:  # noqa: BLE001 - what each rank saw is the result
            out["calls"][name] = [type(e).__name__, str(e), getattr(e, "ranks", None)]
            return None

    store = open_store()
    store.save(1, state_for(rank, 1))
    store.wait_until_finished()
    if stage in LOST_NODE:  # the job restarts on a replaced node 1: its RAM (and the replicas it kept) is gone
        store.save(2, state_for(rank, 2))
        store.wait_until_finished()
        store.close()
        dist.barrier()
        if rank == 1:
            shutil.rmtree(os.path.join(shm, "node1"))
        store = open_store()
        armed.set()
        if stage == "localize":
            info = call("restore", lambda: store.localize().step)
        else:
            target = {"w": np.zeros(20_000 + rank, np.float32), "step": -1}
            call("restore", lambda: store.restore_into(target).step)
            out["exact"] = target["w"].tobytes() == state_for(rank, 2)["w"].tobytes()
            store.wait_until_finished()  # the re-seeding of the replaced node's replicas runs in the background
    elif stage in ("planning", "read"):
        store.save(2, state_for(rank, 2))
        store.wait_until_finished()
        armed.set()
        target = {"w": np.zeros(20_000 + rank, np.float32), "step": -1}
        info = call("restore", lambda: store.restore_into(target))
        if info is not None:
            out["info"] = [info.step, info.tier, [list(x) for x in info.skipped]]
    else:
        armed.set()
        call("save2", lambda: store.save(2, state_for(rank, 2)))
        if mode != "fail":  # the other rank is dead or stuck: no teardown with it, just the result
            print(json.dumps(out), flush=True)
            os._exit(0)
        if stage == "retention":  # the failure comes after step 2 is committed: the next save raises it
            call("save3", lambda: store.save(3, state_for(rank, 3)))
        else:
            call("wait2", store.wait_until_finished)
        out["tiers2"] = store.steps().get(2, [])
    armed.clear()
    # the store is still usable: a later step, saved and restored bit-exact on every rank
    store.save(9, state_for(rank, 9))
    store.wait_until_finished()
    target = {"w": np.zeros(20_000 + rank, np.float32), "step": -1}
    info = store.restore_into(target)
    assert_states_equal(target, state_for(rank, 9))
    out["after"] = [info.step, info.tier]
    store.close()
    finish(out)


if __name__ == "__main__":
    main()
