"""Entries and manifests: what one rank wrote for one step, and where each value is."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field, fields
from typing import Any, Iterable

from ..errors import ChecksumError, FormatError
from ..util import nogc as _nogc
from . import jsonio
from .names import (CONTROL, DCP_SHARD_KEY, DEFAULT_BLOCK_SIZE, FORMAT_VERSION, MAX_NAME, READ_VERSIONS, crc32c,
                    nblocks, user_key, validate_entry_name, validate_filename)

#: a version-2 manifest's last field: the crc32c of the bytes before it
_SELF_CRC = re.compile(rb',"self_crc32c":(\d+)\}\s*$')


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


#: an entry's fields, as a manifest's JSON holds them
_FIELDS = frozenset(f.name for f in fields(Entry))


def _entries(raw: Any) -> list[Entry]:
    """A manifest's entries from its JSON. Those with every field (as tierfs writes them) are made without
    the dataclass's ``__init__``, which costs as much again as parsing the JSON for thousands of entries;
    others through it (a field too many or missing: TypeError)."""
    if not isinstance(raw, list):
        raise TypeError("entries is not a list")
    out = []
    new = object.__new__
    for e in raw:
        if type(e) is dict and e.keys() == _FIELDS:
            x = new(Entry)
            x.__dict__.update(e)
            out.append(x)
        else:
            out.append(Entry(**e))
    return out


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
    #: the save this manifest belongs to (version 2): the commit marker names it, so a manifest is trusted
    #: once it matches that and its own checksum (its last field), whatever the number of ranks
    commit: str | None = None

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
        """JSON; from version 2 its last field is the crc32c of the bytes before it (closed with ``}``)."""
        # the fields as they are (the encoder copies nothing; asdict's deep copy cost milliseconds per save)
        d = {k: v for k, v in vars(self).items() if not k.startswith("_")}
        d["entries"] = [vars(e) for e in self.entries]  # an Entry holds its fields alone
        d["format"] = "tierfs"
        # floats are where the user's values are: the metadata, the metrics, JSON entries' values
        body = jsonio.dumps(d, [self.metadata, self.metrics, self.created,
                                *(e.value for e in self.entries if e.value is not None)])
        if self.version < 2:
            return body
        return body[:-1] + b',"self_crc32c":' + str(crc32c(body)).encode() + b"}"

    @classmethod
    def from_bytes(cls, data: bytes) -> "Manifest":
        data = bytes(data)
        own = _SELF_CRC.search(data)
        if own is not None:  # version 2: the bytes before the checksum, closed, are what it covers
            body = data[:own.start()] + b"}"
            if crc32c(body) != int(own.group(1)):
                raise ChecksumError("manifest does not match its own checksum; the copy is damaged")
            data = body
        with _nogc.paused():  # thousands of objects: no collection of the whole process meanwhile
            return cls._parsed(data, own is not None)

    @classmethod
    def _parsed(cls, data: bytes, checked: bool) -> "Manifest":
        try:
            d = jsonio.loads(data)
        except (ValueError, UnicodeDecodeError) as e:
            raise FormatError(f"manifest is not valid JSON ({e}); the copy is damaged") from None
        if not isinstance(d, dict) or d.pop("format", None) != "tierfs":
            raise FormatError("manifest is not a tierfs manifest")
        if d.get("version") not in READ_VERSIONS:
            raise FormatError(
                f"manifest format version {d.get('version')!r} is not supported "
                f"(this tierfs reads versions {list(READ_VERSIONS)}); upgrade tierfs"
            )
        if (not checked) != (d["version"] < 2):
            raise FormatError("manifest of version 2 without its own checksum; the copy is damaged")
        try:
            entries = _entries(d.pop("entries"))
            m = cls(entries=entries, **d)
        except TypeError as e:
            raise FormatError(f"manifest has unexpected fields ({e})") from None
        m.validate()
        return m

    def validate(self, entries: bool = True) -> None:
        """The reader's checks (FormatError). ``entries=False`` leaves out the per-entry ones, for a manifest
        whose entries are those of one that passed them (a save of a structure saved before)."""
        for f, n in self.files.items():
            validate_filename(f)
            if not isinstance(n, int) or n < 0:
                raise FormatError(f"bad length {n!r} for file {f!r} in manifest")
        if not isinstance(self.block_size, int) or self.block_size <= 0:
            raise FormatError(f"bad block size {self.block_size!r} in manifest")
        if entries:
            self._validate_entries()
        self._validate_bundles()

    def _validate_entries(self) -> None:
        names = [e.name for e in self.entries]
        try:  # the names in one pass (thousands of entries); one by one only to say which is bad
            joined = "".join(names)
        except TypeError:
            joined = None
        if joined is None or not all(names) or max(map(len, names), default=0) > MAX_NAME or \
                CONTROL.search(joined) is not None:
            for n in names:
                validate_entry_name(n)
        files, bs = self.files, self.block_size
        for e in self.entries:
            if e.kind == "json":
                continue
            if e.kind != "array" or e.lib not in ("numpy", "torch"):
                raise FormatError(f"entry {self.key(e.name)} has unknown kind/lib {e.kind!r}/{e.lib!r}")
            size = files.get(e.file)
            if size is None or e.offset < 0 or e.offset + e.length > size:
                raise FormatError(f"entry {self.key(e.name)} points outside its shard file {e.file!r}")
            if len(e.crc32c) != nblocks(e.length, bs):
                raise FormatError(f"entry {self.key(e.name)} has {len(e.crc32c)} checksums, expected "
                                  f"{nblocks(e.length, bs)}")

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
