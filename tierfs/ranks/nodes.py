"""Which ranks share a RAM directory: observed when a store opens, checked against the node numbers.

Every rank sends the identity of the storage of each of its node-local tiers (for the RAM tier: host,
device and inode of its root directory). Ranks with the same identity share the directory: the lowest of
them writes its markers and deletes whole steps, the others take back only their own files. Ranks whose
directories differ each own theirs, so per-rank directories on one machine simply work.

Node numbers (``TIERFS_NODE_RANK``, torchrun's ``GROUP_RANK``, a ``PeerTier(node_rank=...)``) say which
ranks are on one machine: the peer tier puts copies on other nodes. A directory lives on one machine, so
ranks that share one must have the same node number; where they do not, the setup is wrong, and every rank
raises the same one-line error naming the ranks and the directory.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Callable, Sequence

import numpy as np

from ..errors import TierfsError
from .agree import agreement, views as rank_views
from .groups import Group, TorchGroup


def _key(identity: Any) -> int:
    """A storage identity as a 62-bit number (equal identities, equal numbers)."""
    data = json.dumps(identity, sort_keys=True).encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 2


class NodeMap:
    """The ranks sharing each node-local tier's storage: every rank's identity of each tier's storage, as a
    number (8 bytes per tier and rank), and this rank's locations; or, where the ranks of each node share
    one directory per tier (``keys`` None, ``nodes`` every rank's node number), the ranks of its node."""

    def __init__(self, rank: int, tiers: Sequence[str], keys: Sequence[Sequence[int]] | None,
                 locations: dict[str, str], group: Group | None = None, nodes: Sequence[int] = ()) -> None:
        self.rank = rank
        self.tiers = list(tiers)
        # per rank: the identity's number of each of ``tiers`` (0: none); None: the same per node
        self.keys = [list(k) for k in keys] if keys is not None else None
        self.nodes = list(nodes)
        self.locations = dict(locations)  # this rank's
        self._group = group

    def sharing(self, tier: str) -> tuple[int, ...]:
        """The ranks whose ``tier`` is the same storage as this rank's (this rank included)."""
        if tier not in self.tiers:
            return (self.rank,)
        if self.keys is None:
            return tuple(r for r, n in enumerate(self.nodes) if n == self.nodes[self.rank])
        k = self.tiers.index(tier)
        mine = self.keys[self.rank][k]
        return tuple(r for r, v in enumerate(self.keys) if v[k] == mine)

    def check(self, nodes: Sequence[int], source: str) -> None:
        """Raise on every rank (the same error: every rank holds the same identities) when two ranks share a
        tier's storage but ``nodes`` (from ``source``) puts them on different nodes. Collective when it raises:
        the first of those ranks tells the others where the directory is."""
        if self.keys is None:
            return  # each node's ranks share its directories, and neighbouring nodes' differ (observe checked)
        for k, tier in sorted(enumerate(self.tiers), key=lambda x: x[1]):
            seen: dict[int, int] = {}
            for r, v in enumerate(self.keys):
                first = seen.setdefault(v[k], r)
                if nodes[first] != nodes[r]:
                    where = self.locations.get(tier, "") if self.rank == first else ""
                    if self._group is not None and self._group.world_size > 1:
                        where = self._group.broadcast(where, first)
                    raise TierfsError(
                        f"ranks {first} and {r} share the directory {where} of tier {tier!r} but {source} puts them "
                        f"on nodes {nodes[first]} and {nodes[r]}: a directory lives on one node; give ranks that "
                        "share it the same node number, or give each rank a directory of its own")


def observe(group: Group, identities: Callable[[], dict[str, list[Any]]]) -> NodeMap:
    """Every rank's identities of its node-local tiers' storage (``identities()`` gives this rank's,
    ``{tier: [identity, location]}``), collective: a rank that cannot read its own raises, and the others
    raise naming it. The ranks' tiers are the store's, the same names on every rank."""
    mine: dict[str, list[Any]] = {}
    with agreement(group, "open the store: which ranks share a directory"):
        mine = identities()
    tiers = sorted(mine)
    if rank_views(group, tiers) != [tiers] * group.world_size:
        raise TierfsError(f"ranks have different node-local tiers (this rank: {tiers}); give every rank the same tiers")
    row = [_key(mine[t][0]) for t in tiers]
    locations = {t: str(mine[t][1]) for t in tiers}
    if not tiers or group.world_size == 1:
        return NodeMap(group.rank, tiers, [row] * group.world_size, locations, group)
    if _per_node(group, row):
        return NodeMap(group.rank, tiers, None, locations, group, group.nodes)
    return NodeMap(group.rank, tiers, group.all_gather_ints(row), locations, group)


def _per_node(group: Group, row: list[int]) -> bool:
    """Whether each node's ranks share one storage per tier, and every node's differs from its neighbours'
    (collective): each rank compares its identities with the previous rank's, sent point to point around
    the ring, then one all-reduce says whether all matched. The usual layout (one RAM directory per
    machine) is thus confirmed in a few bytes per rank; any other is gathered."""
    assert isinstance(group, TorchGroup)
    n, r = group.world_size, group.rank
    prev = np.zeros(8 * len(row), dtype=np.uint8)
    group.exchange([((r + 1) % n, np.array(row, dtype=np.int64).view(np.uint8))], [((r - 1) % n, prev)])
    same_node = group.nodes[(r - 1) % n] == group.nodes[r]
    ok = all((a == b) == same_node for a, b in zip(prev.view(np.int64).tolist(), row))
    return group.all_reduce([int(ok)], "min")[0] == 1
