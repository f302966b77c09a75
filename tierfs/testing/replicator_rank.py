"""One rank of the job :class:`~tierfs.testing.ReplicatorTests` runs (started by
:func:`tierfs.testing.launch.run_job`, each rank its own node):

    python -m tierfs.testing.replicator_rank '{"factory": "pkg.mod:make", "corrupt": "...", "root": "/dev/shm/x"}'

Every rank saves two steps of its own state to a RAM tier of its node (``ROOT/node<N>``), binds a
replicator built by the factory to it and exercises it; it prints, as its JSON line, what it observed
(what the replicator reported and whether fetched shards were bit-exact). The suite's tests check it.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from dataclasses import replace
from typing import Any, Callable

import numpy as np

from ..format import MARKER, Manifest, Marker, manifest_filename
from ..tiers import MemoryTier, Tier
from ..tiers._wire import LAND_MIN, lands
from ..tiers.base import Replicator
from .launch import rank_main
from .states import assert_states_equal

#: the RAM tier's budget on every node: the job needs a few MB
BUDGET = 64 << 20
#: the step whose shard rank 0 loses and fetches back (step 1 is only replicated and deleted)
STEP = 2
#: the rank that loses its shard
LOST = 0

Shard = tuple[bytes, bytes, dict[str, np.ndarray]]


def resolve(name: str) -> Callable[..., Any]:
    """The callable ``"package.module:function"`` names."""
    module, sep, attr = name.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"{name!r} is not of the form 'package.module:function'")
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    if not callable(obj):
        raise TypeError(f"{name!r} is not callable")
    return obj


def corrupt_local_copy(replicator: Any, step: int, source: int) -> None:
    """Flip one byte of the copy of ``source``'s shard of ``step`` that ``replicator`` keeps, in the middle
    of its first non-empty array, rewriting the file through the tier in ``replicator.local`` (where the
    peer tier keeps its copies). The default ``corrupt`` of :class:`~tierfs.testing.ReplicatorTests`."""
    local = getattr(replicator, "local", None)
    if not isinstance(local, Tier):
        raise TypeError(f"{type(replicator).__name__} keeps no copies in a .local tier: give ReplicatorTests "
                        "a corrupt function of your own ('package.module:function')")
    m = Manifest.from_bytes(bytes(local.read_file(step, manifest_filename(source))))
    e = next(e for e in m.entries if e.kind == "array" and e.length > 0)
    data = bytearray(bytes(local.read_file(step, e.file)))
    data[e.offset + e.length // 2] ^= 0x40
    local.write_file(step, e.file, bytes(data))


def state_for(rank: int, step: int) -> dict[str, Any]:
    """A rank's state: a few hundred KB over several shard files, one array large enough that a restore
    lands it in its own array (``big``), an empty array and a scalar."""
    rng = np.random.default_rng(100 * rank + step)
    return {"w": rng.standard_normal(60_000 + 1000 * rank).astype(np.float32),
            "big": rng.integers(0, 255, LAND_MIN + 4096 + rank, dtype=np.uint8),
            "b": rng.integers(0, 255, 5000 + rank, dtype=np.uint8), "empty": np.zeros(0, np.float64),
            "h": rng.standard_normal((300, 7)).astype(np.float16), "step": step}


def read_shard(ram: MemoryTier, step: int, rank: int) -> Shard:
    """``rank``'s shard of ``step`` in the RAM tier: marker, manifest bytes and files (copies)."""
    marker = bytes(ram.read_file(step, MARKER))
    mbytes = bytes(ram.read_file(step, manifest_filename(rank)))
    files = {n: np.array(ram.read_file(step, n), dtype=np.uint8) for n in Manifest.from_bytes(mbytes).files}
    return marker, mbytes, files


def seen(rep: Replicator) -> dict[str, Any]:
    """What the replicator reports of the copies it keeps (JSON: steps as strings)."""
    return {"list": {str(s): ok for s, ok in rep.list_steps().items()},
            "holdings": {str(s): ranks for s, ranks in rep.holdings().items()},
            "committed": rep.committed_steps()}


def fetched(got: Any, want: Shard | None = None) -> dict[str, Any]:
    """What ``fetch`` returned: ``kind`` ("shard", "reason", "none" or the type's name), the reason, and
    whether a shard is ``want``, bit for bit."""
    if got is None:
        return {"kind": "none"}
    if isinstance(got, str):
        return {"kind": "reason", "why": got}
    if not isinstance(got, tuple) or len(got) != 4:
        return {"kind": type(got).__name__}
    out: dict[str, Any] = {"kind": "shard", "exact": False}
    if want is not None:
        manifest, mbytes, marker, files = got
        try:
            assert isinstance(manifest, Manifest), f"manifest is a {type(manifest).__name__}"
            assert manifest == Manifest.from_bytes(want[1]), "the manifest differs"
            assert mbytes == want[1], "the manifest's bytes differ"
            # the holder's own marker of the step: the same but for the time its rank committed
            mine, theirs = Marker.from_bytes(want[0]), Marker.from_bytes(marker)
            assert replace(theirs, committed=mine.committed) == mine, f"marker {theirs} != {mine}"
            assert_states_equal(want[2], {n: np.asarray(f) for n, f in files.items()}, key_order=True)
            out["exact"] = True
        except AssertionError as e:
            out["why"] = str(e)
    return out


def landed_into(got: Any, arrays: dict[str, np.ndarray], want: Shard) -> dict[str, Any]:
    """What a ``fetch`` given a landing returned: as :func:`fetched`, with ``landed``, the entries the landing
    named, and ``exact``, whether each holds its bytes and every other entry is bit-exact in the files."""
    out = fetched(got)
    if out["kind"] != "shard":
        return out
    m, files = got[0], got[3]
    out.update(landed=sorted(arrays), exact=True)
    for e in m.entries:
        if e.kind == "array":
            where = arrays[e.name] if e.name in arrays else np.asarray(files[e.file])[e.offset:e.offset + e.length]
            if where.tobytes() != want[2][e.file][e.offset:e.offset + e.length].tobytes():
                out.update(exact=False, why=f"entry {e.name!r} differs")
    return out


def run(config: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist

    from ..ranks import TorchGroup
    from ..store import TieredStore

    dist.init_process_group("gloo")
    group = TorchGroup()
    rank, world = group.rank, group.world_size
    ram = MemoryTier(os.path.join(config["root"], f"node{os.environ['TIERFS_NODE_RANK']}"), budget=BUDGET)
    store = TieredStore([ram], group=group, file_size=128 << 10, block_size=16 << 10)
    for step in (1, STEP):
        store.save(step, state_for(rank, step))
    store.close()  # the RAM tier keeps its files; its buffers and background work are gone
    shards = {step: read_shard(ram, step, rank) for step in (1, STEP)}

    rep = resolve(config["factory"])()
    if not isinstance(rep, Replicator):
        raise TypeError(f"{config['factory']} returned a {type(rep).__name__}, not a Replicator")
    rep.bind(ram, group)
    rep.open()
    targets = [list(t) for t in rep.targets]
    out: dict[str, Any] = {"rank": rank, "world": world, "targets": targets, "before": seen(rep)}
    out["failed"] = [[list(f) for f in rep.replicate(step, *shards[step])] for step in (1, STEP)]
    out["replicated"] = seen(rep)
    out["capacity"] = {name: [c.used, c.budget, c.free is not None]
                       for name, c in (("replicator", rep.capacity()), ("ram", ram.capacity()))}

    holder = targets[LOST][0]
    if rank == LOST:  # the node lost its shard
        ram.delete_step(STEP)
    out["fetch"] = fetched(rep.fetch(STEP, {LOST: holder}), shards[STEP] if rank == LOST else None)
    arrays: dict[str, np.ndarray] = {}

    def landing(m: Manifest) -> dict[str, np.ndarray]:  # as a restore's: an array for each entry moved apart
        arrays.update({e.name: np.zeros(e.length, np.uint8) for e in m.entries if lands(e)})
        return arrays
    got = rep.fetch(STEP, {LOST: holder}, landing=landing if rank == LOST else None)
    out["fetch_landed"] = landed_into(got, arrays, shards[STEP]) if rank == LOST else fetched(got)
    others = [r for r in range(world) if r != LOST and r not in targets[LOST]]
    if others:  # a rank that keeps no copy of the lost shard is asked for it
        out["fetch_missing"] = fetched(rep.fetch(STEP, {LOST: others[0]}))
    if rank == holder:  # before it takes part in the next fetch
        resolve(config["corrupt"])(rep, STEP, LOST)
    out["fetch_corrupt"] = fetched(rep.fetch(STEP, {LOST: holder}))

    rep.delete_step(1)
    out["deleted_1"] = seen(rep)
    rep.delete_step(STEP)
    out["deleted_both"] = seen(rep)
    out["ram"] = {str(s): ok for s, ok in ram.list_steps().items()}
    rep.close()
    ram.close()
    return out


if __name__ == "__main__":
    rank_main(lambda: run(json.loads(sys.argv[1])))
