"""One rank of a 2-rank gloo job saving through ``CheckpointManager``'s default DCP path, where rank 1
alone changes its structure (tests/test_structure_cache.py).

    structure_child.py SHM

Each rank has its own RAM directory (``SHM/rank<r>``). Both ranks hold the same model and AdamW state (as
data parallel training does; DCP saves such tensors once) and a tensor of their own (``mine.r<rank>``).
Steps 1-4 have one structure (the manager replays its DCP plan from step 2 on); at step 5 rank 1 alone
adds ``mine.extra1`` (every rank must save through ``dcp.save`` again), step 6 keeps it (replayed again),
step 7 drops it (``dcp.save`` again). Every step is then restored in place into a state of its structure
with other values and compared bit for bit with what was saved.

Prints one JSON line: rank, the steps restored exactly, ``errors`` (step -> why) and, from rank 0's
manifests, the tensors DCP's stored metadata lists for each step.
"""

import copy
import os
import sys
import warnings

import torch
import torch.distributed as dist

from tierfs import CheckpointManager
from tierfs.policies import PreserveAll
from tierfs.testing import assert_states_equal
from tierfs.tiers import MemoryTier

from _child import finish  # tests/children/ is the script's directory, first on sys.path

warnings.filterwarnings("ignore")


def make(seed: int, rank: int, extra: bool) -> dict:
    """The state at a step: the model and AdamW state (the same on every rank), and this rank's tensors."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(seed + 1)
    model(torch.randn(3, 8, generator=g)).pow(2).sum().backward()
    opt.step()
    g = torch.Generator().manual_seed(10 * seed + rank)
    mine = {f"r{rank}": torch.randn(5, 3, generator=g)}
    if extra:
        mine["extra1"] = torch.randint(0, 1000, (7,), generator=g, dtype=torch.int64)
    return {"model": model.state_dict(), "optim": opt.state_dict(), "mine": mine, "loader": {"pos": seed * 10 + rank}}


def main() -> None:
    shm = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    out = {"rank": rank, "errors": {}, "restored": [], "fqns": {}}
    extra = {s: rank == 1 and s in (5, 6) for s in range(1, 8)}
    saved = {}
    with CheckpointManager([MemoryTier(os.path.join(shm, f"rank{rank}"), keep=PreserveAll())]) as mgr:
        for step in range(1, 8):
            state = make(step, rank, extra[step])
            saved[step] = copy.deepcopy(state)
            assert mgr.save(step, state)
            with torch.no_grad():  # training goes on at once; the checkpoint must not see it
                for t in [*state["model"].values(), *state["mine"].values()]:
                    t.add_(1)
        mgr.wait_until_finished()
        dist.barrier()
        for step in range(1, 8):
            target = make(1000 + step, rank, extra[step])
            try:
                assert mgr.restore(target, step=step) == step
                assert_states_equal(target, saved[step])
                out["restored"].append(step)
            except Exception as e:  # noqa: BLE001 - reported to the test
                out["errors"][str(step)] = f"{type(e).__name__}: {e}"
            if rank == 0:
                md = mgr.store.read_manifest(step, 0)[0].metadata["dcp"]["state_dict_metadata"]
                out["fqns"][str(step)] = sorted(md)
        base = make(0, rank, False)
        out["base_fqns"] = sorted(
            [f"model.{k}" for k in base["model"]] + [f"mine.r{rank}"]
            + [f"optim.state.{i}.{k}" for i, s in base["optim"]["state"].items() for k in s])
    finish(out)


if __name__ == "__main__":
    main()
