"""Completing shards that lack bundles: ranks send each other the entries they share.

A shared tier stores a bundle (entries several ranks hold identically, :mod:`..dataparallel`) only in its
owner's shard, and a peer keeps a replica only of what no other node holds. After a restore's first
round (own tiers, peers, the tiers after them) a rank's shard may therefore lack bundles, which
:func:`complete` moves between ranks (collective): each bundle from its owner when the owner holds its own
bundles, else from a rank of its group whose shard is whole, every block checked as it lands. One
all-gather of one number per rank (what each rank holds) lets every rank work out, by the same rule, who
sends which bundle to whom: no per-entry lists cross the job. Restoring from a shared tier thus reads each
distinct byte from it once per job and sends it on to the ranks that hold it too.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Mapping, Sequence

import numpy as np

from ...format import blockio as _blocks
from ...util import readable as _readable
from ...format import Entry, Manifest
from ...tiers import _wire
from ...tiers.base import ReceiveInto
from ..dataparallel import by_bundle, group_key

log = logging.getLogger("tierfs")

#: what a rank's shard holds after the first round: nothing, only its own entries (a peer's replica), its
#: own entries and the bundles it owns (a shared tier), or every file
NONE, UNIQUE, OWNED, WHOLE = 0, 1, 2, 3

#: a bundle in a transfer: ``((owner, group key), its parts' bytes, its entries, its parts [file, start, end])``
_Item = tuple[tuple[int, int], list[np.ndarray], list[Entry], list[list[Any]]]


def holds(manifest: Manifest | None, files: Mapping[str, Any]) -> int:
    """What a shard holds (:data:`WHOLE`, :data:`OWNED`, :data:`UNIQUE` or :data:`NONE`)."""
    if manifest is None:
        return NONE
    if all(n in files for n in manifest.files):
        return WHOLE
    if all(n in files for n in manifest.held_files(False)):
        return OWNED
    return UNIQUE if all(n in files for n in manifest.replica_files) else NONE


def _has(status: Sequence[int], owner: int, r: int) -> bool:
    return status[r] == WHOLE or (status[r] == OWNED and owner == r)


def source(status: Sequence[int], owner: int, group: Sequence[int], q: int) -> int | None:
    """The rank that sends rank ``q`` the bundle of ``owner`` and ``group`` (the same on every rank): the
    owner when it holds its bundles, else a rank of the group with a whole shard (spread by ``q``)."""
    if owner != q and _has(status, owner, owner):
        return owner
    whole = [h for h in group if h != q and status[h] == WHOLE]
    return whole[(q + owner) % len(whole)] if whole else None


def _key(manifest: Manifest, b: Mapping[str, Any]) -> tuple[int, int]:
    return b["owner"], group_key(manifest.groups[b["group"]])


def complete(g: Any, step: int, manifest: Manifest | None, files: dict[str, Any], status: Sequence[int],
             pace: Any = None, wire: _wire.Wire = _wire.Wire(), landing: ReceiveInto | None = None) -> str | None:
    """This rank's part of completing every rank's shard (collective; ``status``: every rank's
    :func:`holds`, the same on every rank). Missing files of this rank's shard are allocated in ``files``
    and filled, except the entries ``landing(manifest)`` names: they land straight in its arrays (and
    their bytes in ``files`` are undefined). Returns why this rank's shard is still incomplete, or None."""
    me = g.rank
    needy = {r for r, s in enumerate(status) if s in (UNIQUE, OWNED)}
    out: dict[int, list[_Item]] = {}
    want: dict[int, list[_Item]] = {}
    missing = None
    if manifest is not None:
        raw = {n: _blocks.as_u8(f) for n, f in files.items()}
        members = by_bundle(manifest.entries, manifest.bundles)
        for b, ents in zip(manifest.bundles, members):
            owner, group = b["owner"], manifest.groups[b["group"]]
            key = _key(manifest, b)
            if _has(status, owner, me):
                if needy and (owner == me or not _has(status, owner, owner)):  # this rank may be the source
                    for q in group:
                        if q in needy and not _has(status, owner, q) and source(status, owner, group, q) == me:
                            out.setdefault(q, []).append((key, [raw[f][a:z] for f, a, z in b["parts"]],
                                                          ents, b["parts"]))
                continue
            src = source(status, owner, group, me)
            if src is None:
                missing = f"no rank holding the entries rank {owner} stores for ranks {_short(group)}"
                continue
            for f, _, _ in b["parts"]:
                if f not in files:
                    files[f] = raw[f] = np.empty(manifest.files[f], dtype=np.uint8)
            want.setdefault(src, []).append((key, [raw[f][a:z] for f, a, z in b["parts"]],
                                             ents, b["parts"]))
    assert manifest is not None or not (out or want)
    sends: list[_wire.Send] = []
    for q, items in sorted(out.items()):
        items.sort(key=lambda it: it[0])
        head = {"step": step, "bundles": [[k[0], k[1], [int(p.size) for p in parts]] for k, parts, _, _ in items]}
        m, bufs = _carried(step, q, manifest, items)  # type: ignore[arg-type]
        sends.append((q, json.dumps(head).encode(), bufs, m))
    for wanted in want.values():
        wanted.sort(key=lambda it: it[0])
    views = landing(manifest) if landing is not None and want and manifest is not None else {}

    def accept(src: int, h: dict[str, Any]) -> tuple[Manifest, dict[str, np.ndarray], _wire.Direct]:
        items = want[src]
        if h.get("step") != step or h.get("bundles") != [[k[0], k[1], [int(p.size) for p in bufs]]
                                                         for k, bufs, _, _ in items]:
            raise ValueError(f"rank {src} offered other shared entries than rank {me} holds (different structures?)")
        m, bufs = _carried(step, me, manifest, items)  # type: ignore[arg-type]
        return m, bufs, _wire.direct(m, views, bufs)

    errors = _wire.transfer(g, sends, sorted(want), accept, pace, wire, land=True, parse=json.loads)
    bad = [f"from rank {s}: {why}" for s, why in errors.items() if why]
    if bad:
        return "; ".join(bad)
    if want:
        got = sum(int(v.size) for items in want.values() for _, views, _, _ in items for v in views)
        log.info("step %d: received %s of shared entries from ranks %s", step, _readable.Bytes(got), sorted(want))
    return missing


def _carried(step: int, rank: int, manifest: Manifest, items: Sequence[_Item]
             ) -> tuple[Manifest, dict[str, np.ndarray]]:
    """Bundles as one transfer carries them (sender and receiver alike): each part a file of its own
    (``"0"``, ``"1"``, ...), its entries' offsets relative to it."""
    bufs: dict[str, np.ndarray] = {}
    entries: list[Entry] = []
    for _, views, ents, parts in items:
        for view, (f, a, z) in zip(views, parts):
            n = str(len(bufs))
            bufs[n] = view
            entries += [Entry(e.name, "array", e.lib, e.dtype, e.shape, n, e.offset - a, e.length, e.crc32c)
                        for e in ents if e.file == f and a <= e.offset and e.offset + e.length <= z]
    return Manifest(step, rank, manifest.world_size, entries, {k: v.size for k, v in bufs.items()},
                    manifest.block_size), bufs


def _short(group: Sequence[int]) -> str:
    return str(list(group)) if len(group) <= 6 else f"[{group[0]}, {group[1]}, ..., {group[-1]}] ({len(group)})"
