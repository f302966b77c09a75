"""One rank of a multi-process DCP job (gloo on localhost), each its own node with its own RAM directory
and one shared object tier.

    dcp_child.py SHM_ROOT OBJ_DIR MODE   (MODE: save | async-save | load)

save: dcp.save of the reference state as step 3 through TieredWriter, wait for the object tier copy,
then dcp.load it back. load: dcp.load of the newest step into a differently initialised state (any world
size). Prints one JSON line: rank, whether the loaded state is bit-exact, which tier served each saving
rank, and what was skipped.
"""

import os
import sys
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from tierfs import TieredStore
from tierfs.adapters.dcp import TieredReader, TieredWriter
from tierfs.testing import assert_states_equal
from tierfs.tiers import MemoryTier, ObjectTier

from _child import finish  # tests/children/ is the script's directory, first on sys.path

warnings.filterwarnings("ignore")


def make_state(seed: int, steps: int) -> dict:
    """A model and its Adam state after ``steps`` steps, the same on every rank for a given seed."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(steps):
        model(torch.randn(4, 16)).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    return {"model": model.state_dict(), "optim": opt.state_dict(), "extra": {"epoch": seed, "blob": b"\x00tier\xff"}}


def same(a, b) -> bool:
    """Whether two states are bit-exact equal (for the JSON line)."""
    try:
        assert_states_equal(a, b)
    except AssertionError as e:
        print(e, file=sys.stderr)
        return False
    return True


def main() -> None:
    shm, obj, mode = sys.argv[1:4]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    store = TieredStore([MemoryTier(os.path.join(shm, f"node{rank}")), ObjectTier(f"file://{obj}")])
    want = make_state(7, 3)
    out = {"rank": rank, "world": dist.get_world_size()}
    if mode == "save":
        dcp.save(want, storage_writer=TieredWriter(store, 3))
        store.wait_until_finished()
        dist.barrier()
    elif mode == "async-save":  # dcp.async_save on every rank; the state changes while it runs
        live = make_state(7, 3)
        fut = dcp.async_save(live, storage_writer=TieredWriter(store, 3))
        fut.result()
        for t in live["model"].values():
            t.add_(1.0)
        store.wait_until_finished()
        dist.barrier()
    got = make_state(1, 1)
    got["extra"] = {"epoch": -1, "blob": b""}
    reader = TieredReader(store)
    dcp.load(got, storage_reader=reader)
    out.update(exact=same(want, got), sources={str(k): v for k, v in reader.sources.items()},
               skipped=len(reader.skipped), step=reader.resolved_step)
    store.close()
    finish(out)


if __name__ == "__main__":
    main()
