"""Entries several ranks hold identically (data parallelism), stored once per tier class.

With DDP, or the replicated dimension of HSDP, many ranks hold the same bytes. A :class:`Sharing` names,
for the leaves of one rank's state that other ranks hold too, the ranks that hold each (its *group*) and
the one rank that stores it on shared tiers (its *owner*). It is decided once per structure: from DCP's
plan (``TieredWriter``: the items planned on several ranks, and the rank DCP's deduplication picked), or
from the user's declaration (``TieredStore.save(replicated=...)``), never by comparing per-item lists on
every save.

Leaves with the same owner and group form a *bundle*. :func:`place` lays a rank's leaves out in three
kinds of files: the leaves only this rank holds (sent to peers as replicas), the bundles it owns (stored
on shared tiers, never replicated: the group's other ranks hold them in RAM) and the bundles other ranks
own (its RAM tier alone keeps them). A bundle's entries sit at the same offsets relative to its parts on
every rank of its group (sorted by name, packed from an aligned start), so a bundle moves between ranks
as a few contiguous ranges (:mod:`tierfs.core.restore.bundles`).

:func:`digests` and :func:`check_digests` catch ranks that hold different values of what they declared
identical, at the commit: each rank compares its digest of a group with the group's previous rank's,
point to point, so the check costs a rank the same at any job size.
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

from ..util import args as _args
from ..errors import ArgumentError, TierfsError
from ..format import Entry, align, crc32c, shard_filename
from ..ranks.groups import SingleProcess as _SingleProcess

if TYPE_CHECKING:
    from ..ranks import Group


@dataclass(frozen=True)
class Sharing:
    """Which leaves of this rank's state other ranks hold identically.

    ``groups`` are sorted tuples of ranks; ``owners`` maps a leaf's name to ``(owner rank, index in
    groups)``. Leaves not named are this rank's alone. A save whose sharing is the same object as the
    previous one's (``CheckpointManager``) is not compared further.
    """

    groups: tuple[tuple[int, ...], ...]
    owners: Mapping[str, tuple[int, int]]

    def __bool__(self) -> bool:
        return bool(self.owners)


def comparable(replicated: Any) -> Any:
    """A ``replicated=`` declaration in a form compared with ``==`` (lists and mappings of lists)."""
    if isinstance(replicated, Mapping):
        return {k: tuple(v) if isinstance(v, (list, tuple, range)) else v for k, v in replicated.items()}
    return tuple(replicated) if isinstance(replicated, (list, tuple)) else replicated


def declared(names: Sequence[str], sizes: Mapping[int, int], replicated: Any, rank: int, world_size: int
             ) -> Sharing:
    """The sharing a user declared for a state of leaves ``names`` (``sizes``: bytes of each array leaf,
    by leaf index): ``replicated`` is a list of keys whose leaves every rank of the job holds
    identically, or ``{key: [ranks holding it identically]}``. A key names a leaf or a nested mapping
    (``"model"``, ``"optim/state"``). Owners are spread over each group by bytes, the same on every rank
    given the same leaves."""
    if isinstance(replicated, Mapping):
        spec = {k: v for k, v in replicated.items()}
    elif isinstance(replicated, (str, bytes)) or not isinstance(replicated, Iterable):
        raise ArgumentError(f"replicated must be a list of keys or {{key: [ranks]}}, got {_args.shown(replicated)}")
    else:
        spec = {k: None for k in replicated}
    groups: dict[tuple[int, ...], int] = {}
    members: dict[int, list[int]] = {}  # leaf index -> group index
    for key, ranks in spec.items():
        if not isinstance(key, str) or not key:
            raise ArgumentError(f"replicated keys must be non-empty str, got {key!r}")
        group = tuple(range(world_size)) if ranks is None else _group(key, ranks, rank, world_size)
        hit = [i for i, n in enumerate(names) if i in sizes and (n == key or n.startswith(key + "/"))]
        if not hit:
            raise ArgumentError(f"replicated key {key!r} names no array in the state; the keys are e.g. "
                                f"{sorted(names)[:5]}")
        gi = groups.setdefault(group, len(groups))
        for i in hit:
            if members.setdefault(i, [gi])[0] != gi:
                raise ArgumentError(f"{names[i]!r} is declared replicated over two different sets of ranks")
    owners: dict[str, tuple[int, int]] = {}
    order = sorted(groups.items(), key=lambda kv: kv[1])
    for group, gi in order:
        if len(group) < 2:
            continue
        load = {r: 0 for r in group}
        for i in sorted((i for i, g in members.items() if g[0] == gi), key=lambda i: names[i]):
            o = min(group, key=lambda r: (load[r], r))
            load[o] += sizes[i]
            owners[names[i]] = (o, gi)
    return Sharing(tuple(g for g, _ in order), owners)


def _group(key: str, ranks: Any, rank: int, world_size: int) -> tuple[int, ...]:
    if isinstance(ranks, (str, bytes)) or not isinstance(ranks, Iterable):
        raise ArgumentError(f"replicated[{key!r}] must be a list of ranks, got {_args.shown(ranks)}")
    group = tuple(sorted({int(r) for r in ranks}))
    if not group or group[0] < 0 or group[-1] >= world_size or rank not in group:
        raise ArgumentError(f"replicated[{key!r}] = {list(ranks)[:8]} must be ranks of the job (0 to "
                            f"{world_size - 1}) including this rank ({rank})")
    return group


class _Packer:
    """Places entries in shard files of about ``file_size`` bytes, 64-byte aligned, never across files."""

    def __init__(self, rank: int, file_size: int) -> None:
        self.rank, self.file_size = rank, file_size
        self.files: dict[str, int] = {}
        self.cur: str | None = None
        self.used = 0

    def new_file(self) -> str:
        self.cur, self.used = shard_filename(self.rank, len(self.files)), 0
        self.files[self.cur] = 0
        return self.cur

    def add(self, n: int) -> tuple[str, int]:
        if self.cur is None or (self.used > 0 and self.used + n > self.file_size):
            self.new_file()
        assert self.cur is not None
        at = self.used
        self.files[self.cur] = at + n
        self.used = align(at + n)
        return self.cur, at

    def bundle(self, sizes: Sequence[int]) -> tuple[list[tuple[str, int]], list[list[Any]]]:
        """Places a bundle so that its entries' offsets relative to its parts are the same on every rank:
        one range when it fits a file (starting a new file if it does not fit this one), else its own
        files packed from offset 0. Returns each entry's ``(file, offset)`` and the parts."""
        rel, end = [], 0
        for n in sizes:
            rel.append(align(end))
            end = rel[-1] + n
        if end <= self.file_size:  # placed as one entry of its whole length
            f, start = self.add(end)
            return [(f, start + r) for r in rel], [[f, start, start + end]]
        self.new_file()
        where = []
        parts: dict[str, list[int]] = {}
        for n in sizes:
            f, at = self.add(n)
            where.append((f, at))
            p = parts.setdefault(f, [at, at + n])
            p[1] = at + n
        self.cur = None  # the next bundle starts in a new file too
        return where, [[f, a, b] for f, (a, b) in parts.items()]


def place(names: Sequence[str], sizes: Mapping[int, int], arrays: Sequence[int], sharing: Sharing | None,
          rank: int, file_size: int) -> tuple[list[int], list[tuple[str, int]], dict[str, int],
                                              list[dict[str, Any]], list[list[int]], list[list[int]]]:
    """Where each array leaf goes. Returns the array leaves' indices in placement order, their ``(file,
    offset)``, the files' lengths, the bundles and the groups (as the manifest stores them), and the leaf
    indices of each bundle, in order."""
    pk = _Packer(rank, file_size)
    owners = sharing.owners if sharing else {}
    own = [i for i in arrays if names[i] not in owners]
    order, where = list(own), [pk.add(sizes[i]) for i in own]
    if not owners:
        return order, where, pk.files, [], [], []
    by: dict[tuple[int, int], list[int]] = {}
    for i in arrays:
        o = owners.get(names[i])
        if o is not None:
            by.setdefault(o, []).append(i)
    used_groups = sorted({g for _, g in by})
    gmap = {g: k for k, g in enumerate(used_groups)}
    assert sharing is not None
    groups = [list(sharing.groups[g]) for g in used_groups]
    bundles, members = [], []
    for mine in (True, False):  # the bundles this rank owns, then the others', each kind in files of its own
        keys = sorted(k for k in by if (k[0] == rank) == mine)
        if keys:
            pk.cur = None
        for key in keys:
            idx = sorted(by[key], key=lambda i: names[i])
            w, parts = pk.bundle([sizes[i] for i in idx])
            order += idx
            where += w
            bundles.append({"owner": key[0], "group": gmap[key[1]], "parts": parts})
            members.append(idx)
    return order, where, pk.files, bundles, groups, members


def by_bundle(entries: Sequence[Entry], bundles: Sequence[Mapping[str, Any]]) -> list[list[Entry]]:
    """The array entries of each bundle, in their order within it (the same on every rank of its group)."""
    spans: dict[str, list[tuple[int, int, int]]] = {}
    for k, b in enumerate(bundles):
        for p in b["parts"]:
            spans.setdefault(p[0], []).append((p[1], p[2], k))
    for v in spans.values():
        v.sort()
    out: list[list[Entry]] = [[] for _ in bundles]
    for e in entries:
        v = spans.get(e.file, []) if e.kind == "array" else []
        if v:
            j = bisect.bisect_right(v, (e.offset, float("inf"), 0)) - 1
            if j >= 0 and v[j][0] <= e.offset and e.offset + e.length <= v[j][1]:
                out[v[j][2]].append(e)
    order = [{p[0]: i for i, p in enumerate(b["parts"])} for b in bundles]
    for k, es in enumerate(out):
        es.sort(key=lambda e: (order[k][e.file], e.offset))
    return out


def digests(members: Sequence[Sequence[Entry]], bundles: Sequence[Mapping[str, Any]],
            groups: Sequence[Sequence[int]]) -> list[list[int]]:
    """``[[group key, digest]]``: for each group, a checksum of the names and block checksums of every
    entry this rank holds for it (``members``: each bundle's entries). Every rank of a group must have
    the same digest."""
    per: dict[int, list[Any]] = {}
    for b, es in zip(bundles, members):
        per.setdefault(b["group"], []).append([b["owner"], [[e.name, e.crc32c] for e in es]])
    return [[group_key(groups[g]), crc32c(json.dumps(sorted(v)).encode())] for g, v in sorted(per.items())]


def group_key(group: Sequence[int]) -> int:
    return crc32c(json.dumps(list(group)).encode())


def check_digests(group: "Group", step: int, held: Sequence[Sequence[int]], groups: Sequence[Sequence[int]]
                  ) -> None:
    """Raise on every rank when two ranks of a group hold different values of entries they share (collective;
    ``held``: this rank's :func:`digests`, ``groups``: its manifest's).

    Each rank sends its digest of each of its groups to the group's next rank and compares the one the
    group's previous rank sent, so a group's ranks agree pair by pair along a chain: what a rank sends and
    the ranks it talks to are a few per group it is in, whatever the job's size. One all-reduce then
    names the first pair that differs, on every rank."""
    import numpy as np

    mine = {key: d for key, d in held}
    sends: list[tuple[int, np.ndarray]] = []
    recvs: list[tuple[int, np.ndarray, int, int]] = []  # (from rank, buffer, group key, this rank's digest)
    for g in sorted(groups, key=sorted):  # the same order on every rank: two ranks' messages pair up in it
        members, key = sorted(g), group_key(g)
        if group.rank not in members or key not in mine:
            continue
        i = members.index(group.rank)
        if i + 1 < len(members):
            sends.append((members[i + 1], np.array([mine[key]], dtype=np.int64).view(np.uint8)))
        if i > 0:
            recvs.append((members[i - 1], np.zeros(8, dtype=np.uint8), key, mine[key]))
    if group.world_size > 1:
        assert not isinstance(group, _SingleProcess)
        group.exchange(sends, [(r, buf) for r, buf, _, _ in recvs])
    n = group.world_size
    pairs = [prev * n + group.rank for prev, buf, _, d in recvs if int(buf.view(np.int64)[0]) != d]
    worst = group.all_reduce([min(pairs, default=n * n)], "min")[0]
    if worst < n * n:
        a, b = divmod(worst, n)
        raise TierfsError(f"step {step}: ranks {a} and {b} hold different values of entries declared identical on "
                          "both (data-parallel replicas that diverged, or a wrong replicated= declaration); not "
                          "committed")
