"""One rank of a job of a few processes (gloo on localhost, each its own node and RAM directory under SHM)
in which rank VICTIM is SIGKILLed at a stage of a save or a restore of step 2, or stops calling the store;
every other rank reports what its calls raised, then closes the store and returns from ``main``: it exits
through the interpreter's own teardown (no ``os._exit``), so its exit status says whether a rank that saw
another fail exits cleanly.

    who_failed_child.py SHM OBJ VICTIM MODE STAGE TIER TIMEOUT

OBJ: ``none`` (a RAM tier alone), else the object tier's URL (its storage options as JSON in
``TIERFS_TEST_STORAGE_OPTIONS``). MODE ``kill``: the victim SIGKILLs itself at the ``stage`` test hook of
STAGE of step 2 on tier TIER (``-``: any tier); ``idle``: once step 1 is saved it never calls the store
again (it waits, alive and connected, until the others are done). STAGE ``read`` strikes during a restore
of step 2, every other stage during its save (whose background part, the object tier's copy, is waited for).

Each survivor's calls: ``first`` (the save or restore of step 2), then ``second`` (a save of step 3) and
``third`` (a restore), each ``[error class, message, ranks, cause class, cause's ranks, calls]``, ``calls``
being how many calls into torch.distributed (collectives, transfers, new groups) the call made; None where
it succeeded. Prints one JSON line.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
from typing import Any, Callable

import numpy as np
import torch.distributed as dist

from tierfs import TieredStore
from tierfs.policies import LatestN
from tierfs.testing import hooks
from tierfs.tiers import MemoryTier, ObjectTier

COUNTED = ("all_reduce", "broadcast", "isend", "irecv", "new_group", "barrier")
_calls = [0]


def _count_calls() -> None:
    """Count every call into torch.distributed that could wait on another rank."""
    for name in COUNTED:
        fn = getattr(dist, name)

        def counted(*args: Any, _fn: Any = fn, **kwargs: Any) -> Any:
            _calls[0] += 1
            return _fn(*args, **kwargs)
        setattr(dist, name, counted)


def state_for(rank: int, step: int) -> dict[str, Any]:
    rng = np.random.default_rng(100 * rank + step)
    return {"w": rng.standard_normal(5_000 + rank).astype(np.float32), "step": step}


def outcome(fn: Callable[[], Any]) -> list[Any] | None:
    before = _calls[0]
    try:
        fn()
        return None
    except Exception as e:  # noqa: BLE001 - what this rank raised is the result
        cause = e.__cause__
        return [type(e).__name__, str(e), getattr(e, "ranks", None), type(cause).__name__ if cause else None,
                getattr(cause, "ranks", None), _calls[0] - before]


def main() -> None:
    shm, obj, victim, mode, want, tier, timeout = sys.argv[1:8]
    dist.init_process_group("gloo")
    _count_calls()
    rank = dist.get_rank()
    kv = dist.distributed_c10d._get_default_store()
    tiers: list[Any] = [MemoryTier(os.path.join(shm, f"node{rank}"), keep=LatestN(2))]
    if obj != "none":
        opts = json.loads(os.environ.get("TIERFS_TEST_STORAGE_OPTIONS", "{}"))
        tiers.append(ObjectTier(obj, keep=LatestN(2), storage_options=opts))
    store = TieredStore(tiers, timeout=float(timeout))
    store.save(1, state_for(rank, 1))
    store.wait_until_finished()

    def strike(stage: str, step: int | None, tier: str | None) -> None:
        if stage == want and step == 2 and (want_tier is None or tier == want_tier):
            os.kill(os.getpid(), signal.SIGKILL)

    want_tier = None if tier == "-" else tier
    if rank == int(victim):
        if mode == "kill":
            hooks.add("stage", strike)
        else:  # alive and connected, never calling the store again, until the others are done
            kv.wait(["test/done"], datetime.timedelta(seconds=300))
            print(json.dumps({"rank": rank}), flush=True)
            os._exit(0)

    def save() -> None:
        store.save(2, state_for(rank, 2))
        store.wait_until_finished()

    if want == "read":
        save()
        first = outcome(lambda: store.restore(step=2))
    else:
        first = outcome(save)
    second = outcome(lambda: store.save(3, state_for(rank, 3)))
    third = outcome(store.restore)
    out = {"rank": rank, "first": first, "second": second, "third": third}
    if mode == "idle":
        kv.set("test/done", "1")
    print(json.dumps(out), flush=True)
    store.close()


if __name__ == "__main__":
    main()
