"""A :class:`~tierfs.CheckpointManager` step's non-tensor values as DCP's bytes items, for ``export_dcp``.

The manager keeps every non-tensor leaf of a state out of DCP and stores it beside DCP's items in the rank's
shard (``x|`` entries, :mod:`tierfs.adapters._torchstate`). A plain ``dcp.save`` of the same state would
have saved each of them as a bytes item: ``DefaultSavePlanner`` flattens the state (``flatten_state_dict``:
mappings always, lists that hold a tensor or a mapping, every other value a leaf) and the planner
``torch.save``s each leaf that is not a tensor (``BytesStorageMetadata``). :func:`bytes_items` gives the
items that save would have planned for a rank, with their fqns and key paths (the planner's flatten
mapping), and :func:`tensor_paths` the key paths a plain save would have recorded for the rank's tensors.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from ... import state as st
from ...errors import FormatError
from .. import _torchstate as ts


@dataclass
class Extra:
    """One rank's non-tensor values as the manager stored them (``x|`` entries), decoded."""

    plain: list[tuple[list[Any], Any]]  # (key path, the user's value)
    lists: set[tuple[tuple[str, str], ...]]  # the key paths (ts.key) of the lists that hold tensors
    paths: list[tuple[str, list[Any]]]  # (DCP fqn, key path) of each tensor


def decode(found: Mapping[str, tuple[Any, Any]], where: str) -> Extra | None:
    """The values of a rank's ``x|`` entries (``{name without the prefix: (entry, value)}``, as
    ``read_entries`` hands them over); None when the rank has none (a step saved by ``dcp.save``)."""
    if ts.INDEX not in found:
        if found:
            raise FormatError(f"{where}: the values saved beside the DCP items have no index")
        return None
    entry, index = found[ts.INDEX]
    if entry.kind != "json" or not (isinstance(index, list) and len(index) == 5
                                    and index[:2] == [ts.INDEX_FORMAT, 1]):
        raise FormatError(f"{where}: the index of the values saved beside the DCP items is not one this version "
                          "of tierfs reads")
    arrays: dict[int, np.ndarray] = {}
    for name, (e, raw) in found.items():
        if name != ts.INDEX:
            if e.kind != "array" or not name.startswith("a") or not name[1:].isdigit():
                raise FormatError(f"{where}: unknown entry {name!r} beside the DCP items")
            arrays[int(name[1:])] = np.array(st.view_as("numpy", e.dtype, e.shape, raw))  # a copy: raw is lent
    try:
        plain = [(list(p), ts.decode(v, arrays)) for p, v in index[2]]
        lists = {ts.key(p) for p in index[3]}
        paths = [(str(f), list(p)) for f, p in index[4]]
    except (TypeError, ValueError, KeyError, IndexError) as e:
        raise FormatError(f"{where}: the index of the values saved beside the DCP items is damaged "
                          f"({type(e).__name__}: {e})") from None
    return Extra(plain, lists, paths)


def dcp_path(path: list[Any], lists: set[tuple[tuple[str, str], ...]]) -> tuple[str | int, ...]:
    """A tierfs key path as DCP's planner records it: an int for an index into a list (``lists``: the
    :func:`tierfs.adapters._torchstate.key` of each list holding tensors), a str for every mapping key (``str(key)``, as
    ``traverse_state_dict`` makes it)."""
    return tuple(int(k) if ts.key(path[:i]) in lists else str(k) for i, k in enumerate(path))


def bytes_items(extra: Extra) -> list[tuple[str, tuple[str | int, ...], Any]]:
    """``(fqn, key path, value)`` of every bytes item a plain ``dcp.save`` of the rank's state would plan,
    flattened by DCP's own traversal (an empty mapping has none; a list of mappings is walked into; a
    tuple, a list of plain values and any other value is one item)."""
    from torch.distributed.checkpoint._traverse import traverse_state_dict

    out: list[tuple[str, tuple[str | int, ...], Any]] = []
    for path, value in extra.plain:
        prefix = dcp_path(path, extra.lists)

        def visit(p: tuple[str | int, ...], v: Any, prefix: tuple[str | int, ...] = prefix) -> None:
            full = prefix + tuple(p[1:])
            out.append((".".join(map(str, full)), full, v))

        # the value at its place in the state: DCP's traversal of a value depends on the value alone
        traverse_state_dict({"": value}, visit)
    return out


def tensor_paths(extra: Extra) -> dict[str, tuple[str | int, ...]]:
    """``fqn -> key path`` of the rank's tensors as a plain ``dcp.save`` of the state records them (the
    manager's own save saw lists of tensors as dicts keyed by index, and recorded string keys)."""
    return {f: dcp_path(p, extra.lists) for f, p in extra.paths}


def serialize(value: Any) -> bytes:
    """A bytes item's bytes, as ``DefaultSavePlanner.transform_object`` makes them (``torch.save``)."""
    import torch

    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()
