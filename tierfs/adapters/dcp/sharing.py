"""What DCP's plan says of replicated items, as the store's :class:`~tierfs.core.dataparallel.Sharing`.

Before DCP's deduplication each rank's local plan lists every item it holds; after it, each item
several ranks hold is planned on one of them, chosen to spread the bytes. ``TieredWriter`` keeps the
names of its items in its local plan's ``storage_data`` (DCP gathers it with the plan, no collective of
tierfs's own); the coordinator, in ``prepare_global_plan``, works out for every rank which of its items
other ranks hold (the *group*) and which rank DCP planned each on (its *owner*, which stores it on
shared tiers), and sends it back in each rank's final plan. A caching planner keeps those final plans,
so an unchanged structure costs nothing more. Every rank uses the sharing only when all of them have
the one the coordinator worked out for this plan (``sid``), so ranks never disagree on who stores what.

At scale (thousands of ranks) the coordinator's work is linear in what the ranks sent it: ranks that
hold the same names in the same order (data-parallel replicas) are worked out once, each distinct
group of ranks once, and a group travels as runs of ranks (:func:`encode_ranks`: every rank of a pure
data-parallel job is one run, an HSDP replica group one strided run), so what each rank receives is
about the size of its own items, whatever the number of ranks.
"""

from __future__ import annotations

from typing import Any, Sequence

from ...core.dataparallel import Sharing
from .metadata import entry_name

HELD, SHARED = "tierfs_held", "tierfs_shared"


def held(items: Sequence[Any]) -> list[str]:
    """The entry names of a local plan's items (before deduplication).

    Parameters
    ----------
    items : sequence of WriteItem
        A local save plan's items.

    Returns
    -------
    list of str
        Their tierfs entry names, in order.
    """
    from torch.distributed.checkpoint.planner import WriteItemType

    return [entry_name(i.index, i.type == WriteItemType.BYTE_IO) for i in items]


def encode_ranks(ranks: Sequence[int]) -> list[Any]:
    """A sorted group of ranks as JSON runs.

    Parameters
    ----------
    ranks : sequence of int
        Ranks in ascending order (a repeated rank is kept).

    Returns
    -------
    list
        Each element is a rank (an int), ``[start, stop, step]`` (the ranks of ``range(start, stop,
        step)``) or ``[start, stop, step, count, stride]`` (``count`` such ranges, each ``stride`` after
        the one before). ``range(8)`` is ``[[0, 8, 1]]``, an HSDP replica group ``0, 4, 8, 12`` is
        ``[[0, 16, 4]]``, and a replica group over two mesh dimensions one five-number run.
        :func:`decode_ranks` gives the ranks back.
    """
    runs: list[tuple[int, int, int]] = []  # (start, length, step) of arithmetic runs, greedily
    i, n = 0, len(ranks)
    while i < n:
        j, step = i, 1
        if i + 1 < n and ranks[i + 1] > ranks[i]:
            step, j = ranks[i + 1] - ranks[i], i + 1
            while j + 1 < n and ranks[j + 1] - ranks[j] == step:
                j += 1
        runs.append((int(ranks[i]), j - i + 1, step))
        i = j + 1
    out: list[Any] = []
    i = 0
    while i < len(runs):  # equal runs whose starts step evenly become one
        start, length, step = runs[i]
        j = i
        if i + 1 < len(runs) and runs[i + 1][1:] == (length, step):
            stride = runs[i + 1][0] - start
            j = i + 1
            while j + 1 < len(runs) and runs[j + 1][1:] == (length, step) and runs[j + 1][0] - runs[j][0] == stride:
                j += 1
        stop = start + length * step
        if j > i:
            out.append([start, stop, step, j - i + 1, runs[i + 1][0] - start])
        else:
            out.append(start if length == 1 else [start, stop, step])
        i = j + 1
    return out


def decode_ranks(runs: Sequence[Any]) -> tuple[int, ...]:
    """The ranks of :func:`encode_ranks`'s runs.

    Parameters
    ----------
    runs : sequence
        What :func:`encode_ranks` returned (after a JSON or pickle round trip).

    Returns
    -------
    tuple of int
        The ranks, in the order they were encoded.
    """
    out: list[int] = []
    for x in runs:
        if isinstance(x, int):
            out.append(x)
            continue
        start, stop, step, *rest = x
        count, stride = rest if rest else (1, 0)
        for c in range(count):
            out.extend(range(start + c * stride, stop + c * stride, step))
    return tuple(out)


def plan_sharing(plans: Sequence[Any], ranks: Sequence[int], sid: str) -> list[dict[str, Any] | None]:
    """Each rank's sharing, from the final (deduplicated) plans.

    Parameters
    ----------
    plans : sequence of SavePlan
        The final global plans, each with its rank's held names (:func:`held`) under ``HELD`` in its
        ``storage_data``.
    ranks : sequence of int
        The rank of each plan.
    sid : str
        The sharing's id (the save's), which every rank checks before using it.

    Returns
    -------
    list of dict or None
        For each plan, its rank's sharing as JSON: ``{"sid", "groups": [runs of ranks]
        (:func:`encode_ranks`), "owners": {name: [owner, group index]}}``; None for every plan when a
        plan lacks its held names. Plans whose ranks hold the same names get the same object.

    Notes
    -----
    Linear in the names the ranks sent: ranks holding the same names in the same order are worked out
    once, and each distinct group of ranks is made and encoded once. The decisions (groups, their
    order on each rank, owners) are those of working out every name on every rank: a name two or more
    ranks hold is owned by the rank whose final plan has it, each rank's groups in the order their first
    name appears in the plans (by rank, then position).
    """
    from torch.distributed.checkpoint.planner import WriteItemType

    names = [p.storage_data.get(HELD) if isinstance(p.storage_data, dict) else None for p in plans]
    if any(n is None for n in names):
        return [None] * len(plans)
    # ranks with the same held names (in the same order) have the same sharing: each list once
    seen: dict[tuple[str, ...], int] = {}
    lists: list[tuple[str, ...]] = []
    members: list[list[int]] = []  # plan indices holding each distinct list
    kind: list[int] = []
    for k, ns in enumerate(names):
        key = tuple(ns or ())
        i = seen.setdefault(key, len(lists))
        if i == len(lists):
            lists.append(key)
            members.append([])
        members[i].append(k)
        kind.append(i)
    # the lists holding each name, names in order of their first appearance (by rank, then position)
    where: dict[str, list[int]] = {}
    for i, ns2 in enumerate(lists):
        for n in ns2:
            where.setdefault(n, []).append(i)
    groups: dict[tuple[int, ...], tuple[int, tuple[int, ...]]] = {}  # lists holding a name -> (id, ranks)

    def group(ls: tuple[int, ...]) -> tuple[int, tuple[int, ...]]:
        got = groups.get(ls)
        if got is None:
            got = groups[ls] = (len(groups), tuple(sorted(ranks[k] for i in ls for k in members[i])))
        return got

    shared = {n: group(tuple(ls)) for n, ls in where.items() if len(ls) > 1 or len(members[ls[0]]) > 1}
    fqns = {n.split("|", 1)[1] for n in shared}  # only these items' names are needed
    owner = {}
    for k, p in enumerate(plans):
        for it in p.items:
            if it.index.fqn in fqns:
                name = entry_name(it.index, it.type == WriteItemType.BYTE_IO)
                if name in shared:
                    owner[name] = ranks[k]
    encoded: dict[int, list[Any]] = {}
    out: list[dict[str, Any]] = [{"sid": sid, "groups": [], "owners": {}} for _ in lists]
    index: list[dict[int, int]] = [{} for _ in lists]
    for n, (gid, g) in shared.items():
        if len(g) < 2 or n not in owner:
            continue
        for i in dict.fromkeys(where[n]):
            gi = index[i].get(gid)
            if gi is None:
                gi = index[i][gid] = len(out[i]["groups"])
                if gid not in encoded:
                    encoded[gid] = encode_ranks(g)
                out[i]["groups"].append(encoded[gid])
            out[i]["owners"][n] = [owner[n], gi]
    return [out[i] for i in kind]


def sharing_of(shared: dict[str, Any] | None) -> Sharing | None:
    """The store's Sharing from :func:`plan_sharing`'s JSON of this rank.

    Parameters
    ----------
    shared : dict or None
        This rank's entry of :func:`plan_sharing`'s result.

    Returns
    -------
    Sharing or None
        None when the rank shares nothing.
    """
    if not shared or not shared["owners"]:
        return None
    return Sharing(tuple(decode_ranks(g) for g in shared["groups"]),
                   {n: (int(o), int(g)) for n, (o, g) in shared["owners"].items()})
