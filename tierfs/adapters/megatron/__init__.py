"""Megatron-Core's distributed checkpointing on tierfs: save and load strategies for
``megatron.core.dist_checkpointing`` whose checkpoints are steps of a :class:`~tierfs.TieredStore`.

    store = TieredStore([MemoryTier("/dev/shm/ckpt", keep=LatestN(2)),
                         ObjectTier("s3://bucket/run", save=FixedIntervalPolicy(1000))])
    save_strategy, load_strategy = TieredSaveStrategy(store), TieredLoadStrategy(store)
    dist_checkpointing.save(state, f"{root}/iter_{it:07d}", sharded_strategy=save_strategy)
    ckpt_dir = load_strategy.materialize(root)                       # None: nothing saved yet
    state = dist_checkpointing.load(sharded_state_dict, ckpt_dir, sharded_strategy=load_strategy)

Supported: megatron-core 0.16 (``pip install 'tierfs[megatron]'``). Importing :mod:`tierfs` never imports
Megatron; importing this package does. See ``docs/megatron.md``.

How it works
------------
* Saving converts the ``ShardedStateDict`` as Megatron's ``TorchDistSaveShardedStrategy`` does, with
  Megatron's own helpers (``_replace_state_dict_keys_with_sharded_keys``, ``mcore_to_pyt_state_dict``:
  ``ShardedTensor`` s become DCP chunks at their global offsets, ``ShardedObject`` s bytes items) and
  Megatron's ``MCoreSavePlanner``, and hands the result to ``dcp.save`` with
  :class:`~tierfs.adapters.dcp.TieredWriter`: step ``N`` (the number the checkpoint directory's name ends
  with), committed once every rank's shard is written. Rank 0 adds the ``common.pt`` Megatron just wrote
  and the ``metadata.json`` it writes next, so the step is the whole checkpoint.
* Asynchronous saves return Megatron's ``AsyncRequest``: the tensors are staged into the first tier before
  it returns; its finalize function waits for the commit there and raises a failure on every rank.
* Loading converts back as ``TorchDistLoadShardedStrategy`` does (``MCoreLoadPlanner`` with its global
  shape checks, ``_unwrap_pyt_sharded_tensor``, ``_replace_sharded_keys_with_state_dict_keys``), reading
  with :class:`~tierfs.adapters.dcp.TieredReader` from the fastest verified copy: another parallel layout
  than the saving one reshards, as with Megatron's own format.
"""

from .strategies import BACKEND, VERSION, TieredLoadStrategy, TieredSaveStrategy

SUPPORTED_MEGATRON_CORE = "0.16"

__all__ = ["TieredSaveStrategy", "TieredLoadStrategy", "BACKEND", "VERSION", "SUPPORTED_MEGATRON_CORE"]
