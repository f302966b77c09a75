"""Run by tests/test_preemption.py: one process whose loop makes no save call between SIGTERM and the end of
the grace period (a tiny ``sigterm_grace``), then saves step 2:

    sigterm_late_save_child.py SHM OBJDIR

Step 1 goes to RAM and to the object tier, whose upload is held (a test hook) until the process gives up
older uploads: the watcher, which waits for the saves in flight before it ends the process, cannot end it
first. Step 2, the first save after the signal, goes to the object tier though the grace is over; the
process then gives up step 1's upload (it stays in RAM) and ends once step 2 is durable. Prints each step
``save`` returned for.
"""

import logging
import signal
import sys
import threading

import numpy as np

from tierfs import CheckpointManager
from tierfs.policies import AnySavePolicy, PreemptionCheckpointingPolicy, SpecificStepsPolicy
from tierfs.testing import hooks
from tierfs.tiers import MemoryTier, ObjectTier

shm, obj = sys.argv[1], sys.argv[2]
gate = threading.Event()


def transfer(step: int, tier: str, nbytes: int) -> None:
    if step == 1:
        gate.wait(300)  # step 1's upload waits until the process gives up older uploads


class GivenUp(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        if "not finished are given up" in record.getMessage():
            gate.set()


hooks.add("transfer", transfer)
log = logging.getLogger("tierfs")
log.addHandler(GivenUp())
shown = logging.StreamHandler()  # what logging's last resort prints when the logger has no handler
shown.setLevel(logging.WARNING)
log.addHandler(shown)
tiers = [MemoryTier(shm), ObjectTier(f"file://{obj}", save=AnySavePolicy([SpecificStepsPolicy([1]),
                                                                           PreemptionCheckpointingPolicy()]))]
mgr = CheckpointManager(tiers, handle_sigterm=True, sigterm_grace=1e-9, background_bandwidth=None, max_in_flight=2)
for step in (1, 2, 3):
    print(step, mgr.save(step, {"w": np.full(1000, step, dtype=np.float32)}), flush=True)
    if step == 1:
        signal.raise_signal(signal.SIGTERM)  # handled here, before the next save; the grace is over at once
print("not ended", flush=True)
