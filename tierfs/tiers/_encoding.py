"""The erasure-coded tier's two exchanges within a group: computing parity (a save) and rebuilding a lost
member's shard (a restore). See :mod:`tierfs.tiers.erasure` for what they keep and why.

Both move pieces block by block in rounds of :meth:`~tierfs.ranks.groups.TorchGroup.exchange`, each block
followed by a tail (:func:`~tierfs.tiers._stripes.seal`) its receiver checks; a save sends each block of
its own payload straight from the RAM tier's mapped file, its tail in a message of its own. A member that
cannot read a piece still sends its blocks, marked bad, so every round keeps its shape and no rank waits
for bytes.
"""

from __future__ import annotations

import functools
import json
import logging
from typing import TYPE_CHECKING, Any, Mapping, Protocol

import numpy as np

from ..ranks import framed
from ..util.stages import stage
from ..errors import ChecksumError, FormatError, TierfsError
from ..format import MARKER, crc32c, manifest_filename
from . import _erasure
from ._stripes import (PARITY, STRIPES, TAIL, Payload, Rebuilt, Stripes, WorkBuffers, check_block, pack, seal,
                       unpack)
from .base import Fetched, Pace, ReceiveInto

if TYPE_CHECKING:
    from .memory import MemoryTier

log = logging.getLogger("tierfs")


class ErasureCodedTier(Protocol):
    """What the two exchanges use of an :class:`~tierfs.tiers.erasure.ErasureCodedTier` (which calls
    them): its place in its group, its code and block size, and what it keeps."""

    name: str
    rank: int
    parity: int
    block: int  # bytes of a piece moved and checked at a time

    @property
    def local(self) -> MemoryTier: ...

    def members(self, rank: int | None = None) -> list[int]: ...

    def own_payload(self, step: int) -> Payload: ...

    def kept(self, step: int) -> tuple[Stripes, dict[str, Any], np.ndarray]: ...

    @property
    def buffers(self) -> WorkBuffers: ...


@functools.lru_cache(maxsize=8)
def zeros(n: int) -> int:
    """The crc32c of ``n`` zero bytes."""
    return crc32c(np.zeros(n, np.uint8))


def xor_crc(sums: list[int], n: int) -> int:
    """The crc32c of the XOR of ``n``-byte blocks whose crc32c are ``sums``, without their bytes: crc32c is
    affine over XOR (``crc(a ^ b) = crc(a) ^ crc(b) ^ crc(zeros)``)."""
    out = zeros(n) if len(sums) % 2 == 0 else 0
    for x in sums:
        out ^= x
    return out


#: bytes of a swap's first message to each rank: the length and, when they fit (most heads do), the bytes
FIRST = 16 << 10


def swap(g: Any, sends: Mapping[int, bytes], sources: list[int]) -> dict[int, bytes]:
    """Byte strings to other ranks (``sends``: ``{rank: bytes}``) and from ``sources``: a first message of
    :data:`FIRST` bytes each, then the rest of longer ones, between the pairs that have some, in a second.
    Both over the group's streams where it has them (less than half of gloo's CPU and time per small round,
    ``benchmarks/bench_streams.py``)."""
    room = FIRST - 8
    firsts = [(r, np.zeros(FIRST, np.uint8)) for r in sources]
    g.exchange([(r, framed(b, FIRST)) for r, b in sends.items()], firsts, bulk=True)
    lens = {r: int(f[:8].view(np.int64)[0]) for r, f in firsts}
    rest_in = [(r, np.empty(lens[r] - room, np.uint8)) for r, _ in firsts if lens[r] > room]
    rest_out = [(r, np.frombuffer(b, np.uint8)[room:].copy()) for r, b in sends.items() if len(b) > room]
    if rest_in or rest_out:
        g.exchange(rest_out, rest_in, bulk=True)
    rest = dict(rest_in)
    return {r: f[8:8 + min(lens[r], room)].tobytes() + (rest[r].tobytes() if r in rest else b"") for r, f in firsts}


def encode_group(tier: ErasureCodedTier, g: Any, step: int, marker: bytes, manifest: bytes, files: Mapping[str, Any],
                 only: set[int] | None, pace: Pace | None, error: str | None) -> tuple[dict[int, str | None], bool]:
    """This rank's part of computing its group's parity of ``step``; returns ``({member: error}, whether this
    rank wrote pieces)``. ``only``: the ranks that compute theirs (None: all)."""
    members = tier.members()
    if only is not None and not only & set(members):
        return {}, False  # a re-seed of another group
    me, p = members.index(tier.rank), tier.parity
    payload = None
    if error is None:
        try:
            payload = Payload(files)
        except (ValueError, TypeError) as e:
            error = f"{type(e).__name__}: {e}"
    head = pack({"error": error, "length": payload.length if payload is not None else 0}, manifest)
    others = [r for r in members if r != tier.rank]
    heads = {tier.rank: head, **swap(g, {r: head for r in others}, others)}
    records = {r: unpack(heads[r]) for r in members}
    bad = {r: rec["error"] for r, (rec, _) in records.items() if rec.get("error")}
    if bad:
        r, why = next(iter(bad.items()))
        return {r: f"rank {r} of this group could not read its shard: {why}"}, False
    stripes = Stripes(tuple(members), p, tuple(int(records[r][0]["length"]) for r in members), tier.block)
    receivers = set(range(stripes.m)) if only is None else {members.index(t) for t in only if t in members}
    c, blocks = stripes.chunk, stripes.blocks()
    kept = stripes.kept(me) if me in receivers else []
    mine = stripes.stripes_of(me)
    width = max((b - a for a, b in blocks), default=0) + TAIL
    keys = [(j, x) for j, _ in kept for x in stripes.data_members(j)]
    spare = [np.empty(width, np.uint8) for _ in range(p)]  # the parity pieces others keep, computed alongside
    errors: dict[int, str | None] = {}
    parity = np.empty(0, np.uint8)
    if kept:
        if step in tier.local.list_steps():  # a re-seed replaces what this rank kept
            tier.local.delete_step(step)
        parity = tier.local.buffers(step, {PARITY: len(kept) * c})[PARITY]
    crcs: list[list[int]] = [[] for _ in kept]
    def sent(x: int, j: int, a: int) -> bool:  # blocks wholly past a payload's end are zeros: not sent
        return stripes.stripes_of(x).index(j) * c + a < stripes.lengths[x]

    with stage("replication", step, tier.name), tier.buffers.lend(len(mine) + len(keys), width) as bufs:
        sbuf, rbuf = bufs[:len(mine)], dict(zip(keys, bufs[len(mine):]))  # each block overwrites them whole
        for a, b in blocks:
            n = b - a
            sends = []
            for k, j in enumerate(mine):
                if not sent(me, j, a):
                    continue
                assert payload is not None
                # the block straight from the mapped file where one file holds it (else copied), its tail
                # (crc32c, good) after it in a message of its own
                data = payload.view(k * c + a, n, sbuf[k])
                tail = sbuf[k][-TAIL:]
                tail[:] = 0
                tail[:4].view(np.uint32)[0], tail[4] = crc32c(data), 1
                sends += [(members[h], x) for h in stripes.holders(j) if h in receivers for x in (data, tail)]
            recvs = [(members[x], part) for j, _ in kept for x in stripes.data_members(j) if sent(x, j, a)
                     for part in (rbuf[j, x][:n], rbuf[j, x][n:n + TAIL])]
            g.exchange(sends, recvs, pace=pace)
            for q, (j, t) in enumerate(kept):
                if errors.get(tier.rank):
                    break
                try:
                    pieces, sums = [], []
                    for x in stripes.data_members(j):
                        buf = rbuf[j, x]
                        what = f"step {step}: bytes {a}-{b} of rank {members[x]}'s chunk for stripe {j}"
                        if not sent(x, j, a):
                            buf[:n] = 0
                            sums.append(zeros(n))
                        elif p == 1:  # checked through the parity's checksum below
                            check_block(buf[:n], buf[n:n + TAIL], what, crc=False)
                            sums.append(int(buf[n:n + 4].view(np.uint32)[0]))
                        else:
                            check_block(buf[:n], buf[n:n + TAIL], what)
                        pieces.append(buf[:n])
                    dst = parity[q * c + a:q * c + b]
                    _erasure.encode(pieces, p, out=[dst if u == t else spare[u][:n] for u in range(p)])
                    crcs[q].append(crc32c(dst))
                    if p == 1 and crcs[q][-1] != xor_crc(sums, n):  # one pass checks every chunk it came from
                        raise ChecksumError(f"step {step}: a chunk for stripe {j} (bytes {a}-{b}, from ranks "
                                            f"{[members[x] for x in stripes.data_members(j)]}) was damaged on its way")
                except (TierfsError, ValueError) as e:
                    errors[tier.rank] = f"{type(e).__name__}: {e}"
    if not kept or errors.get(tier.rank):
        if kept:
            tier.local.discard(step)
        return errors, False
    try:
        tier.local.persist(step)
        tier.local.write_file(step, STRIPES, json.dumps({"stripes": stripes.to_json(), "crcs": crcs}).encode())
        for r in members:
            tier.local.write_file(step, manifest_filename(r), records[r][1][0])
    except (TierfsError, OSError) as e:
        errors[tier.rank] = f"{type(e).__name__}: {e}"
    return errors, True


def rebuild_group(tier: ErasureCodedTier, g: Any, step: int, assign: Mapping[int, int],
                  landing: ReceiveInto | None = None) -> Fetched | str | None:
    """This rank's part of rebuilding its group's members in ``assign``: the rebuilt shard on such a
    member (or why it failed), None on the others. On a rebuilt member, ``landing(manifest)`` names arrays
    that entries land in straight (as for :meth:`~tierfs.tiers.base.Replicator.fetch`)."""
    members = tier.members()
    lost = sorted(q for q in assign if q in members)
    if not lost:
        return None
    me, p = tier.rank, tier.parity
    if len(lost) > p:
        return (f"ranks {lost} of group {members} lost their shards: more than parity={p} of a group cannot be "
                "rebuilt") if me in lost else None
    sender = assign[lost[0]]  # sends the stripes record, the lost members' manifests and its marker
    others = [r for r in members if r != sender]
    head = b""
    if me == sender:
        try:
            stripes, _, _ = tier.kept(step)
            blobs = [bytes(tier.local.read_file(step, manifest_filename(q))) for q in lost]
            head = pack({"stripes": stripes.to_json()}, bytes(tier.local.read_file(step, MARKER)), *blobs)
        except (TierfsError, OSError, ValueError) as e:
            head = pack({"error": f"rank {me}: {type(e).__name__}: {e}"})
    got = swap(g, {r: head for r in others} if me == sender else {}, [] if me == sender else [sender])
    rec, blobs = unpack(head if me == sender else got[sender])
    if rec.get("error") or tuple(rec.get("stripes", {}).get("members", ())) != tuple(members):
        return (rec.get("error") or f"rank {sender} keeps stripes of another group") if me in lost else None
    stripes = Stripes.from_json(rec["stripes"])
    c, blocks, d = stripes.chunk, stripes.blocks(), stripes.d
    li = [members.index(q) for q in lost]
    # where a lost member's bytes go: its files, and the arrays the restore lands entries in
    dest = _destination(stripes, blobs, lost.index(me), members.index(me), landing) if me in lost else None
    if p == 1:
        got_back = _rebuild_xor(tier, g, step, stripes, members.index(me), li[0], dest)
        return _shard(got_back, blobs, lost.index(me)) if me in lost else None
    moves = []  # (sender index, receiver index, stripe, position among the stripe's pieces)
    for lx in li:
        for j in stripes.stripes_of(lx):
            data = [(pos, x) for pos, x in enumerate(stripes.data_members(j)) if x not in li]
            par = [(d + t, h) for t, h in enumerate(stripes.holders(j)) if h not in li]
            moves += [(x, lx, j, pos) for pos, x in (data + par)[:d]]
    i = members.index(me)
    width = max((b - a for a, b in blocks), default=0) + TAIL
    outs = [(mv, np.zeros(width, np.uint8)) for mv in moves if mv[0] == i]
    ins = [(mv, np.zeros(width, np.uint8)) for mv in moves if mv[1] == i]
    payload, own, kept, parity, why = None, None, None, None, None
    try:
        if any(pos < d for (_, _, _, pos), _ in outs):
            own = tier.own_payload(step)
        if any(pos >= d for (_, _, _, pos), _ in outs):
            mine, record, parity = tier.kept(step)
            if mine != stripes:
                raise FormatError(f"rank {me} keeps other stripes of step {step}")
            kept = {jt: (q, record["crcs"][q]) for q, jt in enumerate(stripes.kept(i))}
    except (TierfsError, OSError, ValueError, KeyError) as e:
        why = f"rank {me}: {type(e).__name__}: {e}"
    payload, failed = (dest, None) if isinstance(dest, Rebuilt) else (None, dest)
    spare = np.empty(width if payload is not None else 0, np.uint8)  # a block across its files or entries
    with stage("fetch", step, tier.name):
        for bi, (a, b) in enumerate(blocks):
            n = b - a
            for (x, lx, j, pos), buf in outs:
                ok = why is None
                if ok and pos < d:
                    assert own is not None
                    own.read(stripes.stripes_of(x).index(j) * c + a, buf[:n])
                elif ok:
                    assert kept is not None and parity is not None
                    q, sums = kept[j, pos - d]
                    buf[:n] = parity[q * c + a:q * c + b]
                    ok = crc32c(buf[:n]) == sums[bi]  # a damaged parity block is not sent as good
                seal(buf, n, ok)
            g.exchange([(members[lx], buf[:n + TAIL]) for (_, lx, _, _), buf in outs],
                       [(members[x], buf[:n + TAIL]) for (x, _, _, _), buf in ins], bulk=True)
            if payload is None or failed:
                continue
            try:
                for j in stripes.stripes_of(i):
                    pieces = {}
                    for (x, _, jj, pos), buf in ins:
                        if jj == j:
                            check_block(buf[:n], buf[n:n + TAIL], f"step {step}: bytes {a}-{b} of stripe {j} from "
                                        f"rank {members[x]}")
                            pieces[pos] = buf[:n]
                    k, want = stripes.stripes_of(i).index(j), stripes.data_members(j).index(i)
                    into, direct = payload.into(k * c + a, k * c + b, spare)
                    _erasure.decode(pieces, d, p, [want], out={want: into})
                    if not direct:
                        payload.settle(k * c + a, k * c + b, into)
            except (TierfsError, ValueError) as e:
                failed = f"{type(e).__name__}: {e}"
    return _shard(failed if failed else payload, blobs, lost.index(me)) if i in li else None


def _destination(stripes: Stripes, blobs: list[bytes], k: int, i: int, landing: ReceiveInto | None
                 ) -> Rebuilt | str:
    """Where the ``k``-th lost member (index ``i``) takes its rebuilt payload in, or why not."""
    try:
        return Rebuilt.of(blobs[1 + k], stripes.lengths[i], landing)
    except (TierfsError, ValueError) as e:
        return f"{type(e).__name__}: {e}"


def _shard(got: Rebuilt | str | None, blobs: list[bytes], k: int) -> Fetched | str | None:
    """The ``k``-th lost member's rebuilt shard, every entry verified where it landed against the checksums it
    was saved with (its manifest is the one the landing saw: the restore knows its arrays by it); or why not."""
    if got is None or isinstance(got, str):
        return got
    try:
        got.verify()
    except (TierfsError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    return got.manifest, blobs[1 + k], blobs[0], got.files


def _rebuild_xor(tier: ErasureCodedTier, g: Any, step: int, stripes: Stripes, i: int, lost: int,
                 dest: Rebuilt | str | None) -> Rebuilt | str | None:
    """``parity=1``: each stripe's parity holder XORs the survivors' chunks into its parity block and sends
    the lost member only the result, so that member takes in its shard's bytes once (not ``data`` times).

    The bytes move as they are: survivors send views of their mapped files, the results land where the
    lost member's ``dest`` puts them (its files, or the arrays its restore lands entries in), and one
    exchange per block carries that block's chunks and the previous block's results. A holder checks its
    parity block against the crc32c it kept; every other byte is checked once, end to end, when the
    rebuilt shard is verified against its manifest (:func:`_shard`). Whether a survivor could read its
    pieces travels beside them (one flag per pair and block), so a rebuild from unreadable or damaged
    pieces says where. Returns the lost member's ``dest`` filled (or why not) on it, None elsewhere."""
    members, c, blocks = stripes.members, stripes.chunk, stripes.blocks()
    mine = stripes.stripes_of(lost)  # the stripes the lost member gave a chunk to, in chunk order
    combiner = {j: stripes.holders(j)[0] for j in mine}
    feeds = [(x, j) for j in mine for x in stripes.data_members(j) if x != lost]  # (survivor, stripe)
    width = max((b - a for a, b in blocks), default=0)
    outs = [(x, j) for x, j in feeds if x == i]
    ins = {(x, j): np.empty(width, np.uint8) for x, j in feeds if combiner[j] == i}
    comb = {j: np.empty(width, np.uint8) for j in mine if combiner[j] == i}
    spare = {j: np.empty(width, np.uint8) for _, j in outs}  # a block across files or past the payload
    flags_out = {j: np.zeros(8, np.uint8) for j in [j for _, j in outs] + list(comb)}
    flags_in = {(x, j): np.zeros(8, np.uint8) for x, j in ins}
    back = {j: np.zeros(8, np.uint8) for j in mine} if i == lost else {}
    own, parity, sums, why = None, None, {}, None
    try:
        if outs:
            own = tier.own_payload(step)
        if comb:
            kept, record, parity = tier.kept(step)
            if kept != stripes:
                raise FormatError(f"rank {members[i]} keeps other stripes of step {step}")
            sums = {jt[0]: (q, record["crcs"][q]) for q, jt in enumerate(stripes.kept(i))}
    except (TierfsError, OSError, ValueError, KeyError) as e:
        why = f"rank {members[i]}: {type(e).__name__}: {e}"
    land = dest if isinstance(dest, Rebuilt) else None
    # on the lost member: a block across its files or entries (or of a shard it cannot take) lands here first
    scratch = {j: np.empty(width, np.uint8) for j in mine} if i == lost else {}
    bad: list[str] = []  # on the lost member: what its combiners could not read
    with stage("fetch", step, tier.name):
        done: tuple[int, int] | None = None  # the block whose results go with the next exchange
        for bi, ab in enumerate([*blocks, None]):
            sends, recvs, apart = [], [], []
            if done is not None:  # the previous block's results, combiner -> lost member, with their flags
                pa, pb = done
                for j, buf in comb.items():
                    sends += [(members[lost], buf[:pb - pa]), (members[lost], flags_out[j])]
                for k, j in enumerate(mine) if i == lost else ():
                    where, direct = land.into(k * c + pa, k * c + pb, scratch[j]) if land is not None else \
                        (scratch[j][:pb - pa], True)
                    if not direct:
                        apart.append((k * c + pa, k * c + pb, where))
                    recvs += [(members[combiner[j]], where), (members[combiner[j]], back[j])]
            if ab is not None:  # this block's chunks, survivor -> combiner
                a, b = ab
                for x, j in outs:
                    flags_out[j][0] = why is None
                    view = spare[j][:b - a] if why is not None or own is None else \
                        own.view(stripes.stripes_of(x).index(j) * c + a, b - a, spare[j])
                    sends += [(members[combiner[j]], flags_out[j]), (members[combiner[j]], view)]
                recvs += [r for (x, j), buf in ins.items()
                          for r in ((members[x], flags_in[x, j]), (members[x], buf[:b - a]))]
            g.exchange(sends, recvs, bulk=True)
            for lo, hi, where in apart:
                assert land is not None
                land.settle(lo, hi, where)
            if i == lost and done is not None:
                bad += [f"bytes {done[0]}-{done[1]} of stripe {j} (rank {members[combiner[j]]} could not read "
                        "its pieces or was sent unreadable ones)" for j in mine if back[j][0] != 1]
            done = ab
            if ab is None:
                break
            a, b = ab
            n = b - a
            for j, buf in comb.items():  # this holder's parity block XORed with the survivors' chunks
                ok = why is None and all(flags_in[x, jj][0] == 1 for x, jj in ins if jj == j)
                if ok:
                    assert parity is not None
                    q, crcs = sums[j]
                    block = parity[q * c + a:q * c + b]
                    if crc32c(block) != crcs[bi]:
                        log.warning("%s step %d: rank %d's parity of stripe %d (bytes %d-%d) is damaged",
                                    tier.name, step, members[i], j, a, b)
                        ok = False
                    else:
                        acc = buf[:n].view(np.uint64)  # (blocks are whole multiples of 8 bytes)
                        feeds_j = [got[:n].view(np.uint64) for (x, jj), got in ins.items() if jj == j]
                        np.bitwise_xor(block.view(np.uint64), feeds_j[0], out=acc)
                        for f in feeds_j[1:]:
                            np.bitwise_xor(acc, f, out=acc)
                flags_out[j][0] = ok
    if bad:
        return f"ChecksumError: step {step}: {bad[0]}" + (f" and {len(bad) - 1} more" if len(bad) > 1 else "")
    return dest
