"""Run by test_ram_lock.py: another process on a RAM directory, as a job of its own (numpy only, to start fast).

    ram_lock_child.py RAM hold    open a store, save step 1, print {"pid"}, hold it until stdin closes
    ram_lock_child.py RAM read    a reader (cleanup=False): restore the newest step, print its step and values
    ram_lock_child.py RAM write   open a store and save the step after the newest; print the error, if any
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import numpy as np

from tierfs import TieredStore
from tierfs.tiers import MemoryTier


def state_for(step: int) -> dict[str, Any]:
    return {"w": np.random.default_rng(step).standard_normal(20_000), "step": step}


def write(ram: str) -> dict[str, Any]:
    """Open a store and save one step; the error (its type and message) if that failed."""
    store = None
    try:
        store = TieredStore([MemoryTier(ram)])
        step = max(store.steps(), default=0) + 1
        store.save(step, state_for(step))
        return {"saved": step}
    except Exception as e:  # noqa: BLE001 - reported to the test
        return {"error": type(e).__name__, "message": str(e)}
    finally:
        if store is not None:
            store.close()


def main() -> None:
    ram, mode = sys.argv[1], sys.argv[2]
    if mode == "hold":
        with TieredStore([MemoryTier(ram)]) as store:
            store.save(1, state_for(1))
            print(json.dumps({"pid": os.getpid()}), flush=True)
            sys.stdin.read()
    elif mode == "read":
        with TieredStore([MemoryTier(ram)], cleanup=False) as store:
            out, _ = store.restore()
            same = bool(np.array_equal(out["w"], state_for(out["step"])["w"]))
            print(json.dumps({"step": out["step"], "same": same}), flush=True)
    else:
        print(json.dumps(write(ram)), flush=True)


if __name__ == "__main__":
    main()
