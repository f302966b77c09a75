"""Where a peer tier's replicas go and who sends a lost shard back: pure functions of the ranks' node
numbers, the same on every rank."""

from __future__ import annotations

from typing import Callable, Mapping, Sequence, Union

from ..errors import TierfsError

__all__ = ["Strategy", "StrategyFn", "plan_fetch", "replica_targets"]

#: ``strategy(rank, nodes, replicas) -> target ranks``; ``nodes[r]`` is the node number of rank ``r``
StrategyFn = Callable[[int, Sequence[int], int], Sequence[int]]
Strategy = Union[str, StrategyFn]


def replica_targets(nodes: Sequence[int], replicas: int, strategy: Strategy = "ring") -> list[list[int]]:
    """For every rank, the ranks (on other nodes) that keep copies of its shard.

    ``"ring"``: nodes in order of their number; a rank sends to the rank with the same local index on
    each of the next ``replicas`` nodes. ``"pairwise"``: nodes form groups of ``replicas + 1`` (the last
    group takes any remainder, so odd node counts work), and the ring runs inside each group: with
    ``replicas=1`` nodes 0<->1, 2<->3, ... A callable ``strategy(rank, nodes, replicas)`` returns the
    target ranks itself.
    """
    order = sorted(set(nodes))
    members = {n: [r for r, x in enumerate(nodes) if x == n] for n in order}
    if len(order) < 2:
        raise TierfsError("the peer tier needs ranks on at least 2 nodes, but every rank is on one node; "
                          "run on more nodes or set TIERFS_NODE_RANK per node")
    if not isinstance(replicas, int) or not 1 <= replicas <= len(order) - 1:
        raise TierfsError(f"replicas={replicas!r} needs at least {replicas + 1 if isinstance(replicas, int) else 2} "
                          f"nodes; this job has {len(order)}")
    if callable(strategy):
        out = []
        for r in range(len(nodes)):
            ts = [int(t) for t in strategy(r, list(nodes), replicas)]
            bad = [t for t in ts if not 0 <= t < len(nodes) or nodes[t] == nodes[r]]
            if bad or len(set(ts)) != replicas:
                raise TierfsError(f"peer strategy gave rank {r} targets {ts}: need {replicas} distinct ranks "
                                  "on other nodes")
            out.append(ts)
        return out
    if strategy == "ring":
        rings = [order]
    elif strategy == "pairwise":
        g = replicas + 1
        rings = [order[i:i + g] for i in range(0, len(order) - len(order) % g, g)]
        rings[-1] = rings[-1] + order[len(order) - len(order) % g:]
    else:
        raise TierfsError(f"unknown peer strategy {strategy!r}; use 'ring', 'pairwise' or a function")
    out = [[] for _ in nodes]
    for ring in rings:
        for p, node in enumerate(ring):
            for i, r in enumerate(members[node]):
                for k in range(1, replicas + 1):
                    dst = members[ring[(p + k) % len(ring)]]
                    out[r].append(dst[i % len(dst)])
    return out


def plan_fetch(wanted: Mapping[int, Sequence[int]], sizes: Mapping[int, int] | None = None) -> dict[int, int]:
    """Pick one holder per wanted shard, ``{rank: [holder ranks]} -> {rank: holder}``.

    Largest shards first, each to the holder with the fewest bytes assigned so far (ties: lowest rank),
    so that when several peers hold copies the load is spread across them. Deterministic: every rank
    computes the same plan.
    """
    load: dict[int, int] = {}
    plan = {}

    def size(r: int) -> int:
        return sizes.get(r, 1) if sizes else 1
    for r in sorted(wanted, key=lambda r: (-size(r), r)):
        holders = sorted(set(wanted[r]))
        if holders:
            h = min(holders, key=lambda h: (load.get(h, 0), h))
            plan[r] = h
            load[h] = load.get(h, 0) + size(r)
    return plan
