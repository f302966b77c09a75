"""One rank of a gloo job (each rank its own node and RAM directory) for tests/test_preemption.py:

    sigterm_ranks_child.py train SHM URL LOGDIR GRACE [stall] [dcp]
    sigterm_ranks_child.py restore SHM URL STEP

``train``: a loop that never calls ``reached_preemption`` saves every step (RAM every 5 steps; the object
tier at URL every 50th step or on preemption; ``background_bandwidth=4e6``; ``sigterm_grace=GRACE``) up to
a far-off end, writing ``STEP SAVED`` to LOGDIR/rank<r>.log after each save. At step 21 rank 1 prints
``reached 21`` and reads a line from stdin (the test sends SIGTERM, then the line), so the first save after
the signal is step 22. With ``stall`` the loop makes no save call after step 23: it waits for ever. With
``held`` the object tier takes every 20th step too, and rank 0's upload of step 20 is held at its first chunk
until the process gives up older uploads (so step 22's upload is queued behind it).
``restore``: restores STEP (the RAM tier empty, so from the object tier) and compares it with what was
saved, bit for bit; prints one JSON line. With ``dcp`` the state is a torch tensor (the same on every rank, as
DCP takes a plain tensor to be) and a step, saved through DCP (the test restores it). Storage options as JSON in
``TIERFS_TEST_STORAGE_OPTIONS``.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading

import numpy as np
import torch
import torch.distributed as dist

from tierfs import CheckpointManager
from tierfs.testing import hooks
from tierfs.policies import AnySavePolicy, FixedIntervalPolicy, PreemptionCheckpointingPolicy
from tierfs.tiers import MemoryTier, ObjectTier

from _child import finish  # tests/children/ is the script's directory, first on sys.path

END = 10 ** 9  # the loop's natural end: never reached


def state_for(rank: int, step: int, dcp: bool = False) -> dict:
    if dcp:  # a plain tensor is the same on every rank (replicated), for DCP
        w = np.random.default_rng(step).standard_normal(20_000).astype(np.float32)
        return {"w": torch.from_numpy(w), "step": step}
    rng = np.random.default_rng(1000 * rank + step)
    return {"w": rng.standard_normal(20_000 + rank).astype(np.float32), "step": step}


def manager(ram: str, url: str, grace: float = 30.0, every: int = 50) -> CheckpointManager:
    opts = json.loads(os.environ["TIERFS_TEST_STORAGE_OPTIONS"])
    tiers = [MemoryTier(ram, save=FixedIntervalPolicy(5)),
             ObjectTier(url, opts, save=AnySavePolicy([FixedIntervalPolicy(every), PreemptionCheckpointingPolicy()]))]
    return CheckpointManager(tiers, handle_sigterm=True, sigterm_grace=grace, background_bandwidth=4e6, timeout=120)


def hold_step_20() -> None:
    """Hold this rank's upload of step 20 at its first chunk until the process gives up older uploads (once
    the grace is over: at the next save, or from the watcher while that save waits for room)."""
    ending = threading.Event()

    class Ending(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "not finished are given up" in record.getMessage():
                ending.set()

    log = logging.getLogger("tierfs")
    log.addHandler(Ending())
    shown = logging.StreamHandler()  # what logging's last resort prints when the logger has no handler
    shown.setLevel(logging.WARNING)
    log.addHandler(shown)
    hooks.add("transfer", lambda step, tier, nbytes: ending.wait(300) if step == 20 and tier == "s3" else None)


def train(rank: int, shm: str, url: str, logdir: str, grace: float, stall: bool, dcp: bool, held: bool) -> None:
    if held and rank == 0:
        hold_step_20()
    mgr = manager(os.path.join(shm, f"node{rank}"), url, grace, every=20 if held else 50)
    with open(os.path.join(logdir, f"rank{rank}.log"), "w") as log:
        for step in range(1, END):
            saved = mgr.save(step, state_for(rank, step, dcp))
            print(step, saved, file=log, flush=True)
            if step == 21 and rank == 1:
                print("reached 21", flush=True)
                sys.stdin.readline()  # SIGTERM came before this line did
            if stall and step == 23:
                threading.Event().wait()  # no save call any more (a long evaluation, a hung data loader)
    finish({"rank": rank, "ended": "naturally"})


def restore(rank: int, shm: str, url: str, step: int) -> None:
    with manager(os.path.join(shm, f"restore{rank}"), url) as mgr:
        got = mgr.restore(step=step)
        info = mgr.last_restore_info
    w = state_for(rank, step)["w"]
    same = got["step"] == step and got["w"].dtype == w.dtype and got["w"].tobytes() == w.tobytes()
    assert info is not None
    finish({"rank": rank, "same": bool(same), "tier": info.tier})


def main() -> None:
    mode, shm, url = sys.argv[1:4]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if mode == "train":
        train(rank, shm, url, sys.argv[4], float(sys.argv[5]), "stall" in sys.argv[6:], "dcp" in sys.argv[6:],
              "held" in sys.argv[6:])
    else:
        restore(rank, shm, url, int(sys.argv[4]))


if __name__ == "__main__":
    main()
