"""PyTorch Lightning on tierfs: a ``CheckpointIO`` plugin.

    io = TieredCheckpointIO([MemoryTier("/dev/shm/ckpt", keep=LatestN(2)),
                             ObjectTier("s3://bucket/run", save=FixedIntervalPolicy(100))])
    trainer = Trainer(plugins=[io], callbacks=[ModelCheckpoint(every_n_train_steps=10, save_top_k=-1)])
    trainer.fit(model, ckpt_path=io.last_checkpoint())   # the newest checkpoint, or None: start afresh

Supported: the ``lightning`` package (``lightning.pytorch``), versions 2.2 to 2.6 (tested with 2.6.6).
Importing :mod:`tierfs` never imports Lightning; importing this package does.

See ``docs/lightning.md`` for the design: each checkpoint path is mapped to the tierfs step
``checkpoint["global_step"]``; tensors are array entries, the rest JSON, Python objects as ``torch.save``
bytes loaded with ``weights_only=True``; saves are asynchronous; only global rank 0 saves, with a store of
one process (no collectives).
"""

from .checkpointio import TieredCheckpointIO
from .common import META_KEY, SUPPORTED_LIGHTNING
from .metrics import TieredMetricsCallback
from .strategy import TieredModelParallelStrategy

__all__ = ["TieredCheckpointIO", "TieredMetricsCallback", "TieredModelParallelStrategy", "SUPPORTED_LIGHTNING",
           "META_KEY"]
