"""Hugging Face ``transformers.Trainer`` checkpoints as tierfs steps.

    from tierfs.tiers import MemoryTier, ObjectTier
    from tierfs.policies import FixedIntervalPolicy
    from tierfs.adapters.transformers import TieredTrainerCallback

    args = TrainingArguments(output_dir="/dev/shm/run/out", save_strategy="steps", save_steps=100, ...)
    tiered = TieredTrainerCallback([MemoryTier("/dev/shm/tierfs/run"),
                                    ObjectTier("s3://bucket/run", save=FixedIntervalPolicy(1000))])
    trainer = Trainer(model=model, args=args, callbacks=[tiered], ...)
    trainer.train(resume_from_checkpoint=tiered.resume_path())      # None on a fresh start

What it does
------------
The Trainer writes ``output_dir/checkpoint-{step}/`` itself (``model.safetensors``, ``optimizer.pt``,
``scheduler.pt``, ``rng_state_{rank}.pth``, ``trainer_state.json``, ``training_args.bin``, ...); nothing
of the Trainer's own saving or loading is replaced, and no private method is overridden. In ``on_save``
(which the Trainer calls without a barrier) every rank waits for the others, then the directory's files
are saved as one tierfs step ``{step}`` by a collective :meth:`TieredStore.save`: each file is one
entry (its bytes, never unpickled; the entry's name is the file's path relative to the checkpoint
directory). A rank saves the files it wrote: ``rng_state_{rank}.pth`` (and the ``__{rank}_*.distcp``
files of a sharded save) are rank ``rank``'s, every other file is rank 0's. The step commits (checksums,
manifests, marker last) once every rank's files are in the first tier; slower tiers take it in the
background when their save policies do, and each tier's keep policy deletes old steps.

Resume
------
The Trainer looks for its checkpoint before any callback runs, so the callback cannot do it: call
:meth:`TieredTrainerCallback.resume_path` (on every rank: it is collective) before ``trainer.train`` and
pass what it returns as ``resume_from_checkpoint``. It picks the newest step committed on any tier that
every rank can get, checks ``output_dir/checkpoint-{step}/`` against the step's checksums, and writes
each file that is missing or differs from the fastest tier holding a verified copy (a new node gets the
whole checkpoint from the peer or object tier). Without a Trainer (a launcher script, an evaluation
job), :func:`latest_checkpoint` does the same with a store of its own.

Retention
---------
The tiers' keep policies decide which steps stay. By default (``prune_output_dir=True``) the callback
also removes the ``checkpoint-{N}`` directories of ``output_dir`` (older than the newest save) that the
first tier no longer holds, so the Trainer's working copies in RAM follow the first tier's keep policy
(``state.best_model_checkpoint`` is never removed). Leave ``save_total_limit`` unset; if it is set, the
Trainer's own rotation (by step, or by mtime) also deletes directories, which is harmless to tierfs (the
step's bytes are already in the store) but ``resume_path`` will write back a removed directory it needs.

Data-loader state
-----------------
The Trainer resumes its own training data mid-epoch by itself: it skips the batches of the epoch that the
restored ``global_step`` already trained (``ignore_data_skip=False``, the default), with the order
``data_seed``/``seed`` gives, so nothing else is needed for it. Objects of your own with
``state_dict()``/``load_state_dict()`` (a ``torchdata`` ``StatefulDataLoader`` you draw from in a callback,
a stateful streaming dataset, a curriculum) are saved with each step in the rank's own shard, without
pickle, when given as ``TieredTrainerCallback(tiers, stateful={"name": obj})``; ``resume_path`` gives
them back their state. When such an object is the Trainer's training data itself, set
``ignore_data_skip=True``: otherwise the Trainer skips the trained batches once more.

Versions
--------
transformers 4.57 to 5.x (tested with 5.x): only the public ``TrainerCallback`` events and
``resume_from_checkpoint`` are used, and the checkpoint directory is treated as opaque files.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from .. import metrics, state as st
from ..util.fileio import atomic_write
from ..errors import ArgumentError, StateMismatchError
from ..format import crc32c
from ..store import TieredStore
from ..tiers.base import AnyTier
from . import loaderstate

try:
    import transformers
    from transformers import TrainerCallback
except ImportError as e:  # pragma: no cover - only without the extra
    raise ImportError("tierfs.adapters.transformers needs transformers: pip install 'tierfs[transformers]'") from e

__all__ = ["TieredMetricsCallback", "TieredTrainerCallback", "latest_checkpoint", "checkpoint_dirname",
           "SUPPORTED_TRANSFORMERS"]

log = logging.getLogger("tierfs")

#: the transformers versions this adapter supports (tested: 5.x; 4.57 has the same checkpoint layout)
SUPPORTED_TRANSFORMERS = ">=4.57,<6"
_PREFIX = "checkpoint-"  # transformers.trainer_utils.PREFIX_CHECKPOINT_DIR
_META_KEY = "transformers"
#: files that belong to one rank: the rank's RNG state, its part of a sharded (DCP) save
_RANK_FILE = (re.compile(r"(?:^|/)rng_state_(\d+)\.pth$"), re.compile(r"(?:^|/)__(\d+)_\d+\.distcp$"))

_major_minor = tuple(int(x) for x in re.findall(r"\d+", transformers.__version__)[:2])
if _major_minor < (4, 57) or _major_minor >= (6, 0):  # pragma: no cover - depends on the installed version
    log.warning("tierfs.adapters.transformers supports transformers %s; found %s",
                SUPPORTED_TRANSFORMERS, transformers.__version__)


def checkpoint_dirname(step: int) -> str:
    """The Trainer's directory name for ``step``: ``checkpoint-{step}``."""
    return f"{_PREFIX}{step}"


def _owner(rel: str) -> int:
    """The rank whose file ``rel`` is (0 for the files every rank shares)."""
    for pattern in _RANK_FILE:
        m = pattern.search(rel)
        if m:
            return int(m.group(1))
    return 0


def _files(directory: Path) -> list[str]:
    """Every file below ``directory``, as relative paths with ``/``, sorted (temporary files skipped)."""
    out = []
    for dirpath, _dirs, names in os.walk(directory):
        for n in names:
            if n.startswith(".tierfs-tmp") or n.startswith(".tmp"):
                continue
            out.append(Path(dirpath, n).relative_to(directory).as_posix())
    return sorted(out)


def _read(path: Path) -> Any:
    """A read-only view of a file's bytes (mapped, not copied); ``b""`` for an empty file."""
    if path.stat().st_size == 0:
        return b""
    return np.memmap(path, dtype=np.uint8, mode="r")


def _matches(path: Path, length: int, crcs: Sequence[int], block_size: int) -> bool:
    """Whether the file at ``path`` has ``length`` bytes whose blocks have the checksums ``crcs``."""
    try:
        if path.stat().st_size != length:
            return False
        if length == 0:
            return not crcs or list(crcs) == [crc32c(b"")]
        data = np.memmap(path, dtype=np.uint8, mode="r")
        got = [crc32c(data[i:i + block_size]) for i in range(0, length, block_size)]
        del data
        return got == list(crcs)
    except OSError:
        return False


def _safe_rel(rel: str) -> str:
    parts = rel.split("/")
    if rel.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise ArgumentError(f"unsafe file name {rel!r} in a transformers checkpoint step")
    return rel


def _stateful(name: str) -> bool:
    """Whether an entry holds the state of the callback's ``stateful`` objects (not a file)."""
    return name.startswith(loaderstate.KEY + st.SEP)


def materialize(store: TieredStore, output_dir: str | os.PathLike[str], step: int | None = None) -> str | None:
    """Write the checkpoint of ``step`` (default: the newest committed step every rank can get) into
    ``output_dir/checkpoint-{step}/`` and return that path; None when no tier holds a step.

    Collective when ``step`` is None (every rank must call it). Files already there whose bytes match the
    step's checksums are kept; every other file of every rank is read from the fastest tier holding a
    verified copy and written whole (temporary name, then rename), so ranks sharing ``output_dir`` may
    all call it."""
    if step is None:
        common = store.common_steps(raise_lost=True)  # steps only some ranks can get: CheckpointLostError
        if not common:
            return None
        # a replaced node's shard from a peer, into its RAM, where this reads it
        step = store.localize().step if store.replicator is not None else common[-1]
    target = Path(output_dir) / checkpoint_dirname(step)
    world = store.read_marker(step).world_size
    fetched: dict[str, str] = {}
    for rank in range(world):
        manifest, _ = store.read_manifest(step, rank)
        missing = [e.name for e in manifest.entries if e.kind == "array" and not _stateful(e.name)
                   and not _matches(target / _safe_rel(e.name), e.length, e.crc32c, manifest.block_size)]
        if not missing:
            continue

        def write(values: Mapping[str, tuple[Any, Any]], tier: str) -> None:
            for name, (_entry, value) in values.items():
                path = target / _safe_rel(name)
                path.parent.mkdir(parents=True, exist_ok=True)
                atomic_write(path, value)
                fetched[name] = tier
        store.read_entries(step, rank, missing, consume=write)
    if fetched:
        tiers = sorted(set(fetched.values()))
        log.info("tierfs: wrote %d file(s) of step %d into %s from tier(s) %s", len(fetched), step, target,
                 ", ".join(tiers))
    return str(target)


def latest_checkpoint(tiers: Sequence[AnyTier], output_dir: str | os.PathLike[str],
                      **store_options: Any) -> str | None:
    """The local path of the newest committed checkpoint on ``tiers`` (fetched into
    ``output_dir/checkpoint-{step}/`` if it is not there), for ``trainer.train(resume_from_checkpoint=...)``;
    None when there is none.

    Opens a :class:`TieredStore` over ``tiers`` (with ``store_options``) for the call and closes it
    (which closes the tiers: pass tier objects made for this call). Collective under torch.distributed.
    Inside a training script prefer :meth:`TieredTrainerCallback.resume_path`."""
    with TieredStore(tiers, **store_options) as store:
        return materialize(store, output_dir)


class TieredTrainerCallback(TrainerCallback):
    """A ``transformers.Trainer`` callback that makes every checkpoint the Trainer saves a tierfs step.

    Parameters
    ----------
    tiers:
        The tiers, fastest first (a ``MemoryTier`` first), as for :class:`~tierfs.TieredStore`.
    stateful:
        Objects with ``state_dict()`` and ``load_state_dict()`` (e.g. a ``StatefulDataLoader``), by name (or
        one, named ``"loader"``): each step stores their states in the rank's own shard, without pickle;
        :meth:`resume_path` gives them back. The Trainer's own training data needs none of this (it skips
        the trained batches itself).
    prune_output_dir:
        Remove ``output_dir/checkpoint-{N}`` directories older than the newest save that the first tier no
        longer holds (the first tier's keep policy also bounds the Trainer's copies). Default True.
    **store_options:
        Passed to :class:`~tierfs.TieredStore` (``group``, ``timeout``, ``background_bandwidth``, ...).

    Notes
    -----
    The store opens on first use (``resume_path`` or the first event), after ``TrainingArguments`` has
    set up torch.distributed, so its default group is the job's. :attr:`store` gives it.
    """

    def __init__(self, tiers: Sequence[AnyTier], *, stateful: Any = None, prune_output_dir: bool = True,
                 **store_options: Any) -> None:
        super().__init__()
        self.stateful = loaderstate.objects(stateful, "stateful")
        self._tiers = list(tiers)
        self._options = dict(store_options)
        self._store: TieredStore | None = None
        self.prune_output_dir = bool(prune_output_dir)
        self.output_dir: str | None = None
        self.saved: list[int] = []  # steps this callback committed, oldest first

    # -- the store ----------------------------------------------------------------------------------
    @property
    def store(self) -> TieredStore:
        """The store over the tiers (opened on first use)."""
        if self._store is None:
            self._store = TieredStore(self._tiers, **self._options)
        return self._store

    def close(self) -> None:
        """Finish background copies and close the store (``on_train_end`` only waits for the copies)."""
        if self._store is not None:
            self._store.close()

    # -- resume -------------------------------------------------------------------------------------
    def resume_path(self, output_dir: str | os.PathLike[str] | None = None, step: int | None = None) -> str | None:
        """The local path of the newest committed checkpoint (or of ``step``), for
        ``trainer.train(resume_from_checkpoint=...)``; None when no tier holds one.

        Call it on every rank (collective), before ``trainer.train``. ``output_dir`` defaults to the
        Trainer's ``args.output_dir`` (known once the Trainer is built with this callback). A file the
        local directory lacks, or holds with other bytes, is written from the fastest tier holding a
        verified copy. The ``stateful`` objects get the state this rank saved with the step."""
        out = output_dir if output_dir is not None else self.output_dir
        if out is None:
            raise ArgumentError("resume_path() needs output_dir before the Trainer is built with this callback")
        path = materialize(self.store, out, step)
        if path is not None and self.stateful:
            got = int(Path(path).name[len(_PREFIX):])
            saved = loaderstate.read(self.store, got)
            if saved is None:
                raise StateMismatchError(f"step {got} holds no state of the stateful objects (saved without "
                                         "stateful=)")
            loaderstate.load(self.stateful, saved, got)
        return path

    # -- events -------------------------------------------------------------------------------------
    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.output_dir = args.output_dir

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.output_dir = args.output_dir
        self.store  # noqa: B018 - open it now (collective), not inside the first save

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        step = int(state.global_step)
        store = self.store
        store.group.barrier()  # the Trainer's on_save has no barrier: every rank's files are written now
        directory = Path(args.output_dir) / checkpoint_dirname(step)
        rank = store.group.rank
        files: dict[str, Any] = st.Flat((rel, _read(directory / rel)) for rel in _files(directory)  # paths
                                        if _owner(rel) == rank) if directory.is_dir() else st.Flat()
        if self.stateful:  # this rank's objects, taken now: what the Trainer has used up to this step
            files[loaderstate.KEY] = loaderstate.tree(self.stateful, st.Trusted)
        meta = {_META_KEY: {"checkpoint": checkpoint_dirname(step), "version": transformers.__version__}}
        try:
            saved = store.save(step, files, meta, overwrite=True)
        finally:
            files.clear()  # drop the mappings
        if saved:
            self.saved.append(step)
        if self.prune_output_dir and args.should_save:
            self._prune(Path(args.output_dir), step, state.best_model_checkpoint)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._store is not None:
            self._store.wait_until_finished()

    def _prune(self, output_dir: Path, newest: int, best: str | None) -> None:
        held = set(self.store.tiers[0].committed_steps())
        keep_best = os.path.realpath(best) if best else None
        for p in output_dir.glob(f"{_PREFIX}*"):
            tail = p.name[len(_PREFIX):]
            if not tail.isdigit() or int(tail) >= newest or int(tail) in held or not p.is_dir():
                continue
            if keep_best is not None and os.path.realpath(p) == keep_best:
                continue
            log.info("tierfs: removing %s (step %s is no longer on tier %s)", p, tail, self.store.tiers[0].name)
            shutil.rmtree(p, ignore_errors=True)


class TieredMetricsCallback(TrainerCallback):
    """Add this rank's tierfs figures (:func:`tierfs.metrics.latest`: the save stall, each tier's lag and
    time until durable, the RAM tier's use) to every ``logs`` the Trainer reports, so TensorBoard or W&B
    show them next to the loss. Metrics must be on (``TIERFS_METRICS_PORT``, or
    :func:`tierfs.metrics.serve`).

    The Trainer calls its reporting callbacks before the ones it is given, so this one goes first:
    ``TieredMetricsCallback.install(trainer)``.
    """

    @classmethod
    def install(cls, trainer: Any) -> "TieredMetricsCallback":
        """Put a new one first among ``trainer``'s callbacks (before the reporting ones) and return it."""
        cb = cls()
        trainer.callback_handler.callbacks.insert(0, cb)
        return cb

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if logs is not None:
            logs.update(metrics.latest())
