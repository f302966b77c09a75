"""The commit marker, written last: without it a step does not exist; and a manifest trusted only once it
matches its marker."""

from __future__ import annotations

import functools
import json
import time
from dataclasses import dataclass, field, fields

from ..errors import ChecksumError, FormatError
from .manifest import Manifest
from .names import FORMAT_VERSION, READ_VERSIONS, crc32c, manifest_filename, validate_filename

@dataclass
class Marker:
    """The commit marker: the step, its ranks, and the save that wrote them.

    Version 2 (what a save writes) is the same few bytes whatever the number of ranks: ``commit``, the
    save's id, which every manifest of it carries (each checked against its own checksum), ``digest``, sums
    over the ranks of two 31-bit hashes of each manifest's crc32c (what a check of a whole step compares),
    and ``nbytes``. Version 1 listed every rank's manifest with the crc32c of its bytes in ``manifests``;
    for version 2, ``manifests`` names them (from ``world_size``) and is not written. Version 3 is version
    2's marker for a step whose ranks' files an object tier keeps under spread key prefixes (:mod:`.keys`).
    """

    step: int
    world_size: int
    manifests: dict[str, int] = field(default_factory=dict)  # version 1: manifest file name -> crc32c
    nbytes: int = 0
    committed: float = field(default_factory=time.time)
    version: int = FORMAT_VERSION
    #: the tiers whose save policies took the step (None: not recorded): a store that opens copies a step
    #: its first tier holds to such a tier that lacks it (a process that ended before its copy)
    tiers: list[str] | None = None
    commit: str | None = None
    digest: list[int] | None = None

    def __post_init__(self) -> None:
        if self.commit is None:  # the manifests listed with their crc32c: the format of version 1
            self.version = min(self.version, 1)
        elif not self.manifests:  # their names, not written (see above)
            self.manifests = {manifest_filename(r): -1 for r in range(self.world_size)}

    def to_bytes(self) -> bytes:
        # the fields as they are (json.dumps copies nothing); version 2 names its manifests by world_size
        d = {f: getattr(self, f) for f in _MARKER_ORDER if f != "manifests" or self.commit is None}
        d["format"] = "tierfs"
        return json.dumps(d, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> "Marker":
        try:
            d = json.loads(data)
            if d.pop("format", None) != "tierfs":
                raise ValueError("not a tierfs marker")
            if d.get("version") not in READ_VERSIONS:
                raise FormatError(f"marker format version {d.get('version')!r} is not supported; upgrade tierfs")
            if (d.get("commit") is None) != (d["version"] < 2) or not isinstance(d.get("commit") or "", str):
                raise ValueError("a version 2 marker names its save (commit), a version 1 marker does not")
            m = cls(**{k: v for k, v in d.items() if k in _MARKER_FIELDS})  # fields of later versions: ignored
            if m.tiers is not None and not (isinstance(m.tiers, list) and all(isinstance(t, str) for t in m.tiers)):
                raise ValueError("tiers is not a list of names")
            if m.commit is not None and not isinstance(m.world_size, int):
                raise ValueError("world_size is not a number")
        except (ValueError, TypeError, UnicodeDecodeError, AttributeError) as e:
            raise FormatError(f"commit marker is damaged ({e})") from None
        if m.commit is None:
            for name in m.manifests:
                validate_filename(name)
        return m

    def has(self, rank: int) -> bool:
        """Whether rank ``rank``'s manifest makes part of the step."""
        if self.commit is not None:
            return 0 <= rank < self.world_size
        return manifest_filename(rank) in self.manifests


_MARKER_ORDER = tuple(f.name for f in fields(Marker))
_MARKER_FIELDS = set(_MARKER_ORDER)


def manifest_digest(rank: int, crc: int) -> list[int]:
    """Rank ``rank``'s part of a version-2 marker's ``digest``: two 31-bit hashes of its manifest's crc32c
    (summed over the ranks, they fit an int64 at any job size; the ranks' order counts)."""
    key = rank.to_bytes(4, "little") + crc.to_bytes(4, "little")
    return [crc32c(key) & 0x7FFFFFFF, crc32c(key[::-1], 0x9E3779B1) & 0x7FFFFFFF]


def step_digest(crcs: dict[int, int]) -> list[int]:
    """The ``digest`` of a step whose ranks' manifests have the crc32c ``crcs`` (``{rank: crc}``)."""
    parts = [manifest_digest(r, c) for r, c in crcs.items()]
    return [sum(p[0] for p in parts), sum(p[1] for p in parts)]


@functools.lru_cache(maxsize=16)
def _parsed(mbytes: bytes) -> Manifest:
    """A manifest parsed once (restores of a step read the same bytes again; thousands of entries take
    milliseconds to parse). Shared between callers: read-only."""
    return Manifest.from_bytes(mbytes)


def manifest_from_marker(marker: Marker, mbytes: bytes, step: int, rank: int) -> Manifest:
    """Rank ``rank``'s manifest of ``step`` from its bytes, checked against the step's commit marker: by the
    crc32c the marker lists (version 1), or by its own checksum and the save it names (version 2)."""
    mname = manifest_filename(rank)
    listed_in(marker, step, mname)
    if marker.commit is None and crc32c(mbytes) != marker.manifests[mname]:
        raise ChecksumError(f"manifest {mname} does not match its commit marker")
    try:
        m = _parsed(bytes(mbytes))
    except ChecksumError:
        raise ChecksumError(f"manifest {mname} does not match its commit marker (its own checksum fails: the "
                            "copy is damaged)") from None
    if m.commit != marker.commit:
        raise FormatError(f"manifest {mname} is from another save of step {step} than its commit marker")
    if m.step != step or m.rank != rank or m.world_size != marker.world_size:
        raise FormatError(f"manifest {mname} is for step {m.step} rank {m.rank} of {m.world_size}, not step "
                          f"{step} rank {rank} of {marker.world_size}")
    return m


def listed_in(marker: Marker, step: int, mname: str) -> None:
    """Raise FormatError unless ``marker`` is step ``step``'s and names manifest ``mname``."""
    if marker.step != step or mname not in marker.manifests:
        raise FormatError(f"the commit marker of step {step} does not list {mname}")
