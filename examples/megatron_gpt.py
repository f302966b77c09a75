"""Megatron-Core GPT training with its checkpoints in tierfs: RAM every step, object storage every few.

A real ``GPTModel`` (megatron-core 0.16, a tiny config) trains with tensor parallelism, Megatron's own
DDP wrapper and Megatron's own optimizer (``get_megatron_optimizer``), and saves through
``megatron.core.dist_checkpointing`` with tierfs's strategies: asynchronous saves (Megatron's
``AsyncCallsQueue``) to the RAM tier every step and to the object tier every ``--object-every`` steps.
Each run resumes from the newest step the tiers hold (RAM first; the object tier where RAM is gone), at
the layout it runs with: a checkpoint saved at TP=2 loads at TP=1 x DP=2 as well.

    torchrun --nproc-per-node 2 examples/megatron_gpt.py --ram /dev/shm/tierfs-gpt \\
        --object file:///tmp/tierfs-gpt-object --ckpt /tmp/tierfs-gpt-ckpt --tp 2 --steps 8 --digest
    # again (after a crash, or with a larger --steps): resumes from RAM; with the RAM directory and
    # --ckpt gone (new machines): from the object tier; with --tp 1: at TP=1 x DP=2
    # --object s3://bucket/run (credentials as boto finds them; --endpoint-url for MinIO and the like)

``--digest`` prints, at every save and after every resume, sha256 digests of the model's and the
optimizer's state gathered whole (every shard at its global offset, whatever the layout): a resumed run
prints the digests the saving run printed for that step, bit for bit.

Written for GPUs (NCCL); the block marked "CPU only" below lets it run on a machine without one (gloo).
On GPUs, delete that block and nothing else.
"""

from __future__ import annotations

import argparse
import hashlib
import os

import torch
import torch.distributed as dist

# --- CPU only: megatron-core 0.16 assumes CUDA; these lines make "cuda" the CPU. Delete on GPUs. ---
from megatron.core.tensor_parallel import random as _megatron_random  # noqa: E402


class _CudaIsCpu(torch.overrides.TorchFunctionMode):
    """Tensors Megatron makes on "cuda" (FP32Optimizer's loss scale, the gradient norm's buffers) are
    made on the CPU, ``.cuda()`` keeps a tensor where it is, and ``.type()`` names the CUDA type Megatron
    checks for (its gradient clipping asserts ``torch.cuda.FloatTensor``)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs = {**kwargs, "device": "cpu"}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return func(*args).replace("torch.", "torch.cuda.", 1)
        return func(*args, **kwargs)


_CudaIsCpu().__enter__()  # for the rest of the program (this thread: the one that trains)
torch.cuda.current_device = lambda: "cpu"  # Megatron's DDP buffers, weights, AsyncCallsQueue's all-reduce
torch.cuda.set_device = lambda device: None
# Megatron's RNG tracker (dropout, weight init) keeps CUDA generator states: here the CPU generator's
# (so model_parallel_cuda_manual_seed seeds the CPU generator as well)
torch.cuda.manual_seed = torch.manual_seed
torch.cuda.get_rng_state = torch.cuda.random.get_rng_state = lambda device="cuda": torch.get_rng_state()
_megatron_random._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)
# --- end of CPU only ---

from megatron.core import dist_checkpointing, parallel_state  # noqa: E402
from megatron.core.dist_checkpointing import ShardedTensor  # noqa: E402
from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject  # noqa: E402
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue  # noqa: E402
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer  # noqa: E402
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed  # noqa: E402
from megatron.core.transformer import TransformerConfig  # noqa: E402

from tierfs import TieredStore  # noqa: E402
from tierfs.adapters.megatron import TieredLoadStrategy, TieredSaveStrategy  # noqa: E402
from tierfs.policies import FixedIntervalPolicy, LatestN  # noqa: E402
from tierfs.tiers import MemoryTier, ObjectTier  # noqa: E402

VOCAB, SEQ, BATCH = 64, 16, 4


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ram", required=True, help="this node's RAM tier directory (e.g. under /dev/shm)")
    p.add_argument("--object", required=True, help="the object tier's URL (s3://bucket/run, file:///path)")
    p.add_argument("--endpoint-url", help="an S3-compatible endpoint for --object (MinIO and the like)")
    p.add_argument("--ckpt", required=True, help="this node's checkpoint directories (Megatron's --save/--load)")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel size (data-parallel: the rest)")
    p.add_argument("--steps", type=int, default=8, help="train up to this step")
    p.add_argument("--object-every", type=int, default=3, help="save to the object tier every N steps")
    p.add_argument("--digest", action="store_true", help="print digests of the whole state at saves and loads")
    return p.parse_args()


def build(tp: int):
    """Megatron's parallel state, a tiny GPTModel in Megatron's DDP wrapper, and Megatron's optimizer."""
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    torch.manual_seed(1234)
    model_parallel_cuda_manual_seed(1234)
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                               tensor_model_parallel_size=tp, hidden_dropout=0.0, attention_dropout=0.0)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=VOCAB,
                     max_sequence_length=SEQ)
    ddp_model = DistributedDataParallel(config, DistributedDataParallelConfig(), model)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-3, weight_decay=0.01, clip_grad=1.0), [ddp_model])
    return model, ddp_model, optimizer


def train_step(ddp_model, optimizer, step: int) -> float:
    """One step on a batch of its own seed (this data-parallel rank's share of it)."""
    g = torch.Generator().manual_seed(step * 1000 + parallel_state.get_data_parallel_rank())
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g).cuda()
    positions = torch.arange(SEQ).expand(BATCH, SEQ).cuda()
    ddp_model.zero_grad_buffer()
    optimizer.zero_grad()
    loss = ddp_model(tokens[:, :-1], positions, None, labels=tokens[:, 1:]).float().mean()
    loss.backward()
    ddp_model.finish_grad_sync()
    optimizer.step()
    return loss.item()


def sharded_state(model, optimizer, iteration: int = 0, is_loading: bool = False) -> dict:
    """Megatron's sharded state dict of the model and its optimizer (the unwrapped model's keys)."""
    model_sd = model.sharded_state_dict()
    return {"model": model_sd, "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=is_loading),
            "iteration": iteration}


def digests(state: dict) -> dict[str, str]:
    """sha256 of the model's and of the optimizer's state, each tensor gathered whole (the main replicas'
    shards put at their global offsets), so any layout gives the same digest for the same state; the
    optimizer's also covers its other values (param groups, step). Collective."""
    shards, plain = [], {}

    def walk(x, path):
        if isinstance(x, dict):
            for k in sorted(x, key=str):
                walk(x[k], f"{path}/{k}")
        elif isinstance(x, (list, tuple)):
            for i, v in enumerate(x):
                walk(v, f"{path}/{i}")
        elif isinstance(x, ShardedTensor):
            replica = x.replica_id if isinstance(x.replica_id, tuple) else (x.replica_id,)
            if not any(replica):
                shape = (1,) * x.prepend_axis_num + tuple(x.local_shape)  # layer-stacked: the layer's axis first
                shards.append((x.key, x.global_shape, x.global_offset, shape, x.data.detach().cpu()))
        elif not isinstance(x, LocalNonpersistentObject):
            plain[path] = x.tolist() if isinstance(x, torch.Tensor) else x

    walk(state["optimizer"], "optimizer")
    walk(state["model"], "model")
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, shards)
    whole: dict[str, torch.Tensor] = {}
    for key, shape, offset, local_shape, data in (s for rank_shards in gathered for s in rank_shards):
        t = whole.setdefault(key, torch.empty(shape, dtype=data.dtype))
        t[tuple(slice(o, o + n) for o, n in zip(offset, local_shape))] = data.reshape(local_shape)
    out = {}
    for part in ("model", "optimizer"):
        h = hashlib.sha256()
        for key in sorted(k for k in whole if k.startswith("optimizer.") == (part == "optimizer")):
            t = whole[key]
            h.update(f"{key} {t.dtype} {tuple(t.shape)}".encode())
            h.update(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        if part == "optimizer":
            h.update(repr(sorted((k, repr(v)) for k, v in plain.items() if k.startswith("optimizer"))).encode())
        out[part] = h.hexdigest()
    return out


def main() -> None:
    args = parse_args()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group()  # NCCL for CUDA tensors and gloo for CPU ones (gloo only on CPU)
    rank = dist.get_rank()

    def say(msg: str) -> None:
        if rank == 0:
            print(msg, flush=True)

    model, ddp_model, optimizer = build(args.tp)
    say(f"GPTModel at TP={args.tp} x DP={parallel_state.get_data_parallel_world_size()}, "
        f"optimizer {type(optimizer).__name__} of {[type(o).__name__ for o in optimizer.chained_optimizers]}")

    options = {"endpoint_url": args.endpoint_url} if args.endpoint_url else None
    store = TieredStore([
        MemoryTier(args.ram, keep=LatestN(2)),                                       # every save
        ObjectTier(args.object, options, save=FixedIntervalPolicy(args.object_every), keep=LatestN(2)),
    ])
    save_strategy = TieredSaveStrategy(store, tier_policies=True)
    load_strategy = TieredLoadStrategy(store)

    # resume: the newest step every rank can get, from the fastest tier holding a verified copy
    start, ckpt_dir = 0, load_strategy.materialize(args.ckpt)  # None: nothing saved yet
    if ckpt_dir is not None:
        state = dist_checkpointing.load(sharded_state(model, optimizer, is_loading=True), ckpt_dir,
                                        sharded_strategy=load_strategy)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["iteration"]
        served: list = [None] * dist.get_world_size()
        dist.all_gather_object(served, sorted(set(load_strategy.last_reader.sources.values())))
        say(f"resumed step {start} from {os.path.basename(ckpt_dir)}, tiers per rank: {served}")
        if args.digest:
            d = digests(sharded_state(model, optimizer, start))  # what the model and optimizer now hold
            say(f"loaded step {start} model {d['model']} optimizer {d['optimizer']}")

    calls = AsyncCallsQueue()  # Megatron's queue of asynchronous saves
    for step in range(start + 1, args.steps + 1):
        loss = train_step(ddp_model, optimizer, step)
        calls.maybe_finalize_async_calls(blocking=False)
        state = sharded_state(model, optimizer, step)
        if args.digest:
            d = digests(state)
            say(f"saved step {step} model {d['model']} optimizer {d['optimizer']} loss {loss:.6f}")
        else:
            say(f"step {step} loss {loss:.6f}")
        ckpt_dir = os.path.join(args.ckpt, f"iter_{step:07d}")
        os.makedirs(ckpt_dir, exist_ok=True)
        request = dist_checkpointing.save(state, ckpt_dir, sharded_strategy=save_strategy, async_sharded_save=True)
        calls.schedule_async_request(request)  # returns once the tensors are in RAM: training goes on
    calls.maybe_finalize_async_calls(blocking=True)
    store.wait_until_finished()  # the copies to the object tier
    say("tiers hold: " + ", ".join(f"step {s}: {'+'.join(t)}" for s, t in store.steps().items()))
    store.close()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
