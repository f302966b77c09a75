"""One rank of a job whose CheckpointManager restores over RAM and a peer tier (gloo on localhost, each
process its own node, RAM in SHM/node<N>), counting how often the restore's plan is gathered.

    restore_once_child.py SHM FORMAT MODE

FORMAT: store (a numpy state: the store's format, with a data loader's state) or dcp (a torch state: DCP).
MODE: save (steps 1..3) or restore (the newest step, in place). Prints one JSON line: the step restored,
whether it equals the saved state bit for bit, the plans gathered during the restore (the ``planning``
stage, see tierfs.testing.hooks), the calls into torch.distributed it made, each rank's source, and the
steps in this rank's RAM after it.
"""

import functools
import os
import sys
import threading
import warnings

import numpy as np
import torch
import torch.distributed as dist

from tierfs import CheckpointManager
from tierfs.policies import LatestN
from tierfs.testing import hooks
from tierfs.tiers import MemoryTier, PeerTier

from _child import finish  # tests/children/ is the script's directory, first on sys.path

warnings.filterwarnings("ignore")
_COUNTED = ("all_reduce", "all_gather", "all_gather_object", "broadcast", "broadcast_object_list", "barrier",
            "gather", "scatter", "send", "recv", "isend", "irecv", "batch_isend_irecv")
_counts = {"plans": 0, "calls": 0}


def _count() -> None:
    """Count the plans gathered (any thread) and the main thread's calls into torch.distributed."""
    hooks.add("stage", lambda stage, step, tier: _counts.__setitem__("plans", _counts["plans"] + 1)
              if stage == "planning" else None)
    main = threading.main_thread()
    for name in _COUNTED:
        fn = getattr(dist, name, None)
        if fn is None:
            continue

        def counted(*args, _fn=fn, **kwargs):
            if threading.current_thread() is main:
                _counts["calls"] += 1
            return _fn(*args, **kwargs)
        setattr(dist, name, functools.wraps(fn)(counted))


class Loader:
    """A data loader's position, saved with each step."""

    def __init__(self, position: int) -> None:
        self.position = position

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = state["position"]


def state_for(fmt: str, rank: int, step: int) -> dict:
    """Each rank's own values (the store's format), or the same on every rank (DCP: plain tensors are
    replicated)."""
    if fmt == "dcp":
        rng = np.random.default_rng([step])
        return {"w": torch.from_numpy(rng.standard_normal(30_000).astype(np.float32)),
                "b": torch.from_numpy(rng.standard_normal(77)), "step": step}
    rng = np.random.default_rng([rank, step])
    return {"w": rng.standard_normal(30_000 + rank).astype(np.float32), "b": rng.standard_normal(77), "step": step}


def main() -> None:
    shm, fmt, mode = sys.argv[1], sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ram = MemoryTier(os.path.join(shm, f"node{os.environ['TIERFS_NODE_RANK']}"), keep=LatestN(2))
    peer = PeerTier(replicas=1)
    out: dict = {"rank": rank}
    loader = Loader(0) if fmt == "store" else None
    with CheckpointManager([ram, peer], timeout=60) as mgr:
        if mode == "save":
            for step in range(1, 4):
                if loader is not None:
                    loader.position = 100 * step + rank
                mgr.save(step, state_for(fmt, rank, step), loader=loader)
            mgr.wait_until_finished()
        else:
            target = state_for(fmt, rank, 0)
            _count()
            step = mgr.restore(target, loader=loader)
            plans, calls = _counts["plans"], _counts["calls"]
            mgr.wait_until_finished()
            want = state_for(fmt, rank, step)
            exact = all(np.asarray(target[k]).tobytes() == np.asarray(want[k]).tobytes() for k in ("w", "b"))
            out.update(step=step, exact=exact and target["step"] == step, plans=plans, calls=calls,
                       loader=None if loader is None else loader.position,
                       sources=[[r["tier"], r["peer"]] for r in mgr.last_restore_info.ranks],
                       ram=ram.committed_steps())
    finish(out)


if __name__ == "__main__":
    main()
