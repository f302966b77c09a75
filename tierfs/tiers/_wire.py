"""The wire protocol of the peer tier: how shards move between two ranks.

A transfer is one round of shard moves between ranks over a group's point-to-point ``exchange``:

1. every sender sends a first message of ``Wire.first`` bytes: a header's length and the header itself
   when it fits (the header holds the shard's manifest, about 250 bytes per tensor, and the marker,
   about 40 bytes per rank of the job), so most transfers need one round before the files;
2. the rest of a longer header follows only once its receiver agreed to its length (a length out of
   range is refused before the rest is sent, so a sender never waits for bytes nobody will take);
3. every receiver checks the header (the manifest against its marker, the file names) and says yes or
   no; refused copies send nothing more;
4. the files move in messages of ``Wire.chunk`` bytes, every block checked against the manifest as its
   bytes land, while they are still in cache. In a *landing* transfer (a restore's) the messages are also
   cut around every array entry of at least :data:`LAND_MIN` bytes (both sides cut by the manifest), so a
   receiver can take such an entry straight into the array it restores: no buffer to fault in, no copy.
"""

from __future__ import annotations

import bisect
import json
import struct
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from ..format import blockio as _blocks
from ..ranks import framed
from ..ranks.waits import said
from ..errors import ArgumentError, ChecksumError, FormatError, TierfsError
from ..format import Entry, Manifest, Marker, crc32c, manifest_from_marker, validate_filename
from .base import Pace

#: bytes per message: small enough that each is checksummed while still in cache as the next ones land,
#: large enough that per-message costs stay small (2-16 MiB measure alike on loopback; 8 is in the middle)
CHUNK = 8 << 20
#: bytes of a transfer's first message: a header's length and the header itself when it fits
FIRST = 64 << 10
#: the longest header a receiver accepts
MAX_HEADER = 1 << 30
#: array entries of at least this many bytes move in messages of their own in a landing transfer
LAND_MIN = 1 << 20

#: where a receiver lands a file's entries itself: ``{file: {entry offset: uint8 array of its length}}``
Direct = Mapping[str, Mapping[int, np.ndarray]]
#: ``accept(source, header) -> (manifest, {file: buffer of its size}, direct)``
Accept = Callable[[int, dict[str, Any]], tuple[Manifest, dict[str, np.ndarray], Direct]]
#: ``(to rank, header, files, the manifest the files belong to: a landing transfer cuts by it)``
Send = tuple[int, bytes, Mapping[str, Any], Manifest | None]


@dataclass(frozen=True)
class Wire:
    """The sizes a transfer uses. ``first`` must be the same on every rank; ``max_header`` is each
    receiver's own limit."""

    chunk: int = CHUNK
    first: int = FIRST
    max_header: int = MAX_HEADER

    def __post_init__(self) -> None:
        ok = all(isinstance(v, int) and not isinstance(v, bool) for v in (self.chunk, self.first, self.max_header))
        if not ok or self.chunk < 1 or self.first < 16 or self.max_header < 1:
            raise ArgumentError(f"bad transfer sizes {self}: ints, chunk >= 1, first >= 16, max_header >= 1 bytes")


#: a header's frame: the bytes of its JSON fields, of the manifest and of the marker, which follow raw (no
#: escaping of the manifest inside a JSON string, at either end)
_FRAME = struct.Struct("!III")


def header(step: int, rank: int, manifest: bytes, marker: bytes, files: Mapping[str, Any],
           error: str | None = None, limit: int = MAX_HEADER) -> bytes:
    """A shard's header: what the receiver checks before it takes the files (or why there are none)."""
    fields = {"step": step, "rank": rank, "error": error, "files": [[n, memoryview(f).nbytes] for n, f in files.items()]}
    meta = json.dumps(fields).encode()
    if _FRAME.size + len(meta) + len(manifest) + len(marker) > limit:  # the receiver would refuse it: say why
        why = (f"its header is {_FRAME.size + len(meta) + len(manifest) + len(marker)} bytes, over {limit}"
               + (f" ({error})" if error else ""))
        meta, manifest, marker = json.dumps(fields | {"files": [], "error": why}).encode(), b"", b""
    return b"".join((_FRAME.pack(len(meta), len(manifest), len(marker)), meta, manifest, marker))


def parse_header(raw: bytes) -> dict[str, Any]:
    """The fields of a header (:func:`header`), ``manifest`` and ``marker`` as bytes; FormatError when its
    frame does not add up."""
    if len(raw) < _FRAME.size:
        raise FormatError(f"a peer's header is {len(raw)} bytes, too short for its frame")
    a, b, c = _FRAME.unpack_from(raw)
    if _FRAME.size + a + b + c != len(raw):
        raise FormatError(f"a peer's header of {len(raw)} bytes does not match its frame ({a}, {b}, {c}); do all "
                          "ranks run the same tierfs version?")
    h = json.loads(raw[_FRAME.size:_FRAME.size + a])
    if not isinstance(h, dict):
        raise FormatError("a peer's header is not a JSON object")
    h["manifest"], h["marker"] = raw[_FRAME.size + a:_FRAME.size + a + b], raw[_FRAME.size + a + b:]
    return h


#: what a holder that finds its own copy bad says first (its receiver then counts the copy as bad, and it is
#: dropped): damaged or missing bytes, not a failure of the moment (no memory, no file descriptor left)
BAD = "bad copy: "


def unsendable(e: BaseException) -> str:
    """What a holder that cannot send its copy says in its header's ``error`` (see :data:`BAD`)."""
    bad = isinstance(e, (ChecksumError, FormatError, FileNotFoundError))
    return f"{BAD if bad else ''}{type(e).__name__}: {e}"


def check_header(h: dict[str, Any], step: int, rank: int) -> tuple[Manifest, bytes, bytes]:
    """The manifest a peer announced for ``rank``'s shard of ``step``, checked against its marker."""
    if h.get("error"):
        error = str(h["error"])
        if error.startswith(BAD):
            raise TierfsError(f"the holder's copy is bad ({error[len(BAD):]})")
        raise TierfsError(f"the holder cannot send it now ({error})")
    mbytes, marker_bytes = h["manifest"], h["marker"]
    if h["step"] != step or h["rank"] != rank:
        raise FormatError(f"a peer offered step {h['step']} rank {h['rank']} for step {step} rank {rank}")
    marker = Marker.from_bytes(marker_bytes)
    m = manifest_from_marker(marker, mbytes, step, rank)
    announced = {validate_filename(n): size for n, size in h["files"]}
    kept = m.replica_files  # a peer keeps and sends what no other node holds
    if announced != kept or list(announced) != list(kept):
        raise FormatError(f"a peer's files for rank {rank} step {step} do not match the manifest")
    if not all(n.startswith(f"rank_{rank:05d}.") for n in announced) or not 0 <= rank < marker.world_size:
        raise FormatError(f"a peer's files for rank {rank} step {step} are named for another rank")
    return m, mbytes, marker_bytes


def cuts(manifest: Manifest) -> dict[str, list[int]]:
    """Per file, the offsets where a landing transfer cuts its messages besides every ``chunk`` bytes: the
    ends of each array entry of at least :data:`LAND_MIN` bytes. Sender and receiver cut by the same
    manifest, so their messages pair up."""
    out: dict[str, set[int]] = {}
    for e in manifest.entries:
        if lands(e):
            out.setdefault(e.file, set()).update((e.offset, e.offset + e.length))
    return {f: sorted(v) for f, v in out.items()}


def lands(e: Entry) -> bool:
    """Whether a landing transfer moves entry ``e`` in messages of its own (that may land in its array)."""
    return e.kind == "array" and e.length >= LAND_MIN


def direct(m: Manifest, views: Mapping[str, np.ndarray], files: Mapping[str, Any]) -> Direct:
    """``{file: {offset: array}}`` for the entries of ``files`` that ``views`` (``{entry name: array}``)
    names and that move in messages of their own (:func:`lands`); each array must hold exactly its
    entry's bytes."""
    out: dict[str, dict[int, np.ndarray]] = {}
    if views:
        for e in m.entries:
            v = views.get(e.name)
            if v is not None and lands(e) and e.file in files:
                if v.nbytes != e.length:
                    raise ValueError(f"entry {m.key(e.name)} cannot land in an array of {v.nbytes} bytes")
                out.setdefault(e.file, {})[e.offset] = v
    return out


def transfer(g: Any, sends: Sequence[Send], incoming: Sequence[int], accept: Accept, pace: Pace | None,
             wire: Wire = Wire(), land: bool = False,
             parse: Callable[[bytes], dict[str, Any]] = parse_header) -> dict[int, str | None]:
    """One round of shard moves between ranks: headers, accept/refuse, then the files, every block checked
    as it lands. A header goes in a first message of ``wire.first`` bytes with its length; the rest of a longer
    one follows only once its receiver agreed to its length (one out of range is refused before the rest
    is sent). With ``land`` (the same on every rank) messages are also cut around large entries, and each
    receiver takes the entries ``accept`` names in its ``direct`` straight into their arrays. ``parse`` reads
    a header's bytes into what ``accept`` takes (default: a shard's, :func:`header`). Returns ``{source: error
    or None}``.

    A rank whose connection fails (its process ended, or it did not answer in time) drops out of the later
    steps of the round, on both sides, while the other pairs go on: every rank still reaches the caller's
    agreement together, where the failure is raised naming that rank (:mod:`tierfs.ranks.waits`)."""
    room = wire.first - 8
    lost: dict[int, str] = {}  # peers whose connection failed, and why

    def exchange(out: Sequence[tuple[int, np.ndarray]], into: Sequence[tuple[int, np.ndarray]], **kw: Any) -> None:
        """A round with the peers not lost (``into`` must hold none with ``on_received``: it counts them).
        Every round goes over the group's streams where it has them, the headers and yes/no bytes too: a
        small round there costs less than half of gloo's CPU and time (``benchmarks/bench_streams.py``)."""
        into = into if "on_received" in kw else [x for x in into if x[0] not in lost]
        for peer, why in g.exchange([x for x in out if x[0] not in lost], into, tolerate=True, bulk=True,
                                    **kw).items():
            lost.setdefault(peer, f"RankWaitError: rank {peer} {said(why)}")

    first_in = [(s, np.zeros(wire.first, dtype=np.uint8)) for s in incoming]
    exchange([(t, framed(h, wire.first)) for t, h, _, _ in sends], first_in)
    lengths = {s: int(b[:8].view(np.int64)[0]) for s, b in first_in if s not in lost}
    errors: dict[int, str | None] = {
        s: f"TierfsError: rank {s} announced a header of {n} bytes; do all ranks run the same tierfs version?"
        for s, n in lengths.items() if not 0 < n <= wire.max_header}
    long_out = [(t, h) for t, h, _, _ in sends if len(h) > room and t not in lost]
    long_in = [s for s in lengths if lengths[s] > room]
    rest_in: dict[int, np.ndarray] = {}
    if long_out or long_in:  # only the pairs with a long header take these two rounds
        for s in long_in:
            if s not in errors:
                try:  # before saying yes: a sender told to go must find its receive posted
                    rest_in[s] = np.empty(lengths[s] - room, dtype=np.uint8)
                except MemoryError:
                    errors[s] = f"MemoryError: no memory for the {lengths[s]}-byte header of rank {s}"
        go_in = [(t, np.zeros(1, dtype=np.uint8)) for t, _ in long_out]
        exchange([(s, np.array([s in rest_in], dtype=np.uint8)) for s in long_in], go_in)
        exchange([(t, np.frombuffer(h, dtype=np.uint8, offset=room)) for (t, h), (_, go) in zip(long_out, go_in)
                  if go[0]], list(rest_in.items()))
    bufs: dict[int, dict[str, np.ndarray]] = {}
    direct: dict[int, Direct] = {}
    manifests: dict[int, Manifest] = {}
    for s, first in first_in:
        if s in lost:
            errors[s] = lost[s]
        if errors.get(s):
            continue
        try:
            raw = first[8:8 + min(lengths[s], room)].tobytes() + (rest_in[s].tobytes() if s in rest_in else b"")
            h = parse(raw)
            manifests[s], bufs[s], direct[s] = accept(s, h)
            errors[s] = None
        except Exception as e:  # noqa: BLE001 - between rounds: the sender hears of it in the next one
            errors[s] = f"{type(e).__name__}: {e}"
    ok_out = [(s, np.array([errors[s] is None], dtype=np.uint8)) for s in incoming]
    ok_in = [(t, np.zeros(1, dtype=np.uint8)) for t, _, _, _ in sends]
    exchange(ok_out, ok_in)
    for s in incoming:  # a sender lost after it was accepted sends nothing more
        if s in lost and errors[s] is None:
            errors[s] = lost[s]
    data_out: list[tuple[int, np.ndarray]] = []
    for (t, _, files, m), (_, ok) in zip(sends, ok_in):
        at = cuts(m) if land and m is not None else {}
        if ok[0] and t not in lost:
            for name, f in files.items():
                out = _blocks.as_u8(f)
                data_out += [(t, out[a:b]) for a, b in _pieces(wire, out.size, at.get(name, ()))]
    checks = {(s, name): _FileCheck(manifests[s], name) for s in incoming if errors[s] is None for name in bufs[s]}
    data_in: list[tuple[int, str, np.ndarray, int, int]] = []  # (source, file, where, start, end)
    for s in incoming:
        if errors[s] is None:
            at = cuts(manifests[s]) if land else {}
            for name, buf in bufs[s].items():
                data_in += [(s, name, where, a, b) for where, a, b in
                            _landing(buf, _pieces(wire, buf.size, at.get(name, ())), direct[s].get(name, {}))]

    def landed(k: int) -> None:
        s, name, where, a, b = data_in[k]
        if errors[s] is None:
            try:
                checks[s, name].feed(where, a, b)
            except TierfsError as e:
                errors[s] = f"{type(e).__name__}: {e}"

    exchange(data_out, [(s, where) for s, _, where, _, _ in data_in], pace=pace, on_received=landed)
    for s in incoming:
        if s in lost and errors[s] is None:
            errors[s] = lost[s]
    for (s, name), check in checks.items():  # blocks no message reached (empty files)
        if errors[s] is None:
            try:
                size = bufs[s][name].size
                check.feed(bufs[s][name][size:], size, size)
            except TierfsError as e:
                errors[s] = f"{type(e).__name__}: {e}"
    return errors


def _pieces(wire: Wire, size: int, at: Sequence[int]) -> list[tuple[int, int]]:
    """A file's messages, ``(start, end)``: every ``wire.chunk`` bytes and at the offsets ``at``."""
    points = sorted({0, size, *range(0, size, wire.chunk), *(x for x in at if 0 < x < size)})
    return list(zip(points, points[1:]))


def _landing(buf: np.ndarray, pieces: Sequence[tuple[int, int]], direct: Mapping[int, np.ndarray]
             ) -> list[tuple[np.ndarray, int, int]]:
    """Where each message of a file lands: inside an entry ``direct`` holds an array for (``{offset:
    array}``), that array; elsewhere the file's buffer ``buf``."""
    starts = sorted(direct)
    out = []
    for a, b in pieces:
        k = bisect.bisect_right(starts, a) - 1
        o = starts[k] if k >= 0 else -1
        if k >= 0 and b <= o + direct[o].size:
            out.append((direct[o][a - o:b - o], a, b))
        else:
            out.append((buf[a:b], a, b))
    return out


class _FileCheck:
    """Checks one shard file's blocks as its chunks land, in order, each chunk while it is in cache."""

    def __init__(self, manifest: Manifest, name: str) -> None:
        self.name, self.manifest = name, manifest
        bs = manifest.block_size
        # (start, end, crc32c, entry name) of every block in the file, in order; the name is shown only on a
        # mismatch (as its user knows it)
        self.blocks = [(e.offset + a, e.offset + min(e.length, a + bs), e.crc32c[k], e.name)
                       for e in manifest.entries if e.kind == "array" and e.file == name
                       for k, a in enumerate(range(0, max(e.length, 1), bs))]
        self.blocks.sort()  # (in file order already, as a save lays them out: one pass)
        self.next, self.crc = 0, 0

    def feed(self, data: np.ndarray, start: int, end: int) -> None:
        """Bytes ``start:end`` of the file have landed, in ``data`` (every byte before them already has)."""
        blocks, i, crc = self.blocks, self.next, self.crc
        try:
            while i < len(blocks):
                lo, hi, want, entry = blocks[i]
                if lo >= end and not (lo == hi == end):
                    return
                a, b = (lo if lo > start else start), (hi if hi < end else end)
                if a < b:
                    crc = crc32c(data[a - start:b - start], crc)
                if hi > end:
                    return
                if crc != want:
                    raise ChecksumError(f"checksum mismatch in {self.manifest.key(entry)} ({self.name} bytes "
                                        f"{lo}-{hi}): stored {want:#010x}, received {crc:#010x}")
                i, crc = i + 1, 0
        finally:
            self.next, self.crc = i, crc
