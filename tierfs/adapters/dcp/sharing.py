"""What DCP's plan says of replicated items, as the store's :class:`~tierfs.core.dataparallel.Sharing`.

Before DCP's deduplication each rank's local plan lists every item it holds; after it, each item
several ranks hold is planned on one of them, chosen to spread the bytes. ``TieredWriter`` keeps the
names of its items in its local plan's ``storage_data`` (DCP gathers it with the plan, no collective of
tierfs's own); the coordinator, in ``prepare_global_plan``, works out for every rank which of its items
other ranks hold (the *group*) and which rank DCP planned each on (its *owner*, which stores it on
shared tiers), and sends it back in each rank's final plan. A caching planner keeps those final plans,
so an unchanged structure costs nothing more. Every rank uses the sharing only when all of them have
the one the coordinator worked out for this plan (``sid``), so ranks never disagree on who stores what.
"""

from __future__ import annotations

from typing import Any, Sequence

from ...core.dataparallel import Sharing
from .metadata import entry_name

HELD, SHARED = "tierfs_held", "tierfs_shared"


def held(items: Sequence[Any]) -> list[str]:
    """The entry names of a local plan's items (before deduplication)."""
    from torch.distributed.checkpoint.planner import WriteItemType

    return [entry_name(i.index, i.type == WriteItemType.BYTE_IO) for i in items]


def plan_sharing(plans: Sequence[Any], ranks: Sequence[int], sid: str) -> list[dict[str, Any] | None]:
    """For each final plan (deduplicated, with every rank's held names in its ``storage_data``), the
    sharing of its rank as JSON: ``{"sid", "groups": [[ranks]], "owners": {name: [owner, group]}}``;
    None for every plan when a plan lacks its held names."""
    from torch.distributed.checkpoint.planner import WriteItemType

    names = [p.storage_data.get(HELD) if isinstance(p.storage_data, dict) else None for p in plans]
    if any(n is None for n in names):
        return [None] * len(plans)
    owner = {entry_name(i.index, i.type == WriteItemType.BYTE_IO): ranks[k] for k, p in enumerate(plans)
             for i in p.items}
    holders: dict[str, list[int]] = {}
    for k, ns in enumerate(names):
        for n in ns or ():
            holders.setdefault(n, []).append(ranks[k])
    out: list[dict[str, Any]] = [{"sid": sid, "groups": [], "owners": {}} for _ in plans]
    index: list[dict[tuple[int, ...], int]] = [{} for _ in plans]
    at = {r: k for k, r in enumerate(ranks)}
    for n, hs in holders.items():
        if len(hs) < 2 or n not in owner:
            continue
        group = tuple(sorted(hs))
        for r in group:
            k = at[r]
            gi = index[k].get(group)
            if gi is None:
                gi = index[k][group] = len(out[k]["groups"])
                out[k]["groups"].append(list(group))
            out[k]["owners"][n] = [owner[n], gi]
    return list(out)


def sharing_of(shared: dict[str, Any] | None) -> Sharing | None:
    """The store's Sharing from :func:`plan_sharing`'s JSON of this rank."""
    if not shared or not shared["owners"]:
        return None
    return Sharing(tuple(tuple(g) for g in shared["groups"]), {n: (int(o), int(g)) for n, (o, g) in
                                                                shared["owners"].items()})
