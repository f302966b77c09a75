"""The files of a Megatron checkpoint directory beside the sharded tensors, and the step a directory names.

``dist_checkpointing.save`` has rank 0 write ``common.pt`` (the state that is not sharded: the iteration,
the arguments, the optimizer's param groups, ...) into the directory before the sharded strategy runs, and
``metadata.json`` (the backend that saved it) after. :class:`~tierfs.adapters.megatron.TieredSaveStrategy`
puts both into the step as two bytes items of rank 0 (:data:`COMMON_FQN`, :data:`CONFIG_FQN`), so the step
is the whole checkpoint; :meth:`~tierfs.adapters.megatron.TieredLoadStrategy.materialize` writes them back
into a directory on every node before ``dist_checkpointing.load`` reads them there.
"""

from __future__ import annotations

import base64
import dataclasses
import io
import json
import os
import re
from typing import Any, Mapping

from megatron.core.dist_checkpointing.core import CONFIG_FNAME, CheckpointingConfig
from megatron.core.dist_checkpointing.strategies.common import COMMON_STATE_FNAME

from ...util.fileio import atomic_write
from ...errors import ArgumentError, FormatError, TierfsError
from ...store import TieredStore

#: DCP bytes items of rank 0's shard: the bytes of Megatron's ``common.pt`` and ``metadata.json``
COMMON_FQN = "tierfs.megatron/" + COMMON_STATE_FNAME
CONFIG_FQN = "tierfs.megatron/" + CONFIG_FNAME
FILES = {COMMON_FQN: COMMON_STATE_FNAME, CONFIG_FQN: CONFIG_FNAME}

#: Megatron-LM's names: ``<root>/iter_0000100`` and the tracker file ``<root>/latest_checkpointed_iteration.txt``
DIR_NAME = "iter_{:07d}"
TRACKER = "latest_checkpointed_iteration.txt"

_STEP = re.compile(r"(\d+)$")


def step_of(checkpoint_dir: Any) -> int:
    """The step a checkpoint directory names: the number its last component ends with (``iter_0000100``: 100).

    Raises
    ------
    ArgumentError
        When the name ends without a number.
    """
    try:
        path = os.fspath(checkpoint_dir)
    except TypeError:
        raise ArgumentError(f"checkpoint_dir must be a path, got {type(checkpoint_dir).__name__}") from None
    m = _STEP.search(os.path.basename(os.path.normpath(str(path))))
    if m is None:
        raise ArgumentError(f"checkpoint_dir {str(path)!r} names no step: end its name with the iteration, "
                            "as Megatron-LM's iter_0000100 does")
    return int(m.group(1))


def side_items(checkpoint_dir: Any, backend: str, version: int) -> dict[str, io.BytesIO]:
    """On rank 0: ``common.pt`` as ``save_common`` just wrote it into ``checkpoint_dir`` (when it did), and the
    ``metadata.json`` Megatron writes once the save is finalized, as DCP bytes items."""
    out: dict[str, io.BytesIO] = {}
    path = os.path.join(os.fspath(checkpoint_dir), COMMON_STATE_FNAME)
    if os.path.isfile(path):
        with open(path, "rb") as f:
            out[COMMON_FQN] = io.BytesIO(f.read())
    config = json.dumps(dataclasses.asdict(CheckpointingConfig(backend, version)))
    out[CONFIG_FQN] = io.BytesIO(config.encode())
    return out


def read_side(store: TieredStore, step: int, storage: Mapping[Any, Any], tiers: list[str] | None,
              timeout: Any) -> dict[str, bytes]:
    """``{file name: bytes}`` of the step's side files (collective over the store's ranks).

    Each rank reads them from the fastest tier holding rank 0's shard; a rank whose tiers lack it (RAM
    tiers on several nodes) gets them from a rank that read them.
    """
    places = {k.fqn: (int(v["rank"]), str(v["entry"])) for k, v in storage.items() if k.fqn in FILES}
    got: dict[str, bytes] | None = {}
    err: BaseException | None = None
    try:
        for fqn, (rank, entry) in places.items():
            def consume(found: Mapping[str, tuple[Any, Any]], tier: str, fqn: str = fqn, entry: str = entry) -> None:
                assert got is not None
                got[FILES[fqn]] = found[entry][1].tobytes()
            store.read_entries(step, rank, [entry], tiers=tiers, consume=consume)
    except (TierfsError, OSError) as e:
        got, err = None, e
    g = store.group if timeout is None else store.group.with_timeout(timeout)
    if g.world_size > 1:
        have = g.all_gather(got is not None)
        if any(have) and not all(have):
            src = have.index(True)
            mine = {k: base64.b64encode(v).decode() for k, v in got.items()} if got is not None else None
            shared = g.all_gather(mine if g.rank == src else None)[src]
            if got is None:
                got, err = {k: base64.b64decode(v) for k, v in shared.items()}, None
    if got is None:
        assert err is not None
        raise err
    if CONFIG_FNAME not in got:
        raise FormatError(f"step {step} was not saved by TieredSaveStrategy (it has no {CONFIG_FNAME})")
    return got


def write_dir(root: Any, step: int, files: Mapping[str, bytes]) -> str:
    """Write ``files`` into ``<root>/iter_<step>`` and ``step`` into ``<root>``'s tracker file (each file whole,
    through a temporary name: ranks sharing ``root`` may write at once); returns the directory."""
    directory = os.path.join(os.fspath(root), DIR_NAME.format(step))
    os.makedirs(directory, exist_ok=True)
    for name, data in files.items():
        atomic_write(os.path.join(directory, name), data)
    atomic_write(os.path.join(os.fspath(root), TRACKER), str(step).encode())
    return directory
