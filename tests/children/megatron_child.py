"""One rank of a 2-process gloo job training a small Megatron-style model state through
``megatron.core.dist_checkpointing`` with tierfs's strategies (tierfs.adapters.megatron).

    megatron_child.py SHM OBJ ROOT LAYOUT TOTAL KILL_AT

The state is built as Megatron's own tests build one: ``ShardedTensor.from_rank_offsets`` shards with
``replica_id`` for the replicas, layer-stacked tensors (``prepend_axis_num=1``), optimizer moments sharded like
their parameters, a ``ShardedObject`` per rank and plain values (the iteration, the optimizer's param groups)
that Megatron keeps in ``common.pt``. LAYOUT ``tp``: tensor parallel over the 2 ranks (rows of the
embedding, columns of the output layer and the stacked layers), the norm replicated; ``dp``: data parallel,
each rank holding every tensor whole, rank 0 the main replica.

Every rank keeps the global tensors and trains them the same way: step ``s`` adds noise seeded by ``s``
(elementwise, so any layout gives the same bits). The rank first materializes and loads the newest step the
tiers hold (RAM on its own node ``SHM/node<rank>``, every step; ``file://OBJ`` every 3rd, the tiers' own
policies), checks it bit for bit against the state a replay of that many steps gives, then trains to step
TOTAL with an asynchronous save (Megatron's ``AsyncRequest`` in an ``AsyncCallsQueue``) after every step,
into checkpoint directories under its node's own ``ROOT/node<rank>`` (no shared file system). Step KILL_AT
(0: none) is never committed: once the copies of earlier steps are done, both ranks SIGKILL themselves when
its commit, in the store's background thread, starts writing their manifests. Prints the step loaded, the
tiers that served it, the keys that differ from the replay, and the steps the tiers hold at the end.
"""

import os
import signal
import sys
import warnings

warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from megatron.core import dist_checkpointing  # noqa: E402
from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor  # noqa: E402
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue  # noqa: E402

from tierfs import TieredStore  # noqa: E402
from tierfs.adapters.megatron import TieredLoadStrategy, TieredSaveStrategy  # noqa: E402
from tierfs.policies import FixedIntervalPolicy, LatestN  # noqa: E402
from tierfs.testing import hooks  # noqa: E402
from tierfs.tiers import MemoryTier, ObjectTier  # noqa: E402

from _child import finish  # noqa: E402  (tests/children/ is the script's directory, first on sys.path)

# Megatron's AsyncCallsQueue puts the all-reduce of its finalization on torch.cuda.current_device(); this
# job runs on CPU with gloo, where that device is the CPU (nothing else of torch.cuda is used)
torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]

SHAPES = {"embedding": ((16, 8), torch.float32), "output": ((8, 12), torch.bfloat16),
          "norm": ((8,), torch.float32), "fc": ((2, 6, 4), torch.float32),
          "exp_avg.embedding": ((16, 8), torch.float32), "exp_avg.output": ((8, 12), torch.float32)}


def initial() -> dict:
    g = torch.Generator().manual_seed(0)
    return {k: torch.randn(shape, generator=g).to(dtype) for k, (shape, dtype) in SHAPES.items()}


def train(state: dict, step: int) -> None:
    """Step ``step``, in place: elementwise, from noise seeded by the step."""
    g = torch.Generator().manual_seed(1000 + step)
    for k, (shape, dtype) in SHAPES.items():
        noise = torch.randn(shape, generator=g)
        state[k].copy_((state[k].float() * 0.5 + noise).to(dtype))


def replay(step: int) -> dict:
    state = initial()
    for s in range(1, step + 1):
        train(state, s)
    return state


def sharded(state: dict, layout: str, step: int, rank: int) -> dict:
    """Megatron's sharded state dict of the global ``state`` at ``layout`` (views of it where contiguous)."""
    tp, tp_rank, dp_rank = (2, rank, 0) if layout == "tp" else (1, 0, rank)

    def rows(t):
        n = t.shape[0] // tp
        return t[tp_rank * n:(tp_rank + 1) * n]

    def cols(t):
        n = t.shape[-1] // tp
        return t[..., tp_rank * n:(tp_rank + 1) * n]

    def by_rows(key, t):
        return ShardedTensor.from_rank_offsets(key, rows(t), (0, tp_rank, tp), replica_id=dp_rank)

    def by_cols(key, t):
        return ShardedTensor.from_rank_offsets(key, cols(t), (1, tp_rank, tp), replica_id=dp_rank)

    layers = {str(i): {"fc.weight": ShardedTensor.from_rank_offsets(
        "decoder.layers.fc.weight", cols(state["fc"][i]), (0, i, 2), (2, tp_rank, tp), replica_id=dp_rank,
        prepend_axis_num=1)} for i in range(2)}
    return {
        "model": {"embedding.weight": by_rows("embedding.weight", state["embedding"]),
                  "output.weight": by_cols("output.weight", state["output"]),
                  "norm.weight": ShardedTensor.from_rank_offsets("norm.weight", state["norm"],
                                                                 replica_id=(0, tp_rank, dp_rank)),
                  "decoder": {"layers": layers}},
        "optimizer": {"state": {"exp_avg": {
            "embedding.weight": by_rows("optimizer.exp_avg.embedding.weight", state["exp_avg.embedding"]),
            "output.weight": by_cols("optimizer.exp_avg.output.weight", state["exp_avg.output"])}},
            "param_groups": [{"lr": 1e-3 / (1 + step), "betas": (0.9, 0.95), "step": step}]},
        "rng_state": ShardedObject("rng_state", {"seed": 1234 + rank, "draws": torch.arange(step + 3)},
                                   (2,), (rank,), replica_id=0),
        "iteration": step,
    }


def target(layout: str, rank: int) -> dict:
    """What to load into: the sharded state dict of fresh tensors (NaN), nothing of the checkpoint in them."""
    blank = {k: torch.full(shape, float("nan")).to(dtype) for k, (shape, dtype) in SHAPES.items()}
    return sharded(blank, layout, 0, rank)


def raw(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a tensor (bit for bit: NaN payloads and -0.0 count)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def differences(loaded: dict, expected: dict, layout: str, step: int, rank: int) -> list[str]:
    """The keys whose loaded values differ, bit for bit, from the sharded ``expected`` state."""
    want = sharded(expected, layout, step, rank)
    bad = []

    def walk(a, b, path):
        if isinstance(b, dict):
            for k in b:
                walk(a[k], b[k], f"{path}/{k}")
        elif isinstance(b, list):
            for i, (x, y) in enumerate(zip(a, b)):
                walk(x, y, f"{path}/{i}")
        elif isinstance(b, ShardedTensor):
            if a.dtype != b.data.dtype or a.shape != b.data.shape or not torch.equal(raw(a), raw(b.data)):
                bad.append(path)
        elif isinstance(b, ShardedObject):
            if a["seed"] != b.data["seed"] or not torch.equal(a["draws"], b.data["draws"]):
                bad.append(path)
        elif a != b:
            bad.append(path)

    walk(loaded, want, "")
    return bad


def main() -> None:
    shm, obj, root, layout, total, kill_at = sys.argv[1:7]
    total, kill_at = int(total), int(kill_at)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    store = TieredStore([MemoryTier(os.path.join(shm, f"node{rank}"), keep=LatestN(3)),
                         ObjectTier(f"file://{obj}", save=FixedIntervalPolicy(3))])
    node_root = os.path.join(root, f"node{rank}")  # this node's own disk: no file system is shared
    saving = TieredSaveStrategy(store, tier_policies=True, cached_metadata=True)
    loading = TieredLoadStrategy(store)
    out: dict = {"rank": rank, "loaded": None}

    ckpt_dir = loading.materialize(node_root)
    state = initial()
    start = 0
    if ckpt_dir is not None:
        if layout == "tp":
            loaded = dist_checkpointing.load(target(layout, rank), ckpt_dir, sharded_strategy=loading)
        else:  # Megatron finds the strategy from the directory's metadata.json (Megatron-LM's load path)
            loading.register()
            loaded = dist_checkpointing.load(target(layout, rank), ckpt_dir)
        start = loaded["iteration"]
        expected = replay(start)
        out.update(loaded=start, dir=os.path.basename(ckpt_dir),
                   load_diff=differences(loaded, expected, layout, start, rank),
                   sources=sorted(set(loading.last_reader.sources.values())))
        state = expected  # go on from the replayed state, which the load matched bit for bit (checked above)

    calls = AsyncCallsQueue()
    for step in range(start + 1, total + 1):
        train(state, step)
        calls.maybe_finalize_async_calls(blocking=True)  # the previous save is committed (Megatron-LM's rule)
        if step == kill_at:
            store.wait_until_finished()  # the copies of earlier steps are done: what the kill leaves is known
            hooks.add("stage", lambda stage, step, tier: os.kill(os.getpid(), signal.SIGKILL)
                      if stage == "manifest" and step == kill_at else None)
        ckpt_dir = os.path.join(node_root, f"iter_{step:07d}")
        os.makedirs(ckpt_dir, exist_ok=True)
        request = dist_checkpointing.save(sharded(state, layout, step, rank), ckpt_dir, sharded_strategy=saving,
                                          async_sharded_save=True)
        calls.schedule_async_request(request)
    calls.maybe_finalize_async_calls(blocking=True)
    store.wait_until_finished()
    out["steps"] = {str(s): t for s, t in store.steps().items()}
    store.close()
    finish(out)


if __name__ == "__main__":
    main()
