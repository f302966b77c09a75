"""Data-loader state saved with a step, without pickle.

A ``torchdata.stateful_dataloader.StatefulDataLoader``, or any object with ``state_dict()`` and
``load_state_dict()`` (a sampler, a streaming dataset, a curriculum), is saved with each step of this
rank and given back its state when the step is restored, so a job resumed mid-epoch sees exactly the
batches an uninterrupted run would see next.

How it is stored: each object's ``state_dict()`` is encoded as one JSON value (:func:`encode`, the
encoding the manager keeps its other non-tensor values in too) plus one array per tensor or numpy array in
it; nothing is pickled. The JSON keeps what JSON alone would lose: tuples (``{"$t": [...]}``), dicts
with any keys in order (``{"$d": [[key, value], ...]}``), non-finite floats (``{"$f": "nan"}``), bytes
(``{"$b": base64}``), numpy arrays and scalars (``{"$a": i, ...}``) and torch tensors (``{"$T": i,
"dtype": ..., "shape": ...}``, their bytes as a ``uint8`` array, any dtype, bfloat16 included). A value
of another type is an :class:`~tierfs.errors.ArgumentError` naming its key before anything is written.

In a saved state the objects' states are one reserved top-level key, :data:`KEY`, holding ``"index"``
(the JSON: format, version, and each object's encoded state by its name) and ``"a0"``, ``"a1"``, ... (the
arrays). The :class:`~tierfs.CheckpointManager` puts it in the rank's own shard (beside the DCP items on
the DCP path), so every rank gets its own loader's state back; the Hugging Face callback and the
torchtitan manager store it the same way.

    mgr.save(step, state, loader=train_loader)           # or loader={"train": dl, "aux": other}
    mgr.restore(state, loader=train_loader)              # train_loader.load_state_dict(saved state)
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Mapping, MutableMapping, Sequence

import numpy as np

from .. import state as st
from ..errors import ArgumentError, FormatError, StateMismatchError
from . import _torchstate as ts
from ._torchstate import encode as encode  # the one encoding of non-tensor values (see decode below)

log = logging.getLogger("tierfs")

#: the reserved top-level key of a saved state that holds the objects' states
KEY = "__stateful__"
INDEX = "index"
FORMAT = "tierfs.stateful"
VERSION = 1
#: the name of an object given alone (``loader=dl``) rather than in a mapping of names
DEFAULT_NAME = "loader"


def objects(value: Any, what: str = "loader") -> dict[str, Any]:
    """The objects to save or restore, by name.

    Parameters
    ----------
    value : object, mapping or None
        None (nothing), one object with ``state_dict()`` and ``load_state_dict()`` (named
        :data:`DEFAULT_NAME`), or a mapping of names (str) to such objects.
    what : str
        How messages name the argument.

    Returns
    -------
    dict
        ``{name: object}``; empty for None.

    Raises
    ------
    ArgumentError
        An object lacks ``state_dict``/``load_state_dict``, or a name is not a non-empty str.
    """
    if value is None:
        return {}
    items = dict(value) if isinstance(value, Mapping) else {DEFAULT_NAME: value}
    for name, obj in items.items():
        if not isinstance(name, str) or not name:
            raise ArgumentError(f"{what} names must be non-empty strings, got {name!r}")
        if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
            raise ArgumentError(f"{what} {name!r} must have state_dict() and load_state_dict() (e.g. a "
                                f"torchdata StatefulDataLoader), got a {type(obj).__name__}")
    return items


def decode(v: Any, arrays: Mapping[int, np.ndarray]) -> Any:
    """The value :func:`encode` encoded (tensors as new torch tensors, arrays as new numpy arrays); a
    FormatError names the loader's saved state."""
    return ts.decode(v, arrays, "a loader's saved state")


def tree(objs: Mapping[str, Any], wrap: Callable[[Any], Any] = lambda x: x) -> dict[str, Any]:
    """What a saved state holds under :data:`KEY` for ``objs`` (``{name: object}``): ``{"index": JSON,
    "a0": array, ...}``, each object's ``state_dict()`` taken now. ``wrap`` wraps the index (the store
    takes it as one JSON value wrapped in :class:`tierfs.state.Trusted`)."""
    arrays: list[np.ndarray] = []
    states = {name: encode(obj.state_dict(), arrays, name) for name, obj in objs.items()}
    index = {"format": FORMAT, "version": VERSION, "objects": states}
    return {INDEX: wrap(index), **{f"a{i}": a for i, a in enumerate(arrays)}}


def attach(state: Mapping[str, Any], loader: Any, *, trusted: bool, what: str = "loader") -> Mapping[str, Any]:
    """``state`` with the states of ``loader``'s objects under :data:`KEY` (a new top-level dict), or
    ``state`` itself when ``loader`` is None. ``trusted``: the index as one JSON value (a state saved by the
    store directly); else as plain values (the DCP path keeps them beside the DCP items)."""
    objs = objects(loader, what)
    if not objs:
        return state
    if KEY in state:
        raise ArgumentError(f"state key {KEY!r} is reserved for the {what}'s state; rename it")
    return {**state, KEY: tree(objs, st.Trusted if trusted else (lambda x: x))}


def load(objs: Mapping[str, Any], saved: Mapping[str, Any], step: int) -> None:
    """Give each of ``objs`` its state from ``saved`` (what :func:`tree` made, read back).

    Raises
    ------
    StateMismatchError
        The step holds no state for one of the names.
    FormatError
        The saved state is not one this version reads.
    """
    index = saved.get(INDEX)
    if not (isinstance(index, Mapping) and index.get("format") == FORMAT and isinstance(index.get("objects"), Mapping)):
        raise FormatError(f"step {step}: the saved loader state has no index this version of tierfs reads")
    if index.get("version") != VERSION:
        raise FormatError(f"step {step}: loader state version {index.get('version')!r} is not supported; upgrade "
                          "tierfs")
    arrays = {int(k[1:]): np.asarray(v) for k, v in saved.items() if k[:1] == "a" and k[1:].isdigit()}
    states = index["objects"]
    missing = [n for n in objs if n not in states]
    if missing:
        raise StateMismatchError(f"step {step} holds no state for {', '.join(repr(n) for n in missing)} (it holds "
                                 f"{sorted(states) or 'none'}); pass the names it was saved with")
    for name, obj in objs.items():
        obj.load_state_dict(decode(states[name], arrays))


def read(store: Any, step: int, tiers: Sequence[str] | None = None, rank: int | None = None
         ) -> dict[str, Any] | None:
    """The loader state a store saved in a rank's own shard of ``step`` (default: this rank's; rank 0's for
    a rank the saving job did not have), read and verified from the fastest tier holding it; None when
    the shard holds none. Reads without collectives."""
    if rank is None:
        world = store.read_marker(step, tiers=tiers).world_size
        rank = _saved_rank(store.group.rank, world, step)
    manifest, _ = store.read_manifest(step, rank, tiers=tiers)
    prefix = KEY + st.SEP
    names = [e.name for e in manifest.entries if e.name.startswith(prefix)]
    if not names:
        return None
    got: dict[str, Any] = {}

    def consume(found: Mapping[str, tuple[Any, Any]], tier: str) -> None:
        for name, (e, value) in found.items():
            got[name[len(prefix):]] = value if e.kind == "json" else np.array(value)  # a copy: value is lent

    store.read_entries(step, rank, names, tiers=tiers, consume=consume)
    return got


def restored(store: Any, step: int, tiers: Sequence[str] | None, root: Any, loader: Any) -> None:
    """After a restore of ``step`` into ``root`` (the caller's state, or the new state): take the loader
    state out of ``root`` (where a restore put it) and give ``loader``'s objects their states, read from
    this rank's shard when ``root`` does not hold it (an in-place restore of a step the store saved)."""
    saved = None
    if isinstance(root, MutableMapping) and isinstance(root.get(KEY), Mapping) and INDEX in root[KEY]:
        saved = root.pop(KEY)
    objs = objects(loader)
    if not objs:
        return
    if saved is None:
        saved = read(store, step, tiers)
    if saved is None:
        raise StateMismatchError(f"step {step} holds no loader state: it was saved without loader=; restore it "
                                 "without loader=")
    load(objs, saved, step)


def dcp_extra(objs: Mapping[str, Any]) -> dict[str, Any]:
    """The entries ``TieredWriter(extra=...)`` stores for ``objs`` in this rank's shard: the objects' states
    as a :class:`~tierfs.CheckpointManager` stores its non-tensor values (so ``export_dcp`` and the
    manager read them too)."""
    return ts.extra(ts.split({KEY: tree(objs)}))


def read_dcp(store: Any, step: int, tiers: Sequence[str] | None = None) -> dict[str, Any] | None:
    """The loader state stored beside the DCP items of this rank's shard of ``step`` (rank 0's for a rank
    the saving job did not have); None when there is none. Reads without collectives."""
    from ..format import DCP_EXTRA_PREFIX
    from .dcp import extra as _extra

    world = store.read_marker(step, tiers=tiers).world_size
    rank = _saved_rank(store.group.rank, world, step)
    manifest, _ = store.read_manifest(step, rank, tiers=tiers)
    names = [e.name for e in manifest.entries if e.name.startswith(DCP_EXTRA_PREFIX)]
    if not names:
        return None
    root: dict[str, Any] = {}

    def consume(found: Mapping[str, tuple[Any, Any]], tier: str) -> None:
        got = _extra.decode({n[len(DCP_EXTRA_PREFIX):]: v for n, v in found.items()}, f"step {step} rank {rank}")
        for path, value in got.plain if got is not None else ():
            if path[:1] == [KEY]:
                ts.assign(root, path, value)

    store.read_entries(step, rank, names, tiers=tiers, consume=consume)
    return root.get(KEY)


def _saved_rank(rank: int, world: int, step: int) -> int:
    """The rank whose loader state ``rank`` takes: its own, or rank 0's for a rank the saving job of ``world``
    ranks did not have (said in the log: its data order then repeats rank 0's)."""
    if rank < world:
        return rank
    log.warning("rank %d: step %d was saved by %d ranks, so this rank takes rank 0's loader state: it reads the "
                "data in rank 0's order until its loader is reshuffled", rank, step, world)
    return 0
