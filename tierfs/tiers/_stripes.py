"""The erasure-coded tier's layout: which ranks form a group, and how a group's shards are cut into stripes.

**Groups.** Nodes in order of their number form groups of ``data + parity`` nodes; when the node count is
not a multiple of that, the last ``n mod (data + parity)`` groups take one node more each (their data
count is one more: the RAM a rank spends on parity is then less than ``parity/data`` of its shard), and a
job of fewer nodes is one group of all of them (it needs ``parity + 1`` nodes). The ranks with the same
local index on a group's nodes are a group of ranks: every member on a node of its own.

**Stripes.** In a group of ``m`` members, each member's *payload* (the bytes of its shard files that no
other node holds, in name order, zero-padded to the group's longest) is cut into ``d = m - parity`` chunks
of ``chunk`` bytes. There are ``m`` stripes; stripe ``j``'s parity pieces are kept by members ``j, j+1, ...,
j+parity-1`` (mod ``m``), and its ``d`` data pieces are one chunk of each other member, in member order. So
every member keeps ``parity`` pieces of ``chunk`` bytes: ``parity/d`` of a payload.

**Blocks.** Pieces move :data:`BLOCK` bytes at a time, each followed on the wire by a tail of :data:`TAIL`
bytes (:func:`seal`) that its receiver checks (:func:`check_block`). A member keeps its parity pieces of a
step in :data:`PARITY`, and beside them the stripes record in :data:`STRIPES`.
"""

from __future__ import annotations

import bisect
import contextlib
import json
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np

from ..errors import ChecksumError, FormatError, TierfsError
from ..format import Manifest, crc32c
from ..format import blockio as _blocks

#: bytes of a piece moved (and checksummed) at a time: the working buffers are a few of these per stripe
BLOCK = 4 << 20
#: bytes after every block on the wire: its crc32c (uint32), whether it is good (1), padding
TAIL = 8
#: what a member keeps of a step: its parity pieces, and the stripes record (with each parity block's crc32c)
PARITY, STRIPES = "parity.bin", "stripes.json"


def ec_groups(nodes: Sequence[int], data: int, parity: int) -> list[list[int]]:
    """The groups of ranks (each in rank order of its nodes), every rank in one; see the module docstring."""
    order = sorted(set(nodes))
    k = data + parity
    if len(order) < parity + 1:
        raise TierfsError(f"an erasure-coded tier with parity={parity} needs ranks on at least {parity + 1} nodes; "
                          f"this job has {len(order)} (set TIERFS_NODE_RANK per node, or run on more nodes)")
    if len(order) < k:
        node_groups = [order]
    else:
        full = len(order) // k
        node_groups = [order[i * k:(i + 1) * k] for i in range(full)]
        for x, node in enumerate(order[full * k:]):  # the remainder: one more node in each of the last groups
            node_groups[full - 1 - x].append(node)
    members = {n: [r for r, x in enumerate(nodes) if x == n] for n in order}
    out: list[list[int]] = []
    for ng in node_groups:
        for i in range(max(len(members[n]) for n in ng)):
            ranks = [members[n][i] for n in ng if i < len(members[n])]
            if len(ranks) < parity + 1:
                raise TierfsError(f"ranks {ranks} (local index {i} on nodes {ng}) are too few for parity={parity}: "
                                  "start the same number of processes on every node")
            out.append(ranks)
    return out


@dataclass(frozen=True)
class Stripes:
    """One step's stripes in one group (the same on every member): ``members`` (ranks), ``parity``, each
    member's payload ``lengths`` and the ``chunk`` size."""

    members: tuple[int, ...]
    parity: int
    lengths: tuple[int, ...]
    block: int = BLOCK

    @property
    def m(self) -> int:
        return len(self.members)

    @property
    def d(self) -> int:
        return self.m - self.parity

    @property
    def chunk(self) -> int:
        """Bytes per piece: the longest payload over ``d``, rounded up to 8."""
        per = -(-(max(self.lengths) if self.lengths else 0) // self.d)
        return -(-per // 8) * 8

    def blocks(self) -> list[tuple[int, int]]:
        """The ``(start, end)`` of each block of a piece."""
        c = self.chunk
        return [(a, min(a + self.block, c)) for a in range(0, c, self.block)]

    def holders(self, j: int) -> list[int]:
        """The members (indices) keeping stripe ``j``'s parity pieces, in piece order."""
        return [(j + t) % self.m for t in range(self.parity)]

    def data_members(self, j: int) -> list[int]:
        """The members (indices) whose chunks are stripe ``j``'s data pieces, in piece order."""
        held = set(self.holders(j))
        return [i for i in range(self.m) if i not in held]

    def stripes_of(self, i: int) -> list[int]:
        """The stripes member ``i`` gives a data piece to; its chunk ``k`` goes to the ``k``-th of them."""
        return [j for j in range(self.m) if i not in self.holders(j)]

    def kept(self, i: int) -> list[tuple[int, int]]:
        """The parity pieces member ``i`` keeps, ``(stripe, piece index among the parity)``, in file order."""
        return sorted((j, t) for j in range(self.m) for t, h in enumerate(self.holders(j)) if h == i)

    def to_json(self) -> dict[str, Any]:
        return {"members": list(self.members), "parity": self.parity, "lengths": list(self.lengths),
                "block": self.block}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "Stripes":
        try:
            s = cls(tuple(int(x) for x in d["members"]), int(d["parity"]), tuple(int(x) for x in d["lengths"]),
                    int(d["block"]))
        except (KeyError, TypeError, ValueError) as e:
            raise FormatError(f"malformed stripes record: {e}") from None
        if not (0 < s.parity < s.m and len(s.lengths) == s.m and s.block > 0 and s.block % 8 == 0
                and all(x >= 0 for x in s.lengths)):
            raise FormatError(f"malformed stripes record: {d}")
        return s


class Payload:
    """A member's payload: its files (name order) as one padded byte string, read piece by piece."""

    def __init__(self, files: Mapping[str, Any]) -> None:
        self.names = sorted(files)
        self.parts = [np.asarray(files[n]).reshape(-1).view(np.uint8) for n in self.names]
        self.starts = list(np.cumsum([0] + [p.size for p in self.parts]))
        self.length = int(self.starts[-1])

    def read(self, start: int, out: np.ndarray) -> np.ndarray:
        """Copy payload bytes ``start:start+len(out)`` into ``out`` (zeros past the end)."""
        end = start + out.size
        for p, s0 in zip(self.parts, self.starts):
            a, b = max(start, s0), min(end, s0 + p.size)
            if a < b:
                out[a - start:b - start] = p[a - s0:b - s0]
        out[max(0, min(out.size, self.length - start)):] = 0
        return out

    def view(self, start: int, n: int, spare: np.ndarray) -> np.ndarray:
        """Payload bytes ``start:start+n``: a view of the file that holds them all, else (across files or
        past the end) a copy in ``spare``."""
        for p, s0 in zip(self.parts, self.starts):
            if s0 <= start and start + n <= s0 + p.size:
                return p[start - s0:start - s0 + n]
        return self.read(start, spare[:n])


class Rebuilt:
    """Where a lost member's payload lands as it is rebuilt: ``files``, one fresh buffer per file of the
    payload (``manifest``'s replica files, in name order), and the arrays ``views`` names (``{entry name:
    uint8 array of its length}``, a restore's landing places) for whole entries of those files. A range of
    the payload inside one landed entry or one file is received straight where it belongs; a range across
    them goes through a block buffer and is copied apart (:meth:`settle`). The files' bytes of a landed
    entry are undefined, and their pages are never touched."""

    def __init__(self, manifest: Manifest, views: Mapping[str, np.ndarray]) -> None:
        self.manifest = manifest
        sizes = manifest.replica_files
        self.files = {n: np.empty(sizes[n], np.uint8) for n in sorted(sizes)}
        starts, at = {}, 0
        for n in self.files:
            starts[n], at = at, at + sizes[n]
        #: ``{entry name: array}`` of the entries that land in the arrays
        self.landed = {e.name: views[e.name] for e in manifest.entries if e.kind == "array" and e.name in views
                       and e.file in sizes}
        for e in manifest.entries:
            if e.name in self.landed and self.landed[e.name].nbytes != e.length:
                raise ValueError(f"entry {manifest.key(e.name)} cannot land in an array of "
                                 f"{self.landed[e.name].nbytes} bytes")
        # (start, end, array) in the payload, sorted and apart: the landed entries, and the files
        self._spans = sorted(((starts[e.file] + e.offset, starts[e.file] + e.offset + e.length, self.landed[e.name])
                              for e in manifest.entries if e.name in self.landed and e.length), key=lambda x: x[0])
        self._files = [(starts[n], starts[n] + b.size, b) for n, b in self.files.items() if b.size]
        self._at = ([x[0] for x in self._spans], [x[0] for x in self._files])  # their starts, to bisect

    @classmethod
    def of(cls, mbytes: bytes, length: int, landing: Callable[[Manifest], Mapping[str, np.ndarray]] | None
           ) -> "Rebuilt":
        """Where a payload of ``length`` bytes whose manifest is ``mbytes`` lands: its files, and the arrays
        ``landing(manifest)`` names (FormatError when the manifest is damaged or not of that payload)."""
        manifest = Manifest.from_bytes(mbytes)
        if sum(manifest.replica_files.values()) != length:
            raise FormatError(f"the stripes record says {length} bytes, the manifest "
                              f"{sum(manifest.replica_files.values())}")
        return cls(manifest, landing(manifest) if landing is not None else {})

    def _over(self, files: bool, a: int, b: int) -> list[tuple[int, int, np.ndarray]]:
        """The landed entries (or ``files``) that overlap payload bytes ``a:b``, in order."""
        spans, starts = (self._files, self._at[1]) if files else (self._spans, self._at[0])
        k = max(0, bisect.bisect_right(starts, a) - 1)
        return [x for x in spans[k:bisect.bisect_left(starts, b)] if x[1] > a]

    def into(self, a: int, b: int, spare: np.ndarray) -> tuple[np.ndarray, bool]:
        """Where payload bytes ``a:b`` are received, and whether that is where they belong (else in
        ``spare``, for :meth:`settle`)."""
        inside = self._over(False, a, b) or self._over(True, a, b)
        if len(inside) == 1 and inside[0][0] <= a and b <= inside[0][1]:
            s0, _, arr = inside[0]
            return arr[a - s0:b - s0], True
        return spare[:b - a], False

    def settle(self, a: int, b: int, data: np.ndarray) -> None:
        """Copy payload bytes ``a:b``, received in ``data`` (a block buffer), where they belong: into the
        files (bytes past the payload's end are padding: dropped), and into the landed entries."""
        for s, e, arr in self._over(True, a, b) + self._over(False, a, b):
            lo, hi = max(a, s), min(b, e)
            arr[lo - s:hi - s] = data[lo - a:hi - a]

    def verify(self) -> None:
        """Check every array entry of the files where its bytes are (ChecksumError naming the first bad one)."""
        _blocks.verify(self.manifest, self.files, landed=self.landed)


def pack(record: Mapping[str, Any], *blobs: bytes) -> bytes:
    """A JSON record and byte strings as one message (the record says each blob's length)."""
    head = json.dumps({**record, "blobs": [len(b) for b in blobs]}).encode()
    return len(head).to_bytes(8, "little") + head + b"".join(blobs)


def unpack(data: bytes) -> tuple[dict[str, Any], list[bytes]]:
    """What :func:`pack` made; FormatError when it is malformed."""
    try:
        n = int.from_bytes(data[:8], "little")
        record = json.loads(data[8:8 + n])
        at, blobs = 8 + n, []
        for size in record.pop("blobs"):
            blobs.append(data[at:at + int(size)])
            at += int(size)
        if at != len(data):
            raise ValueError("trailing bytes")
        return record, blobs
    except (ValueError, KeyError, TypeError) as e:
        raise FormatError(f"malformed message from a group member: {e}") from None


def check_block(data: np.ndarray, tail: np.ndarray, what: str, crc: bool = True) -> None:
    """Raise ChecksumError unless a received block's tail says it is good and (``crc``) its crc32c matches."""
    if tail[4] != 1:
        raise ChecksumError(f"{what}: its sender could not read it")
    if not crc:
        return
    want = int(tail[:4].view(np.uint32)[0])
    got = crc32c(data)
    if got != want:
        raise ChecksumError(f"{what}: checksum mismatch (sent {want:#010x}, received {got:#010x})")


def seal(buf: np.ndarray, n: int, ok: bool) -> None:
    """Write the tail of a block of ``n`` bytes at the start of ``buf``: its crc32c and whether it is good."""
    buf[n:n + TAIL] = 0
    buf[n:n + 4].view(np.uint32)[0] = crc32c(buf[:n]) if ok else 0
    buf[n + 4] = 1 if ok else 0


class WorkBuffers:
    """A tier's block buffers, lent to its exchanges and kept between them. Fresh ones every save would cost
    a page fault per page the exchange touches, and their zeroing; so the buffers of the largest exchange
    so far stay mapped (a few blocks per stripe: with the default block, at most 32 MiB for 4+1).
    Thread-safe: exchanges running at once get buffers of their own."""

    def __init__(self) -> None:
        self._free: list[np.ndarray] = []
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def lend(self, count: int, width: int) -> Iterator[list[np.ndarray]]:
        """``count`` uint8 buffers of ``width`` bytes, contents undefined, for the duration of the block."""
        with self._lock:
            kept = [b for b in self._free if b.size == width]  # another width: a job's shards changed size
            out, self._free = kept[:count], kept[count:]
        out += [np.empty(width, np.uint8) for _ in range(count - len(out))]
        yield out
        with self._lock:  # not after a failure: a transfer abandoned on a lost peer may still write into them
            self._free += out

    @property
    def nbytes(self) -> int:
        """Bytes of the buffers kept now (lent ones not included)."""
        with self._lock:
            return sum(b.size for b in self._free)
