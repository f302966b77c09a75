"""A job of one process: the ranks' interface of :mod:`tierfs.ranks.groups` where there is nothing to
coordinate (no torch.distributed, or a world of one)."""

from __future__ import annotations

import contextlib
import datetime
import functools
from typing import Any, Callable, ContextManager, Sequence

#: seconds a rank waits for the others in any of tierfs's collectives, unless the store says otherwise
DEFAULT_TIMEOUT = 600.0


class SingleProcess:
    """A job of one process."""

    rank = 0
    world_size = 1
    local_rank = 0
    node_rank = 0
    nodes = (0,)
    node_ranks = (0,)

    #: the torch.distributed process group of tierfs's collectives (None: no torch.distributed)
    process_group: Any = None
    timeout = DEFAULT_TIMEOUT

    def all_gather(self, obj: Any) -> list[Any]:
        return [obj]

    def all_gather_ints(self, values: Sequence[int]) -> list[list[int]]:
        return [[int(v) for v in values]]

    def barrier(self) -> None:
        pass

    def all_reduce(self, values: Sequence[int], op: str = "min") -> list[int]:
        return [int(v) for v in values]

    def all_reduce_started(self, values: Sequence[int], op: str = "min") -> Callable[[], list[int]]:
        return functools.partial(self.all_reduce, values, op)

    def broadcast(self, obj: Any, src: int) -> Any:
        return obj

    def fork(self, backend: str | None = None, nice: int = 0, lanes: int = 1,
             timeout: float | datetime.timedelta | None = None) -> "SingleProcess":
        return self

    def with_timeout(self, timeout: float | datetime.timedelta | None) -> "SingleProcess":
        return self

    def bounded(self) -> ContextManager[Any]:
        return contextlib.nullcontext()
