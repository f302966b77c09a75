"""One rank of a 2-rank gloo job (each process its own node and RAM directory) that calls save out of step
with the other, then with states empty on some ranks or on all; the store must go on working. Then a step
rank 1's save policy takes and rank 0's does not (rank 0 decides: not saved, on every rank). What a rank
staged while the ranks agreed on such calls leaves nothing behind in its RAM directory.

    save_steps_child.py SHM

Prints one JSON line: each call's outcome (``["ok", value]`` or ``[exception type, message]``), whether
the last step restored bit-exact, and the step directories left in each RAM directory.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch.distributed as dist

from tierfs import TieredStore, TierfsError
from tierfs.policies import SpecificStepsPolicy
from tierfs.tiers import MemoryTier

from _child import finish  # tests/children/ is the script's directory, first on sys.path


def main() -> None:
    shm = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    calls: dict[str, Any] = {}

    def call(name: str, fn: Callable[[], Any]) -> None:
        try:
            calls[name] = ["ok", fn()]
        except TierfsError as e:
            calls[name] = [type(e).__name__, str(e)]

    state = {"w": np.arange(10.0) + rank}
    with TieredStore([MemoryTier(f"{shm}/rank{rank}")], timeout=60) as store:
        call("different-steps", lambda: store.save(3 + rank, state))
        call("empty-on-one-rank", lambda: store.save(5, state if rank == 0 else {}))
        call("empty-on-every-rank", lambda: store.save(6, {}))
        call("then", lambda: store.save(7, state))
        restored, info = store.restore()
        same = info.step == 7 and np.array_equal(restored["w"], state["w"])
        steps = sorted(store.steps())
        dirs = sorted(p.name for p in Path(f"{shm}/rank{rank}").glob("step_*"))
    declines = SpecificStepsPolicy(frozenset({1})) if rank == 0 else None  # rank 1's policy takes every step
    with TieredStore([MemoryTier(f"{shm}/declined{rank}", save=declines)], timeout=60) as store:
        call("rank-0-declines", lambda: store.save(2, state))
        call("rank-0-takes", lambda: store.save(1, state))
        declined = {"steps": sorted(store.steps()),
                    "dirs": sorted(p.name for p in Path(f"{shm}/declined{rank}").glob("step_*"))}
    finish({"rank": rank, "calls": calls, "restored": same, "steps": steps, "dirs": dirs, "declined": declined})


if __name__ == "__main__":
    main()
