"""Getting a checkpoint out: a tierfs step as a plain DCP directory that loads without tierfs."""

from __future__ import annotations

import logging
import os
import uuid
from collections import defaultdict
from typing import IO, Any, Callable, Mapping

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta

from .._fileio import atomic_write
from .. import _args
from ..errors import ArgumentError, StepNotFoundError
from ..store import TieredStore
from ._dcpmeta import as_tensor

log = logging.getLogger("tierfs")


def export_dcp(store: TieredStore, directory: str | os.PathLike, step: int | None = None, *,
               tiers: list[str] | None = None, overwrite: bool = False, fsync: bool = True,
               progress: Callable[[int], None] | None = None) -> Metadata:
    """Write step ``step`` (default: the newest) of ``store`` as a plain DCP checkpoint in ``directory``.

    The result is what ``FileSystemWriter(directory)`` (``thread_count=1``, no extensions) would have
    written for the same save: one ``__{rank}_0.distcp`` file per saving rank, holding that rank's bytes
    items raw and each tensor chunk as ``torch.save(chunk)`` (DCP's default serialization, which
    ``FileSystemReader`` reads back with ``torch.load(weights_only=True)``), and a ``.metadata`` file:
    DCP's ``Metadata`` pickled by DCP's own rules, with ``_StorageInfo(relative_path, offset, length)``
    storage data. It loads with ``dcp.load(state, storage_reader=FileSystemReader(directory))`` and no
    tierfs (and with any world size DCP can reshard to).

    Every entry is read through the store's verified path (fastest tier whose copy checks out, every
    crc32c verified), from any rank's shard, so this runs in one process (e.g. rank 0 alone, or a tool
    after the job). ``.metadata`` is written last, through a temporary file and a rename, so a directory
    with a ``.metadata`` is complete. An existing ``.metadata`` in ``directory`` is an error unless
    ``overwrite=True``. ``progress(nbytes)`` is called as each item is written (a progress bar). Returns
    the ``Metadata`` written.
    """
    import pickle  # DCP's own metadata format; tierfs writes it for DCP but never reads pickle

    from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION, DEFAULT_SUFFIX, _StorageInfo

    _args.instance(store, "export_dcp store", TieredStore, "a TieredStore")
    step = _args.optional_step(step)
    tiers = _args.names(tiers, "tiers", [t.name for t in store.tiers])
    if isinstance(directory, bytes) or not isinstance(directory, (str, os.PathLike)) or not os.fspath(directory):
        raise ArgumentError(f"export_dcp directory must be a path, got {_args.shown(directory)}")
    if step is None:
        steps = store.steps()
        if tiers is not None:
            steps = {s: ts for s, ts in steps.items() if set(ts) & set(tiers)}
        if not steps:
            raise StepNotFoundError("nothing to export: no committed step")
        step = max(steps)
    directory = os.fspath(directory)
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise ArgumentError(f"export_dcp directory {directory} is a file; give a directory")
    meta_path = os.path.join(directory, ".metadata")
    os.makedirs(directory, exist_ok=True)
    if os.path.exists(meta_path) and not overwrite:
        raise FileExistsError(f"{directory} already holds a DCP checkpoint (.metadata); pass overwrite=True")

    # the global metadata, rebuilt from the coordinator's manifest (JSON, no pickle), as TieredReader does
    from .dcp import TieredReader

    md = TieredReader(store, step, tiers=tiers, collective=False).read_metadata()  # export runs in one process
    by_rank: dict[int, dict[str, list[MetadataIndex]]] = defaultdict(lambda: defaultdict(list))
    for idx, where in md.storage_data.items():
        by_rank[int(where["rank"])][str(where["entry"])].append(idx)

    storage: dict[MetadataIndex, Any] = {}
    written: list[str] = []
    for rank, wanted in sorted(by_rank.items()):
        rel = f"__{rank}_0{DEFAULT_SUFFIX}"
        path = os.path.join(directory, rel)

        def consume(found: Mapping[str, tuple[Any, Any]], tier: str, wanted: dict[str, list[MetadataIndex]] = wanted,
                    rel: str = rel, path: str = path) -> None:
            names = list(wanted)
            # FileSystemWriter writes a file's bytes items first, then its tensors
            names.sort(key=lambda n: not n.startswith("b|"))

            def write(f: IO[bytes]) -> None:
                for name in names:
                    entry, raw = found[name]
                    offset = f.tell()
                    if name.startswith("b|"):
                        f.write(raw.tobytes() if entry.kind == "array" else bytes(raw))
                    else:
                        torch.save(as_tensor(entry, raw), f)
                    length = f.tell() - offset
                    for idx in wanted[name]:
                        storage[idx] = _StorageInfo(rel, offset, length)
                    if progress is not None:
                        progress(entry.length if entry.kind == "array" else length)
            atomic_write(path, write, fsync=fsync)

        tier, skipped = store.read_entries(step, rank, list(wanted), tiers=tiers, consume=consume)
        for t, s, why in skipped:
            log.warning("export_dcp: step %d rank %d: skipped the %s copy (%s)", s, rank, t, why)
        log.info("export_dcp: step %d rank %d from %s -> %s", step, rank, tier, path)
        written.append(rel)

    out = Metadata(state_dict_metadata=md.state_dict_metadata, planner_data=md.planner_data,
                   storage_data=storage, storage_meta=StorageMeta(checkpoint_id=directory,
                                                                  save_id=uuid.uuid4().hex),
                   version=CURRENT_DCP_VERSION)
    atomic_write(meta_path, lambda f: pickle.dump(out, f), fsync=fsync)  # last: the directory is complete
    return out
