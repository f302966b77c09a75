"""One rank of a data-parallel job (gloo on localhost, each process its own node, RAM in SHM/node<N>).

    dp_child.py SHM OBJ MODE LAYOUT
MODE: save (steps 1 and 2, then step 3 with rank 1's copy of a shared tensor changed), restore
(restore_into the newest step; the object tier may be gone). LAYOUT: dp (every rank holds the same model and Adam state
and a 1.2 MB embedding, plus a small and a 1.1 MB tensor of its own), hsdp (two replica groups of two ranks, each rank one half of the
model's flattened parameters, replicated across the groups). Prints one JSON line with what it saw.
"""

import os
import sys

import torch
import torch.distributed as dist

from tierfs import TieredStore
from tierfs.policies import LatestN
from tierfs.tiers import MemoryTier, ObjectTier, PeerTier

from _child import finish  # tests/children/ is the script's directory, first on sys.path


class CountingObjectTier(ObjectTier):
    """The object tier, counting the bytes of the shard files it reads."""

    read_bytes = 0

    def read_file(self, step, name):
        data = super().read_file(step, name)
        if name.endswith(".bin"):
            CountingObjectTier.read_bytes += memoryview(data).nbytes
        return data


def model_state(step: int, seed: int) -> dict:
    """A small MLP and its Adam state after ``step`` steps, the same on every rank with the same ``seed``."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.LayerNorm(128), torch.nn.ReLU(),
                                torch.nn.Linear(128, 64), torch.nn.LayerNorm(64), torch.nn.Linear(64, 8))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(step):
        model(torch.randn(16, 64)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return {"model": model.state_dict(), "optim": opt.state_dict()}


def state_for(rank: int, step: int, layout: str) -> tuple[dict, object]:
    """This rank's state and its ``replicated=`` declaration."""
    if layout == "dp":
        state = model_state(step, 0)
        # and an embedding and a rank's own buffer over 1 MiB: a restore receives them straight in place
        state["model"]["embed"] = torch.randn(300_000, generator=torch.Generator().manual_seed(step))
        state["mine"] = {"rng": torch.full((257,), float(rank * 100 + step)),
                         "big": torch.full((270_000,), float(rank * 100 + step))}
        return state, ["model", "optim"]
    # hsdp: ranks 0, 2 hold shard 0 and ranks 1, 3 shard 1 (group = the ranks holding the same shard)
    full = model_state(step, 0)
    shard = rank % 2
    flat = {k: v.reshape(-1).chunk(2)[shard].clone() for k, v in full["model"].items()}
    state = {"shard": flat, "mine": {"rng": torch.full((33,), float(rank + step))},
             "everyone": {"step": torch.tensor(float(step))}}
    return state, {"shard": [shard, shard + 2], "everyone": [0, 1, 2, 3]}


def zeros_like(state: dict) -> dict:
    return {k: zeros_like(v) if isinstance(v, dict) else torch.zeros_like(v) if isinstance(v, torch.Tensor) else v
            for k, v in state.items()}


def differences(a: dict, b: dict, prefix: str = "") -> list[str]:
    """The tensors of ``a`` that ``b`` does not hold bit for bit (other values are not compared)."""
    out = []
    for k, v in a.items():
        w = b[k]
        if isinstance(v, dict):
            out += differences(v, w, f"{prefix}{k}/")
        elif isinstance(v, torch.Tensor):
            if v.dtype != w.dtype or v.shape != w.shape or not torch.equal(v.reshape(-1).view(torch.uint8),
                                                                           w.reshape(-1).view(torch.uint8)):
                out.append(f"{prefix}{k}")
    return out


def tree_bytes(path: str, step: str | None = None) -> int:
    """Bytes of the shard files under ``path`` (in folders named ``step`` alone, when given: a step's on an
    object tier, each rank's under its bucket)."""
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs
               if f.endswith(".bin") and (step is None or os.path.basename(d) == step))


def main() -> None:
    shm, obj, mode, layout = sys.argv[1:5]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ram_dir = os.path.join(shm, f"node{os.environ['TIERFS_NODE_RANK']}")
    tiers = [MemoryTier(ram_dir, keep=LatestN(1)), PeerTier(replicas=1)]
    if os.path.isdir(obj) or mode != "restore":  # a restore may run without its object tier
        tiers.append(CountingObjectTier(f"file://{obj}", keep=LatestN(1)))
    store = TieredStore(tiers)
    out = {"rank": rank}
    if mode == "save":
        for step in (1, 2):
            state, declared = state_for(rank, step, layout)
            store.save(step, state, replicated=declared)
            store.wait_until_finished()
        out["ram"] = tree_bytes(os.path.join(ram_dir, "step_000000000002"))
        out["replicas"] = tree_bytes(os.path.join(ram_dir, "peers"))
        out["objects"] = tree_bytes(obj, "step_000000000002")
        out["state"] = sum(v.numel() * v.element_size() for v in tensors(state))
        out["unique"] = sum(v.numel() * v.element_size() for v in tensors(state["mine"]))
        # step 3: rank 1's copy of a shared tensor differs from the others'
        state, declared = state_for(rank, 3, layout)
        if rank == 1:
            state["model" if layout == "dp" else "shard"]["0.weight"][0] += 1
        try:
            store.save(3, state, replicated=declared)
            out["diverged"] = None
        except Exception as e:  # noqa: BLE001 - reported to the test
            out["diverged"] = f"{type(e).__name__}: {e}"
        out["steps"] = store.steps()
    else:
        want, _ = state_for(rank, 2, layout)
        target = zeros_like(want)
        info = store.restore_into(target)
        out.update(step=info.step, tier=info.tier, ranks=info.ranks, differ=differences(want, target),
                   object_read=CountingObjectTier.read_bytes)
    store.close()
    finish(out)


def tensors(d: dict):
    for v in d.values():
        if isinstance(v, dict):
            yield from tensors(v)
        elif isinstance(v, torch.Tensor):
            yield v


if __name__ == "__main__":
    main()
