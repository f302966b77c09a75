"""Run by test_gpu.py (a process of its own: a failed page-lock is remembered, and warned of, once per process).

    gpu_pin_child.py RAM

Page-locking is refused through the test hook point ``pin`` (as a low RLIMIT_MEMLOCK would refuse it); two
steps of a CUDA state are saved and restored, to the device, to the host and in place. Prints one JSON
line: the hook's calls, the warnings that name RLIMIT_MEMLOCK, whether each restore was bit-exact, the bytes
page-locked and why page-locking is off.
"""

from __future__ import annotations

import json
import logging
import sys
from typing import Any

import torch

from tierfs import TieredStore
from tierfs.device import copies as _device
from tierfs.testing import hooks
from tierfs.tiers import MemoryTier

DEV = "cuda"


class Kept(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def state_for(step: int) -> dict[str, Any]:
    torch.manual_seed(step)
    return {"w": torch.randn(1 << 20, device=DEV), "h": torch.randn(333, device=DEV, dtype=torch.bfloat16),
            "t": torch.randn(64, 48, device=DEV).t(), "host": torch.arange(10) + step}


def same(got: dict[str, Any], want: dict[str, Any]) -> bool:
    def raw(t: Any) -> Any:
        return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)

    return set(got) == set(want) and all(
        got[k].dtype == want[k].dtype and got[k].shape == want[k].shape and torch.equal(raw(got[k]), raw(want[k]))
        for k in want)


def main() -> None:
    ram = sys.argv[1]
    kept = Kept()
    log = logging.getLogger("tierfs")
    log.addHandler(kept)
    if log.getEffectiveLevel() > logging.WARNING:
        log.setLevel(logging.WARNING)
    refused: list[int] = []

    def refuse(nbytes: int) -> None:
        refused.append(nbytes)
        raise RuntimeError("page-locking refused by the test")

    exact: dict[str, bool] = {}
    hooks.add("pin", refuse)
    with TieredStore([MemoryTier(ram)]) as store:
        for step in (1, 2):  # the second save maps a second set of buffers: not page-locked, no second warning
            store.save(step, state_for(step))
        got, _ = store.restore(1, device=DEV)
        exact["1 to the device"] = same(got, state_for(1))
        got, _ = store.restore(2, device=DEV)
        exact["2 to the device"] = same(got, state_for(2))
        got, _ = store.restore(2)
        exact["2 to the host"] = same(got, state_for(2))
        target = {k: torch.zeros(v.shape, dtype=v.dtype, device=v.device) for k, v in state_for(2).items()}
        store.restore_into(target, 2)
        exact["2 in place"] = same(target, state_for(2))
        pinned = _device.pinned_bytes()
    print(json.dumps({"refused": len(refused), "memlock_warnings": [m for m in kept.messages if "RLIMIT_MEMLOCK" in m],
                      "warnings": kept.messages, "exact": exact, "pinned_bytes": pinned,
                      "pin_off": getattr(sys.modules.get("tierfs.device.pinning", _device), "_pin_off", None)}), flush=True)


if __name__ == "__main__":
    main()
