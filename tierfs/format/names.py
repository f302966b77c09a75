"""Names, sizes and checksums of the on-tier format: step directories, shard and manifest files, DCP entry
names and the user's keys, alignment and checksum blocks, and the packing of entries into shard files."""

from __future__ import annotations

import json
import os
import re
from typing import Any, Iterable, Sequence

from fastcrc import crc32 as _crc32

from ..errors import FormatError

#: the version a save writes; a reader takes every version in READ_VERSIONS
FORMAT_VERSION = 3
READ_VERSIONS = (1, 2, 3)
MARKER = "COMMITTED"
ALIGN = 64
DEFAULT_BLOCK_SIZE = 4 << 20  # crc32c granularity: blocks verify independently and in parallel
DEFAULT_FILE_SIZE = 16 << 20  # entries are packed into shard files of about this size (object stores
# upload many 16 MiB objects faster than fewer large ones)

# (fullmatch and ASCII: "$" would take a name ending in a newline, "\d" other scripts' digits)
_STEP_RE = re.compile(r"step_([0-9]{12})", re.ASCII)
_FILE_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}", re.ASCII)
#: a control character, which no entry name holds
CONTROL = re.compile("[\x00-\x1f]")


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
    m = _STEP_RE.fullmatch(name)
    return int(m.group(1)) if m else None


def shard_filename(rank: int, index: int) -> str:
    return f"rank_{rank:05d}.{index:04d}.bin"


def manifest_filename(rank: int) -> str:
    return f"rank_{rank:05d}.manifest.json"


def validate_filename(name: object) -> str:
    """A file name read from a manifest or a peer: one plain component, no traversal."""
    if not isinstance(name, str) or not _FILE_RE.fullmatch(name) or ".." in name:
        raise FormatError(f"unsafe file name {name!r} in checkpoint (expected one plain path component)")
    return name


#: the longest entry name a manifest may hold (characters)
MAX_NAME = 4096


def entry_name_problem(name: object) -> str | None:
    """Why ``name`` cannot name an entry of a manifest, or None when it can: the one definition of a valid
    name, which a save checks its state's names against (:class:`~tierfs.errors.ArgumentError` naming the
    key, before anything is written) and a reader every manifest's (:func:`validate_entry_name`)."""
    if not isinstance(name, str):
        return f"it is a {type(name).__name__}, not a string"
    if not name:
        return "it is empty"
    if len(name) > MAX_NAME:
        return f"it is {len(name)} characters long, more than {MAX_NAME}"
    if CONTROL.search(name) is not None:
        return "it holds a control character (a tab, a newline, a NUL, ...)"
    return None


def shown_name(name: object, limit: int = 80) -> str:
    """A name as a message shows it: its repr, shortened in the middle beyond ``limit`` characters."""
    text = repr(name)
    return text if len(text) <= limit else f"{text[:limit // 2]}...{text[-(limit // 4):]}"


def validate_entry_name(name: object) -> str:
    """``name``, read from a manifest, when it is valid (:func:`entry_name_problem`); else FormatError."""
    why = entry_name_problem(name)
    if why is not None:
        raise FormatError(f"bad entry name {shown_name(name)} in checkpoint: {why}")
    return name  # type: ignore[return-value]


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


def nblocks(length: int, block_size: int) -> int:
    return max(1, -(-length // block_size))


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
