"""Run by test_manager.py: a loop that never asks reached_preemption, SIGTERMed mid-run. It saves every
step to RAM; the object tier takes only the preemption save. Prints each step it saved."""

import sys

import numpy as np

from tierfs import CheckpointManager
from tierfs.policies import AnySavePolicy, FixedIntervalPolicy, PreemptionCheckpointingPolicy
from tierfs.tiers import MemoryTier, ObjectTier

shm, obj = sys.argv[1], sys.argv[2]
tiers = [MemoryTier(shm), ObjectTier(f"file://{obj}", save=AnySavePolicy([FixedIntervalPolicy(10 ** 9),
                                                                           PreemptionCheckpointingPolicy()]))]
mgr = CheckpointManager(tiers, handle_sigterm=True, sigterm_grace=1.0, background_bandwidth=None)
step = 0
while True:  # never stops by itself
    step += 1
    rng = np.random.default_rng(step)
    mgr.save(step, {"w": rng.standard_normal(50_000).astype(np.float32), "step": step})
    print(f"step {step}", flush=True)
