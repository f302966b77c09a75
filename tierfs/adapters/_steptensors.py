"""The tensors of a committed step, whole: what an export to another format (safetensors) writes.

A step is one of three kinds, told apart by its manifests:

* saved through :class:`~tierfs.adapters.dcp.TieredWriter` (the manager's torch states, Lightning's
  ``TieredModelParallelStrategy``, torchtitan): every fqn DCP's metadata lists as a tensor, assembled
  from the chunks every rank holds (FSDP/DTensor shards) into the full tensor;
* saved by Lightning's ``TieredCheckpointIO``: the tensors of the checkpoint dict, named by their key path
  in it (``state_dict.net.0.weight``, from the JSON tree its codec stores);
* saved by :meth:`TieredStore.save` directly (the manager with ``use_dcp=False``): each rank's array
  entries, whole, nested keys joined with ``.``; a name several ranks hold is read from the lowest rank.

A Hugging Face Trainer step holds the Trainer's files (its ``model.safetensors`` already is one) and is
refused. :func:`tensors` lists a step's tensors without reading them; :func:`read` reads some of them, every
block verified, from the fastest tier whose copy checks out.
"""

from __future__ import annotations

import json
import warnings
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

from .. import state as st
from ..errors import ArgumentError, FormatError
from ..format import DCP_EXTRA_PREFIX, DCP_SHARD_KEY, Entry
from ..store import TieredStore
from . import loaderstate

#: the manifest metadata keys of the Lightning plugin and the Hugging Face callback
_LIGHTNING, _TRANSFORMERS = "lightning", "transformers"


@dataclass(frozen=True)
class Piece:
    """Where part of a tensor is: an entry of a rank's shard, at ``offsets`` with ``sizes`` in the tensor."""

    rank: int
    entry: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


@dataclass
class Tensor:
    """A tensor of a step: its name in the step, its dtype and shape, and its pieces."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    pieces: list[Piece] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * torch.empty((), dtype=self.dtype).element_size()


def kind(store: TieredStore, step: int, tiers: Sequence[str] | None) -> str:
    """``"dcp"``, ``"lightning"`` or ``"store"``: how ``step`` was saved (rank 0's manifest says)."""
    meta = store.read_manifest(step, 0, tiers=tiers)[0].metadata
    if DCP_SHARD_KEY in meta:
        return "dcp"
    if _TRANSFORMERS in meta:
        raise ArgumentError(f"step {step} holds a Hugging Face Trainer checkpoint's files (its model.safetensors is "
                            "one already): get them with TieredTrainerCallback.resume_path or tierfs cp")
    if _LIGHTNING in meta:
        return "lightning"
    return "store"


def tensors(store: TieredStore, step: int, tiers: Sequence[str] | None = None) -> list[Tensor]:
    """Every tensor of ``step``, in the order the step lists them, without reading any."""
    how = kind(store, step, tiers)
    if how == "dcp":
        return _dcp(store, step, tiers)
    if how == "lightning":
        return _lightning(store, step, tiers)
    return _plain(store, step, tiers)


def _torch_dtype(e: Entry) -> torch.dtype:
    if e.lib == "torch":
        if e.dtype not in st._TORCH_DTYPES:
            raise FormatError(f"unknown torch dtype {e.dtype!r} in the manifest")
        return getattr(torch, e.dtype)
    return torch.from_numpy(np.empty(0, np.dtype(e.dtype).newbyteorder("="))).dtype


def _dcp(store: TieredStore, step: int, tiers: Sequence[str] | None) -> list[Tensor]:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from .dcp.reader import TieredReader

    md = TieredReader(store, step, tiers=list(tiers) if tiers else None, collective=False).read_metadata()
    out: dict[str, Tensor] = {}
    sizes: dict[tuple[str, tuple[int, ...]], tuple[int, ...]] = {}
    for fqn, m in md.state_dict_metadata.items():
        if isinstance(m, TensorStorageMetadata):
            out[fqn] = Tensor(fqn, m.properties.dtype, tuple(m.size))
            for c in m.chunks:
                sizes[(fqn, tuple(c.offsets))] = tuple(c.sizes)
    for idx, where in md.storage_data.items():
        t = out.get(idx.fqn)
        if t is not None:
            offsets = tuple(idx.offset or ())
            t.pieces.append(Piece(int(where["rank"]), str(where["entry"]), offsets, sizes[(idx.fqn, offsets)]))
    for t in out.values():
        covered = sum(int(np.prod(p.sizes, dtype=np.int64)) for p in t.pieces)
        if covered != int(np.prod(t.shape, dtype=np.int64)):
            raise FormatError(f"step {step}: the chunks of {t.name!r} cover {covered} of its "
                              f"{int(np.prod(t.shape, dtype=np.int64))} elements")
    return list(out.values())


def _plain(store: TieredStore, step: int, tiers: Sequence[str] | None) -> list[Tensor]:
    world = store.read_marker(step, tiers=tiers).world_size
    out: dict[str, Tensor] = {}
    for rank in range(world):
        manifest, _ = store.read_manifest(step, rank, tiers=tiers)
        for e in manifest.entries:
            if e.kind != "array" or e.name.startswith((loaderstate.KEY + st.SEP, DCP_EXTRA_PREFIX)):
                continue
            name = e.name.replace(st.SEP, ".")
            if name not in out:
                shape = tuple(int(s) for s in e.shape)
                out[name] = Tensor(name, _torch_dtype(e), shape, [Piece(rank, e.name, (0,) * len(shape), shape)])
            elif out[name].pieces[0].rank == rank:
                raise ArgumentError(f"step {step}: two entries of rank {rank} are both named {name!r} once nested "
                                    "keys are joined with '.'")
    return list(out.values())


def _lightning(store: TieredStore, step: int, tiers: Sequence[str] | None) -> list[Tensor]:
    """The tensors of a ``TieredCheckpointIO`` step (one rank), named by their key path in Lightning's dict."""
    manifest, _ = store.read_manifest(step, 0, tiers=tiers)
    entries = {e.name: e for e in manifest.entries}
    got: dict[str, Any] = {}
    store.read_entries(step, 0, ["tree"], tiers=tiers, consume=lambda found, tier: got.update(found))
    try:
        tree = json.loads(got["tree"][1])
    except (KeyError, TypeError, ValueError) as e:
        raise FormatError(f"step {step}: the Lightning checkpoint's tree is damaged ({e})") from None
    out: list[Tensor] = []

    def walk(x: Any, path: list[str]) -> None:
        if not isinstance(x, list) or len(x) != 2:
            return
        tag, body = x
        if tag in ("d", "o"):
            for k, v in body:
                walk(v, path + [str(k if not isinstance(k, list) else k[1])])
        elif tag in ("l", "u"):
            for i, v in enumerate(body):
                walk(v, path + [str(i)])
        elif tag == "t" and f"t{body}" in entries:
            e = entries[f"t{body}"]
            shape = tuple(int(s) for s in e.shape)
            out.append(Tensor(".".join(path), _torch_dtype(e), shape, [Piece(0, e.name, (0,) * len(shape), shape)]))

    try:
        walk(tree, [])
    finally:
        del walk  # (it refers to itself: a cycle, left to the garbage collector otherwise)
    return out


def _view(e: Entry, raw: Any, shape: tuple[int, ...]) -> torch.Tensor:
    """A torch view (no copy) of an entry's verified bytes, never written to."""
    if e.lib == "torch":
        dtype = _torch_dtype(e)
        if raw.size == 0:
            return torch.empty(shape, dtype=dtype)
        with warnings.catch_warnings():  # a read-only mapping: torch warns, but the view is only read
            warnings.simplefilter("ignore", UserWarning)
            return torch.frombuffer(raw, dtype=dtype).reshape(shape)
    a = raw.view(np.dtype(e.dtype)).reshape(shape)
    if not a.dtype.isnative:
        a = a.astype(a.dtype.newbyteorder("="))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(a)


def read(store: TieredStore, step: int, tiers: Sequence[str] | None, wanted: Sequence[Tensor],
         progress: Callable[[int], None] | None = None) -> dict[str, torch.Tensor]:
    """``wanted`` read whole (``{name: new tensor}``), each rank's pieces in one verified read."""
    full = {t.name: torch.empty(t.shape, dtype=t.dtype) for t in wanted}
    by_rank: dict[int, dict[str, list[tuple[Tensor, Piece]]]] = defaultdict(lambda: defaultdict(list))
    for t in wanted:
        for p in t.pieces:
            by_rank[p.rank][p.entry].append((t, p))
    for rank in sorted(by_rank):
        uses = by_rank[rank]

        def consume(found: Mapping[str, tuple[Entry, Any]], tier: str,
                    uses: Mapping[str, list[tuple[Tensor, Piece]]] = uses) -> None:
            for name, (e, raw) in found.items():
                for t, p in uses[name]:
                    part = full[t.name][tuple(slice(o, o + s) for o, s in zip(p.offsets, p.sizes))]
                    part.copy_(_view(e, raw, p.sizes))
                if progress is not None:
                    progress(e.length)

        store.read_entries(step, rank, list(uses), tiers=tiers, consume=consume)
    return full
