"""Who else is saving: the ranks of the job and the few collectives the store needs.

Without torch.distributed (or with one process) everything is local. Under torchrun the store uses a
gloo group of its own, so it never queues behind the training job's NCCL work. Only JSON crosses it.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np


class SingleProcess:
    """A job of one process."""

    rank = 0
    world_size = 1
    local_rank = 0

    def all_gather(self, obj: Any) -> list[Any]:
        return [obj]

    def barrier(self) -> None:
        pass


class TorchGroup:
    """The ranks of an initialised torch.distributed job, over a gloo group created for tierfs."""

    def __init__(self, backend: str = "gloo") -> None:
        import torch.distributed as dist

        self._dist = dist
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self._pg = dist.new_group(backend=backend)

    def all_gather(self, obj: Any) -> list[Any]:
        import torch

        data = np.frombuffer(json.dumps(obj).encode(), dtype=np.uint8)
        n = torch.tensor([data.size], dtype=torch.int64)
        sizes = [torch.zeros_like(n) for _ in range(self.world_size)]
        self._dist.all_gather(sizes, n, group=self._pg)
        width = int(max(s.item() for s in sizes))
        buf = torch.zeros(width, dtype=torch.uint8)
        buf[: data.size] = torch.from_numpy(data.copy())
        outs = [torch.empty(width, dtype=torch.uint8) for _ in range(self.world_size)]
        self._dist.all_gather(outs, buf, group=self._pg)
        return [json.loads(bytes(o[: int(s.item())].numpy())) for o, s in zip(outs, sizes)]

    def barrier(self) -> None:
        self._dist.barrier(group=self._pg)


def default_group() -> SingleProcess | TorchGroup:
    try:
        import sys

        dist = sys.modules.get("torch.distributed")
        if dist is not None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            return TorchGroup()
    except Exception:  # noqa: BLE001 - no usable torch.distributed means a single process
        pass
    return SingleProcess()
