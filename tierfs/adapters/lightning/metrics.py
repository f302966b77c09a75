"""tierfs's figures in Lightning's own logging: :class:`TieredMetricsCallback` passes
:func:`tierfs.metrics.latest` to ``LightningModule.log_dict`` at the end of each training batch, so the save
stall, each tier's lag and time until durable and the RAM tier's use show in TensorBoard, W&B or CSV next
to the loss. Metrics must be on (``TIERFS_METRICS_PORT``, or :func:`tierfs.metrics.serve`)."""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Callback

from ... import metrics


class TieredMetricsCallback(Callback):
    """Log this rank's tierfs figures with ``pl_module.log_dict`` after each training batch.

    Parameters
    ----------
    prefix:
        Put before each name (they are ``tierfs/save_stall_seconds``, ``tierfs/lag_steps/<tier>``, ...).
    """

    def __init__(self, prefix: str = "") -> None:
        self.prefix = prefix

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        figures = metrics.latest()
        if figures:
            pl_module.log_dict({self.prefix + k: float(v) for k, v in figures.items()}, on_step=True,
                               on_epoch=False, logger=True, prog_bar=False)
