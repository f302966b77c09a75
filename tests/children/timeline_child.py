"""One rank of a job that goes back, or loses nodes (gloo on localhost, each process its own node, RAM in
SHM/node<N>, a peer tier with one replica, and an object tier when OBJ is not "-").

    timeline_child.py SHM OBJ MODE

MODE: run (save steps 1..8 of the first run), rollback (restore step 6, save steps 7..8 of a second run
whose values differ), resume (restore the newest step with CheckpointManager.restore, then with the store:
whose it is, what was passed over, and what each cost), lost (after nodes were replaced: what a restore and
CheckpointManager.restore say). Prints one JSON line with what it saw.

What a restore cost: the calls this thread made into torch.distributed (wrapped here, the real functions
called) and the shards read (the ``read`` stage, any thread); and what the manager's choice of the step
(the store's restore plan) costs alone.
"""

import functools
import os
import sys
import threading

import numpy as np
import torch.distributed as dist

from tierfs import CheckpointManager, TieredStore
from tierfs.errors import TierfsError
from tierfs.policies import FixedIntervalPolicy, LatestN
from tierfs.testing import hooks
from tierfs.tiers import MemoryTier, ObjectTier, PeerTier

from _child import finish  # tests/children/ is the script's directory, first on sys.path

_COUNTED = ("all_reduce", "all_gather", "all_gather_object", "broadcast", "broadcast_object_list", "barrier",
            "gather", "scatter", "reduce", "send", "recv", "isend", "irecv", "batch_isend_irecv")
_counts = {"calls": 0, "reads": 0, "on": False}


def _count_calls() -> None:
    """Wrap torch.distributed's collectives and messages: each call from the main thread counted while on."""
    main = threading.main_thread()
    for name in _COUNTED:
        fn = getattr(dist, name, None)
        if fn is None:
            continue

        def counted(*args, _fn=fn, **kwargs):
            if _counts["on"] and threading.current_thread() is main:
                _counts["calls"] += 1
            return _fn(*args, **kwargs)
        setattr(dist, name, functools.wraps(fn)(counted))
    hooks.add("stage", lambda stage, step, tier: _counts.__setitem__("reads", _counts["reads"] + 1)
              if _counts["on"] and stage == "read" else None)


def cost(fn):
    """``(fn(), calls into torch.distributed, shards read)``."""
    _counts.update(calls=0, reads=0, on=True)
    try:
        got = fn()
    finally:
        _counts["on"] = False
    return got, _counts["calls"], _counts["reads"]


def state_for(rank: int, step: int, run: int) -> dict:
    rng = np.random.default_rng([run, rank, step])
    return {"w": rng.standard_normal(20_000 + rank).astype(np.float32), "step": step, "run": run}


def main() -> None:
    shm, obj, mode = sys.argv[1], sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo")
    rank = dist.get_rank()

    def tiers():
        return [MemoryTier(os.path.join(shm, f"node{rank}"), keep=LatestN(2)), PeerTier(replicas=1)] + (
            [ObjectTier(f"file://{obj}", save=FixedIntervalPolicy(3), keep=LatestN(2))] if obj != "-" else [])
    out: dict = {"rank": rank}
    if mode == "lost":
        with TieredStore(tiers(), timeout=60) as store:
            try:
                store.restore()
            except TierfsError as e:
                out["store"] = [type(e).__name__, str(e), getattr(e, "steps", None)]
        with CheckpointManager(tiers(), timeout=60) as mgr:
            try:
                out["manager"] = ["returned", mgr.restore({"w": np.zeros(20_000 + rank, np.float32), "step": 0,
                                                          "run": 0})]
            except TierfsError as e:
                out["manager"] = [type(e).__name__, str(e)]
        finish(out)
    if mode == "resume":  # a restart through the manager: one restore, as the store's below
        _count_calls()
        target = {"w": np.zeros(20_000 + rank, np.float32), "step": 0, "run": 0}
        with CheckpointManager(tiers(), timeout=60) as mgr:
            step, calls, reads = cost(lambda: mgr.restore(target))
            want = state_for(rank, step, target["run"])
            out["manager"] = [step, target["run"], target["w"].tobytes() == want["w"].tobytes(), calls, reads,
                              sorted({s for _, s, _ in mgr.last_restore_info.skipped})]
    with TieredStore(tiers(), timeout=60) as store:
        if mode == "run":
            for step in range(1, 9):
                store.save(step, state_for(rank, step, 1), blocking=False)
        elif mode == "rollback":
            got, info = store.restore(step=6)
            out["restored"] = [info.step, got["run"]]
            for step in (7, 8):
                store.save(step, state_for(rank, step, 2))
        else:
            _, plan_calls, _ = cost(lambda: store.restore_plan([t.name for t in store.tiers]))
            (got, info), calls, reads = cost(store.restore)
            out["store_cost"] = [calls, reads, plan_calls]
            want = state_for(rank, info.step, got["run"])
            out.update(step=info.step, run=got["run"], exact=got["w"].tobytes() == want["w"].tobytes(),
                       skipped=[[s, why] for _, s, why in info.skipped])
        store.wait_until_finished()
        dist.barrier()
        out["steps"] = {str(k): v for k, v in store.steps().items()}
    finish(out)


if __name__ == "__main__":
    main()
