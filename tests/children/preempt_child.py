"""Run by test_manager.py: trains until SIGTERM, then saves the current step to the preemption tier."""

import sys

import numpy as np

from tierfs import CheckpointManager
from tierfs.policies import AnySavePolicy, FixedIntervalPolicy, PreemptionCheckpointingPolicy
from tierfs.tiers import MemoryTier, ObjectTier

shm, obj = sys.argv[1], sys.argv[2]
tiers = [MemoryTier(shm), ObjectTier(f"file://{obj}", save=AnySavePolicy([FixedIntervalPolicy(1000),
                                                                           PreemptionCheckpointingPolicy()]))]
with CheckpointManager(tiers, handle_sigterm=True) as mgr:
    for step in range(1, 10_000):
        state = {"x": np.full(4, step)}
        if mgr.reached_preemption(step):
            mgr.save(step, state)
            mgr.wait_until_finished()
            print(f"preempted at {step}", flush=True)
            break
        mgr.save(step, state)
        print(f"step {step}", flush=True)
