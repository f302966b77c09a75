"""What the object tier reads from fsspec listings: which entries are files of a directory, their sizes and
modification times (each backend names them its own way), and one rank's files found by one listing."""

from __future__ import annotations

import datetime as _dt
from typing import Any, Callable

#: protocols whose ``find(prefix=...)`` lists the keys under a name prefix in one request (per 1,000 keys)
PREFIX_LISTING = ("s3", "s3a", "gs", "gcs")


def files_in(infos: Any, directory: str) -> dict[str, int]:
    """``{name: size}`` of the files among a listing's entries of ``directory`` (a list, or find's dict)."""
    entries = infos.values() if isinstance(infos, dict) else infos
    return {i["name"].rstrip("/").rsplit("/", 1)[-1]: int(i.get("size") or 0) for i in entries
            if i.get("type") == "file" and not is_dir_entry(i["name"], directory)}


def by_prefix(fs: Any, directory: str, names: list[str], call: Callable[[Callable[[], Any]], Any]) -> dict[str, int] | None:
    """``{name: size}`` of those of ``names`` in ``directory``, from one listing of the keys that start
    with their common prefix (``call`` runs the request, with retries), or None where that listing is not
    one request (other protocols, or names without a common prefix): then ask per file."""
    common = common_prefix(names)
    protocols = {fs.protocol} if isinstance(fs.protocol, str) else set(fs.protocol)
    if not common or not protocols & set(PREFIX_LISTING):
        return None
    fs.invalidate_cache(directory)
    try:
        found = call(lambda: fs.find(directory, prefix=common, detail=True, maxdepth=1))
    except FileNotFoundError:
        return {}
    wanted = set(names)
    return {n: size for n, size in files_in(found, directory).items() if n in wanted}


def common_prefix(names: list[str]) -> str:
    """The longest start every one of ``names`` shares."""
    lo, hi = min(names, default=""), max(names, default="")
    n = 0
    while n < min(len(lo), len(hi)) and lo[n] == hi[n]:
        n += 1
    return lo[:n]


def is_dir_entry(name: str, directory: str) -> bool:
    """Whether a listing entry is ``directory`` itself (a placeholder object ``dir/``), not a file in it."""
    return name.rstrip("/") == directory.rstrip("/")


def mtime(info: dict[str, Any]) -> float | None:
    """A file's modification time from an fsspec ``info``/``ls`` entry (keys differ per backend)."""
    for key in ("mtime", "LastModified", "updated", "last_modified", "created"):
        v = info.get(key)
        if v is None:
            continue
        if isinstance(v, (int, float)):
            return float(v)
        if isinstance(v, _dt.datetime):
            return v.timestamp()
        if isinstance(v, str):
            try:
                return _dt.datetime.fromisoformat(v.replace("Z", "+00:00")).timestamp()
            except ValueError:
                continue
    return None
