"""Who else is saving: the ranks of the job, which of them share a node, and the few collectives the store
needs.

Without torch.distributed (or with one process) everything is local. Under torchrun the store uses gloo
groups of its own, so it never queues behind the training job's NCCL work; each of the store's threads
gets its own group (``fork``), so collectives from different threads never interleave. Only JSON crosses.

A node is a set of ranks sharing one RAM directory. Its number comes from ``TIERFS_NODE_RANK``, else
torchrun's ``GROUP_RANK``, else 0; tests run each process as its own node by setting it to the rank.
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
    node_ranks = (0,)

    def all_gather(self, obj: Any) -> list[Any]:
        return [obj]

    def barrier(self) -> None:
        pass

    def fork(self) -> "SingleProcess":
        return self


class TorchGroup:
    """The ranks of an initialised torch.distributed job, over a gloo group created for tierfs.

    Creating one is collective: every rank must do it, in the same order.
    """

    def __init__(self, backend: str = "gloo", node_rank: int | None = None) -> None:
        import torch.distributed as dist

        self._dist, self._backend = dist, backend
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self._pg = dist.new_group(backend=backend)
        if node_rank is None:
            node_rank = int(os.environ.get("TIERFS_NODE_RANK", os.environ.get("GROUP_RANK", "0")))
        self.node_rank = node_rank
        nodes = self.all_gather(node_rank)
        self.node_ranks = tuple(r for r, n in enumerate(nodes) if n == node_rank)
        self.local_rank = self.node_ranks.index(self.rank)

    def fork(self) -> "TorchGroup":
        """The same ranks over a new group, for use by another thread (collective)."""
        twin = object.__new__(TorchGroup)
        twin.__dict__.update(self.__dict__)
        twin._pg = self._dist.new_group(backend=self._backend)
        return twin

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
    import sys

    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return TorchGroup()
    return SingleProcess()
