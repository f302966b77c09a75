"""The on-tier format: step layout, manifests, commit markers and checksums.

The same bytes live on every tier. A step is one directory::

    step_000000000042/
        rank_00000.0000.bin          shard files: raw bytes of a rank's entries, 64-byte aligned
        rank_00000.0001.bin
        rank_00000.manifest.json     what is where, with crc32c per block
        COMMITTED                    the marker, written last; without it the step does not exist

This module knows nothing of tiers: it only names, plans, serialises and validates.
"""

from __future__ import annotations

import functools
import json
import os
import re
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Iterable, Sequence

from fastcrc import crc32 as _crc32

from .errors import ChecksumError, FormatError

FORMAT_VERSION = 1
MARKER = "COMMITTED"
ALIGN = 64
DEFAULT_BLOCK_SIZE = 4 << 20  # crc32c granularity: blocks verify independently and in parallel
DEFAULT_FILE_SIZE = 16 << 20  # entries are packed into shard files of about this size (object stores
# upload many 16 MiB objects faster than fewer large ones)

_STEP_RE = re.compile(r"^step_(\d{12})$")
_FILE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")


def crc32c(data: Any, value: int = 0) -> int:
    """crc32c (Castagnoli, "iSCSI") of a contiguous bytes-like object, continuing from ``value``.

    fastcrc picks the widest instructions the CPU has (AVX-512 VPCLMULQDQ, else SSE4.2/PCLMULQDQ, or
    ARM's CRC instructions) and releases the GIL: about 2x the crc32c package on a cached block here.
    """
    return int(_crc32.iscsi(data, value))


def read_json(path: str | os.PathLike[str], label: str, missing: str | None = None) -> Any:
    """A JSON file's content; FormatError ``"<label>: not valid JSON"`` if it is not JSON, and
    FormatError ``missing`` (when given) if it does not exist."""
    from pathlib import Path

    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        if missing is None:
            raise
        raise FormatError(missing) from None
    except ValueError as e:
        raise FormatError(f"{label}: not valid JSON ({e})") from None


def step_dirname(step: int) -> str:
    if not isinstance(step, int) or isinstance(step, bool) or step < 0 or step >= 10**12:
        raise FormatError(f"step must be an int in [0, 1e12), got {step!r}")
    return f"step_{step:012d}"


def parse_step_dirname(name: str) -> int | None:
    """The step of a directory name, or None when the name is not a step directory."""
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None


def shard_filename(rank: int, index: int) -> str:
    return f"rank_{rank:05d}.{index:04d}.bin"


def manifest_filename(rank: int) -> str:
    return f"rank_{rank:05d}.manifest.json"


def validate_filename(name: object) -> str:
    """A file name read from a manifest or a peer: one plain component, no traversal."""
    if not isinstance(name, str) or not _FILE_RE.match(name) or ".." in name:
        raise FormatError(f"unsafe file name {name!r} in checkpoint (expected one plain path component)")
    return name


def validate_entry_name(name: object) -> str:
    if not isinstance(name, str) or not name or len(name) > 4096 or any(ord(c) < 32 for c in name):
        raise FormatError(f"bad entry name {name!r}: use a non-empty string without control characters")
    return name


# -- entry names of DCP steps, and the keys users know entries by ----------------------------------------
#: in every rank's manifest metadata of a step written through DCP (``TieredWriter``)
DCP_SHARD_KEY = "dcp_shard"
#: entries ``TieredWriter(extra=...)`` stores beside DCP's items (a ``CheckpointManager``'s non-tensor values)
DCP_EXTRA_PREFIX = "x|"
_DCP_CHUNK_RE = re.compile(r"^(\d+(?:,\d+)*)?\|(.+)$", re.S)


def dcp_entry_name(fqn: str, offset: Sequence[int] | None, is_bytes: bool) -> str:
    """The entry name of a DCP write item: ``"<offsets joined by ,>|<fqn>"`` for a tensor chunk
    (``"0,128|layer.weight"``; ``"|fqn"`` for a 0-d tensor), ``"b|<fqn>"`` for a bytes item. The part
    before the first ``|`` is never a valid prefix of another kind, so names are unique within a rank."""
    if is_bytes:
        return f"b|{fqn}"
    return ",".join(str(int(o)) for o in (offset or ())) + "|" + fqn


def user_key(name: str, dcp: bool = False) -> str:
    """How messages name an entry: by the key its user knows, quoted.

    Parameters
    ----------
    name : str
        The entry's name in the manifest.
    dcp : bool
        Whether the entry is part of a step written through DCP (its manifest's metadata holds
        :data:`DCP_SHARD_KEY`; :attr:`Manifest.is_dcp`).

    Returns
    -------
    str
        The store's own entries are named by the user's keys (nested keys joined by ``/``), shown as they
        are: ``'layer0.weight'``. A DCP step's entries are named after DCP's items
        (:func:`dcp_entry_name`); messages show the fqn and which chunk: ``'0,0|model.0.weight'`` ->
        ``'model.0.weight' (the chunk at 0,0)``, ``'|step'`` -> ``'step'``, ``'b|fqn'`` -> ``'fqn'``,
        ``'x|name'`` -> ``'name' (a value saved beside the DCP tensors)``.
    """
    if dcp:
        if name.startswith("b|"):
            return repr(name[2:])
        if name.startswith(DCP_EXTRA_PREFIX):
            return f"{name[len(DCP_EXTRA_PREFIX):]!r} (a value saved beside the DCP tensors)"
        m = _DCP_CHUNK_RE.match(name)
        if m is not None:
            return repr(m.group(2)) + (f" (the chunk at {m.group(1)})" if m.group(1) else "")
    return repr(name)


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass
class Entry:
    """One named value of a rank's state.

    ``kind`` is ``"array"`` (bytes in a shard file) or ``"json"`` (value inline in the manifest).
    """

    name: str
    kind: str = "array"
    lib: str = "numpy"  # "numpy" or "torch": what restore() hands back
    dtype: str = ""
    shape: list[int] = field(default_factory=list)
    file: str = ""
    offset: int = 0
    length: int = 0
    crc32c: list[int] = field(default_factory=list)  # one per block of the manifest's block_size
    value: Any = None


@dataclass
class Manifest:
    """Everything one rank wrote for one step."""

    step: int
    rank: int
    world_size: int
    entries: list[Entry]
    files: dict[str, int]  # shard file name -> length in bytes
    block_size: int = DEFAULT_BLOCK_SIZE
    metadata: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)
    created: float = field(default_factory=time.time)
    version: int = FORMAT_VERSION
    #: sets of ranks (sorted) that hold identical copies of some of this shard's entries (data parallelism)
    groups: list[list[int]] = field(default_factory=list)
    #: entries other ranks hold too: ``{"owner": rank, "group": index in groups, "parts": [[file, start,
    #: end], ...]}``. Every rank of the group holds the bundle's entries at the same offsets relative to its
    #: parts; only the owner's copy goes to shared tiers (see :meth:`held_files`)
    bundles: list[dict[str, Any]] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(self.files.values())

    def _classes(self) -> tuple[set[str], set[str]]:
        """The files holding other owners' bundles (node-local tiers only) and this rank's own bundles."""
        got = self.__dict__.get("_file_classes")
        if got is None:
            local: set[str] = set()
            owned: set[str] = set()
            for b in self.bundles:
                (owned if b["owner"] == self.rank else local).update(p[0] for p in b["parts"])
            got = self.__dict__["_file_classes"] = (local, owned)
        return got

    @property
    def local_files(self) -> set[str]:
        """Files holding only copies of entries other ranks own: kept by node-local tiers (RAM) alone."""
        return self._classes()[0]

    def held_files(self, local: bool) -> dict[str, int]:
        """The files a tier holds: all of them on a node-local tier, all but :attr:`local_files` on a shared
        one (each distinct byte stored once across the job)."""
        skip = self._classes()[0] if not local else ()
        return {n: size for n, size in self.files.items() if n not in skip} if skip else self.files

    @property
    def replica_files(self) -> dict[str, int]:
        """The files a peer keeps a replica of: those holding entries no other rank holds."""
        local, owned = self._classes()
        if not local and not owned:
            return self.files
        return {n: size for n, size in self.files.items() if n not in local and n not in owned}

    @property
    def is_dcp(self) -> bool:
        """Whether this shard was written through DCP (``TieredWriter``): its entries are DCP's items."""
        return DCP_SHARD_KEY in self.metadata

    def key(self, name: str) -> str:
        """Entry ``name`` as messages show it: the user's key (:func:`user_key`)."""
        return user_key(name, self.is_dcp)

    def subset(self, files: Iterable[str]) -> "Manifest":
        """The part of this manifest in the given shard files (their array entries), e.g. to check a
        batch of files on its own."""
        names = set(files)
        return Manifest(self.step, self.rank, self.world_size,
                        [e for e in self.entries if e.kind == "array" and e.file in names],
                        {n: size for n, size in self.files.items() if n in names}, self.block_size,
                        metadata={k: v for k, v in self.metadata.items() if k == DCP_SHARD_KEY})

    def to_bytes(self) -> bytes:
        d = asdict(self)
        d["format"] = "tierfs"
        return json.dumps(d, separators=(",", ":"), allow_nan=False).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> "Manifest":
        try:
            d = json.loads(data)
        except (ValueError, UnicodeDecodeError) as e:
            raise FormatError(f"manifest is not valid JSON ({e}); the copy is damaged") from None
        if not isinstance(d, dict) or d.pop("format", None) != "tierfs":
            raise FormatError("manifest is not a tierfs manifest")
        if d.get("version") != FORMAT_VERSION:
            raise FormatError(
                f"manifest format version {d.get('version')!r} is not supported "
                f"(this tierfs reads version {FORMAT_VERSION}); upgrade tierfs"
            )
        try:
            entries = [Entry(**e) for e in d.pop("entries")]
            m = cls(entries=entries, **d)
        except TypeError as e:
            raise FormatError(f"manifest has unexpected fields ({e})") from None
        m.validate()
        return m

    def validate(self) -> None:
        for f, n in self.files.items():
            validate_filename(f)
            if not isinstance(n, int) or n < 0:
                raise FormatError(f"bad length {n!r} for file {f!r} in manifest")
        if not isinstance(self.block_size, int) or self.block_size <= 0:
            raise FormatError(f"bad block size {self.block_size!r} in manifest")
        for e in self.entries:
            validate_entry_name(e.name)
            if e.kind == "json":
                continue
            if e.kind != "array" or e.lib not in ("numpy", "torch"):
                raise FormatError(f"entry {self.key(e.name)} has unknown kind/lib {e.kind!r}/{e.lib!r}")
            if e.file not in self.files or e.offset < 0 or e.offset + e.length > self.files[e.file]:
                raise FormatError(f"entry {self.key(e.name)} points outside its shard file {e.file!r}")
            if len(e.crc32c) != nblocks(e.length, self.block_size):
                raise FormatError(f"entry {self.key(e.name)} has {len(e.crc32c)} checksums, expected "
                                  f"{nblocks(e.length, self.block_size)}")
        self._validate_bundles()

    def _validate_bundles(self) -> None:
        def ranks(v: Any) -> bool:
            return isinstance(v, list) and all(type(r) is int and 0 <= r < self.world_size for r in v)
        if not isinstance(self.groups, list) or not all(ranks(g) and self.rank in g for g in self.groups):
            raise FormatError("manifest has bad groups of ranks")
        for b in self.bundles:
            try:
                owner, group, parts = b["owner"], b["group"], b["parts"]
                ok = type(group) is int and 0 <= group < len(self.groups) and owner in self.groups[group]
                ok = ok and isinstance(parts, list) and all(
                    p[0] in self.files and type(p[1]) is int and type(p[2]) is int and 0 <= p[1] <= p[2] <= self.files[p[0]]
                    for p in parts)
            except (KeyError, TypeError, IndexError):
                ok = False
            if not ok:
                raise FormatError(f"manifest has a bad bundle of shared entries: {str(b)[:200]}")


def nblocks(length: int, block_size: int) -> int:
    return max(1, -(-length // block_size))


@dataclass
class Marker:
    """The commit marker: which ranks' manifests make up the step."""

    step: int
    world_size: int
    manifests: dict[str, int]  # manifest file name -> crc32c of its bytes
    nbytes: int = 0
    committed: float = field(default_factory=time.time)
    version: int = FORMAT_VERSION
    #: the tiers whose save policies took the step (None: not recorded): a store that opens copies a step
    #: its first tier holds to such a tier that lacks it (a process that ended before its copy)
    tiers: list[str] | None = None

    def to_bytes(self) -> bytes:
        d = asdict(self)
        d["format"] = "tierfs"
        return json.dumps(d, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> "Marker":
        try:
            d = json.loads(data)
            if d.pop("format", None) != "tierfs":
                raise ValueError("not a tierfs marker")
            if d.get("version") != FORMAT_VERSION:
                raise FormatError(f"marker format version {d.get('version')!r} is not supported; upgrade tierfs")
            m = cls(**{k: v for k, v in d.items() if k in _MARKER_FIELDS})  # fields of later versions: ignored
            if m.tiers is not None and not (isinstance(m.tiers, list) and all(isinstance(t, str) for t in m.tiers)):
                raise ValueError("tiers is not a list of names")
        except (ValueError, TypeError, UnicodeDecodeError, AttributeError) as e:
            raise FormatError(f"commit marker is damaged ({e})") from None
        for name in m.manifests:
            validate_filename(name)
        return m


_MARKER_FIELDS = {f.name for f in fields(Marker)}


@functools.lru_cache(maxsize=16)
def _parsed(mbytes: bytes) -> Manifest:
    """A manifest parsed once (restores of a step read the same bytes again; thousands of entries take
    milliseconds to parse). Shared between callers: read-only."""
    return Manifest.from_bytes(mbytes)


def manifest_from_marker(marker: Marker, mbytes: bytes, step: int, rank: int) -> Manifest:
    """Rank ``rank``'s manifest of ``step`` from its bytes, checked against the step's commit marker."""
    mname = manifest_filename(rank)
    listed_in(marker, step, mname)
    if crc32c(mbytes) != marker.manifests[mname]:
        raise ChecksumError(f"manifest {mname} does not match its commit marker")
    m = _parsed(bytes(mbytes))
    if m.step != step or m.rank != rank or m.world_size != marker.world_size:
        raise FormatError(f"manifest {mname} is for step {m.step} rank {m.rank} of {m.world_size}, not step "
                          f"{step} rank {rank} of {marker.world_size}")
    return m


def listed_in(marker: Marker, step: int, mname: str) -> None:
    """Raise FormatError unless ``marker`` is step ``step``'s and lists manifest ``mname``."""
    if marker.step != step or mname not in marker.manifests:
        raise FormatError(f"the commit marker of step {step} does not list {mname}")


def plan_files(sizes: Sequence[int], rank: int, file_size: int = DEFAULT_FILE_SIZE
               ) -> tuple[list[tuple[str, int]], dict[str, int]]:
    """Pack entries of the given byte sizes into shard files.

    Returns ``(placement, files)``: for each entry its ``(file, offset)``, and each file's length.
    Entries never span files; an entry larger than ``file_size`` gets a file of its own.
    """
    placement: list[tuple[str, int]] = []
    files: dict[str, int] = {}
    cur, used = None, 0
    for n in sizes:
        if cur is None or (used > 0 and used + n > file_size):
            cur, used = shard_filename(rank, len(files)), 0
            files[cur] = 0
        placement.append((cur, used))
        files[cur] = used + n
        used = align(used + n)
    return placement, files


def blocks(length: int, block_size: int) -> Iterable[tuple[int, int]]:
    """``(start, end)`` of each checksum block of an entry, relative to the entry."""
    if length == 0:
        yield (0, 0)
        return
    for start in range(0, length, block_size):
        yield start, min(length, start + block_size)
