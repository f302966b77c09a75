"""Run by test_zero_copy_memory.py: a process saving fresh states to a RAM tier, or one holding zero-copy views of
it, each answering one JSON line per command on stdin.

    zero_copy_memory_child.py RAM writer   answers its memory once started, then:
        save A B    save steps A..B, each a fresh state dropped once saved; its memory, and how many of the
                    states' arrays outlived the save (the store kept a reference to them)
        close       close the store; its memory
    zero_copy_memory_child.py RAM reader   answers once started, then:
        restore     restore the newest step zero-copy, holding its views (and those restored before)
        check       whether every view held still has its step's bytes, bit for bit

The writer runs with the garbage collector off: what a save leaves behind must go when the caller drops its
state, by reference counting alone, not when the collector next happens to run (tierfs pauses it while it
saves, and a training loop may allocate little between saves).
"""

from __future__ import annotations

import ctypes
import gc
import hashlib
import json
import os
import sys
import weakref
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from tierfs import TieredStore
from tierfs.policies import LatestN
from tierfs.tiers import MemoryTier

#: the bytes of one state: two 4 MiB arrays (a float32 tensor and a float64 numpy array)
STATE_BYTES = 8 << 20
_N = 1 << 20  # float32 elements of the tensor; the numpy array has half as many float64s


def state_for(step: int) -> dict[str, Any]:
    """A fresh state of ``step``: its arrays are allocated anew, their bytes differ from every other step's."""
    return {"model": {"w": torch.arange(_N, dtype=torch.float32) + step},
            "opt": {"m": np.arange(_N // 2, dtype=np.float64) * (step + 1)}, "step": step}


def digest(state: dict[str, Any]) -> list[str]:
    """The sha256 of each array's bytes."""
    return [hashlib.sha256(state["model"]["w"].numpy().tobytes()).hexdigest(),
            hashlib.sha256(np.ascontiguousarray(state["opt"]["m"]).tobytes()).hexdigest()]


def _malloc_trim() -> Callable[[int], int] | None:
    try:
        fn: Callable[[int], int] = ctypes.CDLL(None).malloc_trim  # glibc
    except (OSError, AttributeError):
        return None
    return fn


_trim = _malloc_trim()


def memory(ram: str) -> dict[str, int]:
    """This process's anonymous and shared (tmpfs) resident memory in bytes (``/proc/self/status``), and its
    mappings of files below ``ram`` (``/proc/self/maps``): all of them, and those of files since deleted.

    The C allocator first gives back the free memory it keeps (glibc's ``malloc_trim``): the figures are what
    the process holds, not what the allocator happened to keep of the states freed (a few states' worth)."""
    if _trim is not None:
        _trim(0)
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("RssAnon", "RssShmem"):
                out[key] = int(value.split()[0]) * 1024
    root = os.path.realpath(ram) + os.sep
    maps = deleted = 0
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].startswith(root):
                maps += 1
                deleted += parts[5].rstrip().endswith("(deleted)")
    return {"anon": out["RssAnon"], "shmem": out["RssShmem"], "maps": maps, "deleted": deleted}


def tier_bytes(ram: str) -> int:
    """The bytes of every file below ``ram`` (the steps kept and the pools of spare buffers)."""
    return sum(p.stat().st_size for p in Path(ram).rglob("*") if p.is_file())


def answer(obj: dict[str, Any]) -> None:
    print(json.dumps(obj), flush=True)


def writer(ram: str) -> None:
    gc.disable()
    store = TieredStore([MemoryTier(ram, keep=LatestN(2))])
    answer({"memory": memory(ram)})
    for line in sys.stdin:
        cmd, *args = line.split()
        if cmd == "save":
            alive = 0
            for step in range(int(args[0]), int(args[1]) + 1):
                state = state_for(step)
                arrays = [weakref.ref(state["model"]["w"]), weakref.ref(state["opt"]["m"])]
                store.save(step, state)
                del state
                alive += sum(a() is not None for a in arrays)
            store.wait_until_finished()
            answer({"memory": memory(ram), "alive": alive, "tier_bytes": tier_bytes(ram)})
        elif cmd == "close":
            store.close()
            answer({"memory": memory(ram)})


def reader(ram: str) -> None:
    answer({"ready": True})
    store = None
    held = []
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "restore":
            store = store or TieredStore([MemoryTier(ram)], cleanup=False)
            out, _ = store.restore(zero_copy=True)
            held.append(out)
            answer({"step": out["step"]})
        elif cmd == "check":
            answer({"same": [digest(out) == digest(state_for(out["step"])) for out in held]})
    held.clear()
    if store is not None:
        store.close()


if __name__ == "__main__":
    {"writer": writer, "reader": reader}[sys.argv[2]](sys.argv[1])
