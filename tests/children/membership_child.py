"""One rank of a 2-rank gloo job whose RAM directories are laid out as a user would: per rank, or shared.

    membership_child.py SHM MODE    (MODE: per-rank-dcp | shared | shared-contradicted)

per-rank-dcp: each rank its own directory (``SHM/rank<r>``) and no node numbers in the environment:
``dcp.save`` of a small model and its Adam state through ``TieredWriter``, then ``dcp.load`` through
``TieredReader`` into a fresh one. shared: one directory for both, no node numbers: save and restore.
shared-contradicted: one directory, but ``TIERFS_NODE_RANK`` (set by the test) puts the ranks on two nodes:
the store must refuse to open, on every rank. Prints one JSON line.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from tierfs import TieredStore, TierfsError
from tierfs.adapters.dcp import TieredReader, TieredWriter
from tierfs.testing import assert_states_equal
from tierfs.tiers import MemoryTier

from _child import finish  # tests/children/ is the script's directory, first on sys.path


def model_state(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    return {"model": model.state_dict(), "optim": opt.state_dict()}


def main() -> None:
    shm, mode = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    out: dict[str, Any] = {"rank": rank}
    path = os.path.join(shm, f"rank{rank}" if mode == "per-rank-dcp" else "shared")
    try:
        store = TieredStore([MemoryTier(path)], timeout=60)
    except TierfsError as e:
        out["error"] = [type(e).__name__, str(e)]
        finish(out)
    if mode == "per-rank-dcp":
        want = model_state(7)
        dcp.save(want, storage_writer=TieredWriter(store, 1))
        got = model_state(8)
        dcp.load(got, storage_reader=TieredReader(store))
        assert_states_equal(want, got)
        out["exact"] = True
    else:
        state = {"w": np.arange(1000, dtype=np.float32) + rank}
        store.save(1, state)
        target = {"w": np.zeros(1000, np.float32)}
        info = store.restore_into(target)
        out["exact"] = target["w"].tobytes() == state["w"].tobytes() and info.step == 1
        out["files"] = sorted(os.listdir(os.path.join(path, "step_000000000001")))
    store.close()
    finish(out)


if __name__ == "__main__":
    main()
