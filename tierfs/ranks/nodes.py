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

from typing import Any, Callable, Sequence

from ..errors import TierfsError
from .agree import agree
from .groups import Group


class NodeMap:
    """The ranks sharing each node-local tier's storage, and every rank's identities (for checks)."""

    def __init__(self, rank: int, views: Sequence[dict[str, list[Any]]]) -> None:
        self.rank = rank
        self.views = list(views)  # per rank: {tier: [identity, location]}

    def sharing(self, tier: str) -> tuple[int, ...]:
        """The ranks whose ``tier`` is the same storage as this rank's (this rank included)."""
        mine = self.views[self.rank].get(tier, [None])[0]
        if mine is None:
            return (self.rank,)
        return tuple(r for r, v in enumerate(self.views) if v.get(tier, [None])[0] == mine)

    def check(self, nodes: Sequence[int], source: str) -> None:
        """Raise on every rank (the same error: every rank holds the same views) when two ranks share a
        tier's storage but ``nodes`` (from ``source``) puts them on different nodes."""
        for tier in sorted({t for v in self.views for t in v}):
            seen: dict[str, int] = {}
            for r, v in enumerate(self.views):
                ident = v.get(tier, [None])[0]
                if ident is None:
                    continue
                key = repr(ident)
                first = seen.setdefault(key, r)
                if nodes[first] != nodes[r]:
                    where = v[tier][1]
                    raise TierfsError(
                        f"ranks {first} and {r} share the directory {where} of tier {tier!r} but {source} puts them "
                        f"on nodes {nodes[first]} and {nodes[r]}: a directory lives on one node; give ranks that "
                        "share it the same node number, or give each rank a directory of its own")


def observe(group: Group, identities: Callable[[], dict[str, list[Any]]]) -> NodeMap:
    """Every rank's identities of its node-local tiers' storage, ``{tier: [identity, location]}`` as
    ``identities()`` gives them (collective; a rank that cannot read its own raises, and the others raise
    naming it)."""
    mine: dict[str, list[Any]] = {}
    failure: BaseException | None = None
    try:
        mine = identities()
    except Exception as e:  # noqa: BLE001 - told to the other ranks, then raised
        failure = e
    return NodeMap(group.rank, agree(group, mine, failure, "open the store: which ranks share a directory"))
