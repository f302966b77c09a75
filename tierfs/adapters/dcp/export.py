"""Getting a checkpoint out: a tierfs step as a plain DCP directory that loads without tierfs."""

from __future__ import annotations

import logging
import os
import uuid
from collections import defaultdict
from typing import IO, Any, Callable, Mapping

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex, StorageMeta

from ...util import args as _args
from ...util.fileio import atomic_write
from ...tiers.rootdir import KERNEL_FS, SYSTEM_DIRS, SYSTEM_TREES, filesystem_type
from ...errors import ArgumentError, OutputExistsError, StepNotFoundError, TierfsError
from ...format import DCP_EXTRA_PREFIX
from ...store import TieredStore
from . import extra as _extra
from .metadata import as_tensor
from .reader import TieredReader

log = logging.getLogger("tierfs")


def _inside(path: str, tree: str) -> bool:
    return path == tree or path.startswith(tree.rstrip("/") + "/")


def check_directory(directory: Any, what: str) -> str:
    """An export's output directory, checked before anything is read or written: a local path (not a URL),
    not a file, not a system directory (``/``, ``/etc/...``, ``/usr/...``, ``/tmp`` itself, ...) and not on
    a kernel file system: the export fills it with checkpoint files. The rules of a local tier's directory
    (:mod:`tierfs.tiers.rootdir`), by path and file system type, not by permission (root may write anywhere).

    Parameters
    ----------
    directory : str or os.PathLike
        What the caller gave.
    what : str
        How messages name it (``"export_dcp directory"``, ``"DIR"``).

    Returns
    -------
    str
        The directory, as given.

    Raises
    ------
    ArgumentError
        It cannot be the export's directory (one line naming it and what to give instead).
    """
    if isinstance(directory, bytes) or not isinstance(directory, (str, os.PathLike)) or not os.fspath(directory):
        raise ArgumentError(f"{what} must be a path, got {_args.shown(directory)}")
    path = os.fspath(directory)
    meant = "://" in path or _args.mangled(path) is not None
    if meant and not path.startswith("/"):
        raise ArgumentError(f"{what} {path!r} is a URL, but an export writes a local directory: export to one, then "
                            "copy it to object storage")
    real = os.path.realpath(path)
    have = real
    while not os.path.exists(have) and have != os.path.dirname(have):
        have = os.path.dirname(have)
    kind = filesystem_type(have)
    if (real in SYSTEM_DIRS or kind in KERNEL_FS
            or (any(_inside(real, t) for t in SYSTEM_TREES) and not _inside(real, "/dev/shm"))):
        also = f" ({real})" if real != os.path.abspath(path) else ""
        raise ArgumentError(f"{what} {path!r}{also} is a system directory, or below one: the export fills it with "
                            "checkpoint files; give a directory of its own, e.g. './export-step-N'")
    if os.path.exists(path) and not os.path.isdir(path):
        raise ArgumentError(f"{what} {path} is a file; give a directory")
    return path


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

    A :class:`~tierfs.CheckpointManager` step exports whole: the non-tensor values the manager keeps beside
    DCP's items (``x|`` entries, per rank) become the bytes items a plain ``dcp.save`` of the same state
    would have written: flattened as DCP's planner flattens a state (fqns and ``planner_data`` key paths
    included), ``torch.save`` of the user's original value, ``BytesStorageMetadata``. Each is written once,
    from rank 0, or from the lowest rank holding it when rank 0 does not (DCP too keeps one copy). Two values
    that flatten to one fqn (which ``dcp.save`` rejects as well) are a :class:`~tierfs.errors.TierfsError`.

    Every entry is read through the store's verified path (fastest tier whose copy checks out, every
    crc32c verified), from any rank's shard, so this runs in one process (e.g. rank 0 alone, or a tool
    after the job). ``.metadata`` is written last, through a temporary file and a rename, so a directory
    with a ``.metadata`` is complete. An existing ``.metadata`` in ``directory`` is an error unless
    ``overwrite=True``; a system directory (``/etc/x``), a URL or a file is an
    :class:`~tierfs.errors.ArgumentError` (:func:`check_directory`). ``progress(nbytes)`` is called as each
    item is written (a progress bar). Returns the ``Metadata`` written.
    """
    import pickle  # DCP's own metadata format; tierfs writes it for DCP but never reads pickle

    from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION, DEFAULT_SUFFIX, _StorageInfo

    _args.instance(store, "export_dcp store", TieredStore, "a TieredStore")
    step = _args.optional_step(step)
    tiers = _args.names(tiers, "tiers", [t.name for t in store.tiers])
    directory = check_directory(directory, "export_dcp directory")
    if step is None:
        steps = store.steps()
        if tiers is not None:
            steps = {s: ts for s, ts in steps.items() if set(ts) & set(tiers)}
        if not steps:
            raise StepNotFoundError("nothing to export: no committed step")
        step = max(steps)
    meta_path = os.path.join(directory, ".metadata")
    os.makedirs(directory, exist_ok=True)
    if os.path.exists(meta_path) and not overwrite:
        raise OutputExistsError(f"{directory} already holds a DCP checkpoint (.metadata)")

    # the global metadata, rebuilt from the coordinator's manifest (JSON, no pickle), as TieredReader does

    md = TieredReader(store, step, tiers=tiers, collective=False).read_metadata()  # export runs in one process
    by_rank: dict[int, dict[str, list[MetadataIndex]]] = defaultdict(lambda: defaultdict(list))
    for idx, where in md.storage_data.items():
        by_rank[int(where["rank"])][str(where["entry"])].append(idx)
    # a CheckpointManager step keeps its non-tensor values beside DCP's items, per rank (x| entries): they
    # become the bytes items a plain dcp.save of the state would have written, each once, from the lowest
    # rank that has it (rank 0's copy of a value every rank holds, as DCP keeps one copy)
    world = store.read_marker(step, tiers=tiers).world_size
    extra_names: dict[int, list[str]] = {}
    for rank in range(world):
        manifest, _ = store.read_manifest(step, rank, tiers=tiers)
        names = [e.name for e in manifest.entries if e.name.startswith(DCP_EXTRA_PREFIX)]
        if names:
            extra_names[rank] = names

    sdm: dict[str, Any] = dict(md.state_dict_metadata)
    planner_data: dict[str, Any] | None = None if md.planner_data is None else dict(md.planner_data)
    tensor_paths: dict[str, tuple[str | int, ...]] = {}
    owner: dict[str, int] = {}  # fqn -> the rank whose copy of a non-tensor value is exported
    storage: dict[MetadataIndex, Any] = {}
    written: list[str] = []
    for rank in sorted(set(by_rank) | set(extra_names)):
        wanted = by_rank.get(rank, {})
        extras = extra_names.get(rank, [])
        rel = f"__{rank}_0{DEFAULT_SUFFIX}"
        path = os.path.join(directory, rel)

        def consume(found: Mapping[str, tuple[Any, Any]], tier: str, wanted: dict[str, list[MetadataIndex]] = wanted,
                    extras: list[str] = extras, rank: int = rank, rel: str = rel, path: str = path) -> None:
            nonlocal planner_data
            items: list[tuple[str, bytes]] = []  # this rank's new bytes items: (fqn, torch.save of the value)
            extra = _extra.decode({n[len(DCP_EXTRA_PREFIX):]: found[n] for n in extras},
                                     f"step {step} rank {rank}")
            if progress is not None:
                for n in extras:
                    if found[n][0].kind == "array":
                        progress(found[n][0].length)
            if extra is not None:
                for fqn, dcp_path, value in _extra.bytes_items(extra):
                    if fqn in sdm:
                        if owner.get(fqn, rank) != rank:
                            continue  # a lower rank's copy is exported
                        raise TierfsError(f"step {step} cannot be a plain DCP checkpoint: rank {rank}'s value at "
                                          f"{list(dcp_path)!r} and another item both flatten to {fqn!r}")
                    sdm[fqn], owner[fqn] = BytesStorageMetadata(), rank
                    if planner_data is None:
                        planner_data = {}
                    planner_data.setdefault(fqn, dcp_path)
                    items.append((fqn, _extra.serialize(value)))
                for fqn, p in _extra.tensor_paths(extra).items():
                    tensor_paths.setdefault(fqn, p)
            names = list(wanted)
            # FileSystemWriter writes a file's bytes items first, then its tensors
            names.sort(key=lambda n: not n.startswith("b|"))

            def write(f: IO[bytes]) -> None:
                for fqn, data in items:
                    offset = f.tell()
                    f.write(data)
                    storage[MetadataIndex(fqn)] = _StorageInfo(rel, offset, len(data))
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
            if items or names:
                atomic_write(path, write, fsync=fsync)
                written.append(rel)

        tier, skipped = store.read_entries(step, rank, list(wanted) + extras, tiers=tiers, consume=consume)
        for t, s, why in skipped:
            log.warning("export_dcp: step %d rank %d: skipped the %s copy (%s)", s, rank, t, why)
        log.info("export_dcp: step %d rank %d from %s -> %s", step, rank, tier, path)

    if planner_data is not None:
        # the key paths a plain dcp.save records: list indices as ints (the manager's save saw its lists of
        # tensors as dicts keyed by index)
        planner_data.update((f, p) for f, p in tensor_paths.items() if f in planner_data)
    out = Metadata(state_dict_metadata=sdm, planner_data=planner_data,
                   storage_data=storage, storage_meta=StorageMeta(checkpoint_id=directory,
                                                                  save_id=uuid.uuid4().hex),
                   version=CURRENT_DCP_VERSION)
    atomic_write(meta_path, lambda f: pickle.dump(out, f), fsync=fsync)  # last: the directory is complete
    return out
