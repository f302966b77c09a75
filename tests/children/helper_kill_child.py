"""One rank of a two-rank job (gloo, each its own node and RAM directory under SHM) saving a model's state
to RAM and a shared ``file://`` object tier under OBJ with uploads from helper processes; rank 0's helper is
SIGKILLed as it asks to move its first bytes of step 2.

    helper_kill_child.py SHM OBJ

Each rank reports what its next call raised, whether step 2 restores from RAM bit-exact, which steps the
object tier has after step 3 is uploaded by a new helper, and after the store is opened again (a restart:
it copies on what the tier lacks), and whether every step then restores from the object tier alone
bit-exact. Prints one JSON line.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

import torch
import torch.distributed as dist

from tierfs import TieredStore
from tierfs.testing import hooks
from tierfs.tiers import MemoryTier, ObjectTier

from _child import finish  # tests/children/ is the script's directory, first on sys.path


def state_for(rank: int, step: int) -> dict[str, Any]:
    """A small model and AdamW's state after a step, different on every rank and step."""
    torch.manual_seed(100 * rank + step)
    model = torch.nn.Sequential(torch.nn.Linear(48, 96), torch.nn.GELU(), torch.nn.LayerNorm(96),
                                torch.nn.Linear(96, 10))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(3, 48)).sum().backward()
    opt.step()
    return {"model": model.state_dict(), "optim": opt.state_dict()["state"], "step": step}


def same(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        a, b = {str(k): v for k, v in a.items()}, {str(k): v for k, v in b.items()}
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and bytes(a.numpy().data) == bytes(b.numpy().data)
    return bool(a == b)


def main() -> None:
    shm, obj = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    states = {s: state_for(rank, s) for s in (1, 2, 3)}
    ram = os.path.join(shm, f"ram{rank}")

    def tiers() -> list:
        return [MemoryTier(ram), ObjectTier(f"file://{obj}", name="objects")]

    out: dict[str, Any] = {"rank": rank}
    store = TieredStore(tiers(), helper=True)
    store.save(1, states[1])
    store.wait_until_finished()
    helper = store._ctx.work.helper
    killed: list[int] = []

    def kill(step: int, tier: str, nbytes: int) -> None:
        if rank == 0 and step == 2 and not killed:
            killed.append(helper.pid)
            os.kill(helper.pid, signal.SIGKILL)

    with hooks.on("transfer", kill):
        store.save(2, states[2])
        try:
            store.wait_until_finished()
            out["raised"] = None
        except Exception as e:  # noqa: BLE001 - reported
            out["raised"] = [type(e).__name__, str(e)]
    out["killed"] = killed
    got, info = store.restore(2)
    out["ram_restore"] = [info.tier, same(got, states[2])]
    store.save(3, states[3])
    store.wait_until_finished()
    out["new_helper"] = helper.pid not in (None, *killed)
    out["object_steps"] = sorted(s for s, where in store.steps().items() if "objects" in where)
    store.close()
    with TieredStore(tiers(), helper=True) as again:  # a restart: the object tier catches up
        again.wait_until_finished()
    with TieredStore([ObjectTier(f"file://{obj}", name="objects")]) as durable:
        out["object_steps_after_restart"] = sorted(durable.steps())
        exact = []
        for s in (1, 2, 3):
            got, info = durable.restore(s)
            exact.append(info.tier == "objects" and same(got, states[s]))
        out["object_exact"] = exact
    finish(out)


if __name__ == "__main__":
    main()
