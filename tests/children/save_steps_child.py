"""One rank of a 2-rank gloo job (each process its own node and RAM directory) that calls save out of step
with the other, then with states empty on some ranks or on all; the store must go on working.

    save_steps_child.py SHM

Prints one JSON line: each call's outcome (``["ok", value]`` or ``[exception type, message]``) and whether
the last step restored bit-exact.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

import numpy as np
import torch.distributed as dist

from tierfs import TieredStore, TierfsError
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
    finish({"rank": rank, "calls": calls, "restored": same, "steps": steps})


if __name__ == "__main__":
    main()
