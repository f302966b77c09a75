"""Every rank's row of a few integers, read by the ranks that want them: through the job's key-value store.

A report that every rank should be able to read (where each rank's shard came from, after a restore) would
cost each rank bytes that grow with the job if it were gathered. Instead each rank writes its row to the
job's store (torch.distributed's TCPStore, to which every rank is connected already) in one request, and
a rank reads every rank's rows only when it asks for them: one wait and one read of every key. A job of
8,192 ranks whose ranks never look moves nothing more than one small write per rank.
"""

from __future__ import annotations

import datetime
import json
from typing import TYPE_CHECKING, Callable, Sequence

from ..errors import RankWaitError
from .diagnosis import job_store, raise_known
from .groups import SingleProcess

if TYPE_CHECKING:
    from .groups import Group

Rows = Callable[[], list[list[int]]]


def publish(group: "Group", tag: str, row: Sequence[int]) -> Rows:
    """Write this rank's ``row`` under ``tag`` (the same on every rank, new for each report: the group's
    job and collective count are added); returns the function that reads every rank's rows, in rank
    order, waiting up to the group's timeout for ranks that have not written theirs yet."""
    mine = [int(v) for v in row]
    if isinstance(group, SingleProcess) or group.world_size == 1:
        return lambda: [mine]
    store = job_store(group._dist)
    if store is None:  # a torch without a reachable store: the rows are gathered, as collectives
        gathered = group.all_gather_ints(mine)
        return lambda: gathered
    prefix = f"tierfs/report/{group._job}/{group._calls[0]}/{tag}"
    store.set(f"{prefix}/{group.rank}", json.dumps(mine))
    n, timeout = group.world_size, group.timeout
    got: list[list[int]] = []

    def read() -> list[list[int]]:
        if not got:
            raise_known(group._dist, group.rank, f"the ranks' reports of {tag}")  # a failed rank never writes
            keys = [f"{prefix}/{r}" for r in range(n)]
            try:
                store.wait(keys, datetime.timedelta(seconds=timeout))
            except Exception as e:  # noqa: BLE001 - the store says which keys only by timing out
                missing = [r for r, k in enumerate(keys) if not store.check([k])]
                raise RankWaitError(f"rank(s) {missing[:8]} did not report {tag} within {timeout:g} s ({e})",
                                    ranks=missing) from None
            got.extend(json.loads(v) for v in store.multi_get(keys))
        return [list(r) for r in got]

    return read
