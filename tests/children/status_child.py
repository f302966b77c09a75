"""A one-process job for ``tierfs status``: saves a torch.nn model with AdamW at steps 1-3 to a RAM tier and a
``file://`` object tier (each durable before the next), then starts step 4, whose upload stops at its first
file on the object tier: it prints ``READY`` and waits there until the test kills it. Nothing else is
printed on stdout.

    status_child.py RAM OBJDIR
"""

import sys
import threading

import torch

from tierfs import TieredStore
from tierfs.testing import hooks
from tierfs.tiers import MemoryTier, ObjectTier


def main() -> None:
    ram, obj = sys.argv[1:3]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8))
    opt = torch.optim.AdamW(model.parameters())
    never = threading.Event()

    def stop_at_step_4(path: str) -> None:
        if path.startswith(obj) and "step_000000000004" in path:
            print("READY", flush=True)
            never.wait()  # the upload of step 4 stays in flight until the process is killed

    store = TieredStore([MemoryTier(ram), ObjectTier(f"file://{obj}")])
    for step in range(1, 5):
        model(torch.randn(4, 64)).sum().backward()
        opt.step()
        if step == 4:
            hooks.add("rename", stop_at_step_4)
        store.save(step, {"model": model.state_dict(), "optim": opt.state_dict()}, blocking=False)
        if step < 4:
            store.wait_until_finished()
    never.wait()


if __name__ == "__main__":
    main()
