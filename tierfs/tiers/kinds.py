"""The built-in tier kinds, registered (:mod:`.registry`): how a tiers config entry builds each, and which
command-line TARGETs name one.

- ``memory``: ``"path"`` (default: the RAM tier's default directory), ``"budget"`` (bytes, or null);
  default name ``"ram"``, keep the latest 2. A TARGET that is an existing directory is one.
- ``object``: ``"url"`` (required), ``"storage_options"`` (passed to fsspec); default name: the URL's
  protocol, keep everything. A TARGET that is a URL is one.
- ``peer``: ``"replicas"`` (default 1), ``"strategy"`` (``"ring"`` or ``"pairwise"``), ``"connections"``.
- ``erasure``: ``"data"`` (default 4), ``"parity"`` (default 1), ``"connections"``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from ..util.args import object_url
from .rootdir import check_local_url
from ..errors import FormatError
from .base import AnyTier
from .erasure import ErasureCodedTier
from .memory import MemoryTier
from .object import ObjectTier
from .peer import PeerTier
from .registry import Entry, Kind, register


def _int(entry: Entry, key: str, default: int | None) -> int | None:
    value = entry.values.get(key, default)
    if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
        raise FormatError(f"{entry.where}: {key} must be a whole number{' or null' if default is None else ''}")
    return value


def _memory(entry: Entry, common: dict[str, Any]) -> AnyTier:
    return MemoryTier(entry.path("path"), budget=_int(entry, "budget", None), **{"name": "ram", **common})


def _memory_target(text: str, storage_options: Mapping[str, Any]) -> AnyTier | None:
    return MemoryTier(Path(text).expanduser()) if "://" not in text and Path(text).expanduser().is_dir() else None


def _object(entry: Entry, common: dict[str, Any]) -> AnyTier:
    url, options = entry.values.get("url"), entry.values.get("storage_options") or {}
    if not isinstance(url, str) or not url:
        raise FormatError(f'{entry.where}: an object tier needs "url", e.g. "s3://bucket/run"')
    if not isinstance(options, dict):
        raise FormatError(f"{entry.where}: storage_options must be an object")
    object_url(url, f"{entry.where}: url")  # a typo is an error naming the entry, never a local directory
    check_local_url(url, f"{entry.where}: url")
    return ObjectTier(url, dict(options), **common)


def _object_target(text: str, storage_options: Mapping[str, Any]) -> AnyTier | None:
    return ObjectTier(text, dict(storage_options)) if "://" in text else None


def _peer(entry: Entry, common: dict[str, Any]) -> AnyTier:
    strategy = entry.values.get("strategy", "ring")
    if strategy not in ("ring", "pairwise"):
        raise FormatError(f'{entry.where}: strategy must be "ring" or "pairwise", got {strategy!r}')
    return PeerTier(_int(entry, "replicas", 1) or 1, strategy, connections=_int(entry, "connections", 2) or 2,
                    **common)


def _erasure(entry: Entry, common: dict[str, Any]) -> AnyTier:
    return ErasureCodedTier(_int(entry, "data", 4) or 4, _int(entry, "parity", 1) or 1,
                            connections=_int(entry, "connections", 2) or 2, **common)


MEMORY = register(Kind("memory", MemoryTier, frozenset({"path", "budget"}), _memory,
                       '"path" (a directory on tmpfs), "budget" (bytes)', _memory_target))
OBJECT = register(Kind("object", ObjectTier, frozenset({"url", "storage_options"}), _object,
                       '"url" (an fsspec URL such as s3://bucket/run), "storage_options"', _object_target))
PEER = register(Kind("peer", PeerTier, frozenset({"replicas", "strategy", "connections"}), _peer,
                     '"replicas", "strategy" ("ring" or "pairwise"), "connections"'))
ERASURE = register(Kind("erasure", ErasureCodedTier, frozenset({"data", "parity", "connections"}), _erasure,
                        '"data", "parity" (each group of data + parity nodes survives parity lost), "connections"'))
