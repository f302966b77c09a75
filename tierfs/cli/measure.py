"""``tierfs bench``: measure the tiers on this machine and write the figures ``plan``/``simulate`` read.

- RAM tier: ``TieredStore([MemoryTier(dir)])``, ``save(step, state, blocking=False)`` (what training waits
  for: the copy into the tier's reused mappings), the commit that follows (checksums, manifest, marker),
  and ``restore_into`` with every block verified. Three warm-up saves come first, so the timed ones copy
  into pages that already exist, as in a training loop.
- Object tier: ``ObjectTier.write_files`` / ``read_files`` of the state cut into 16 MiB files (what the
  store's copies do, without the background throttle) under ``<url>/tierfs-bench-<random>``, removed
  afterwards.
- Peers: under torchrun with ranks on several nodes, a ``PeerTier(replicas=1)`` replication through a
  ``TieredStore`` (unthrottled, from the RAM commit until every copy is verified); with every rank on one
  node, ranks ``2i`` and ``2i+1`` exchange a buffer with torch.distributed (gloo) send/recv instead;
  without torchrun this is skipped with a note.

Figures are medians over the repeats, in GB/s (1e9 bytes/s), per process; the JSON file is::

    {"format": "tierfs-bench", "version": 1, "size_bytes": ..., "repeats": ...,
     "ram": {"save_gbps": ..., "commit_gbps": ..., "restore_gbps": ...},
     "object": {"url": ..., "write_gbps": ..., "read_gbps": ...} or null,
     "peer": {"world_size": ..., "gbps": ..., "method": ...} or null,
     "notes": [...]}
"""

from __future__ import annotations

import os
import shutil
import socket
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

from ..format.blockio import as_u8
from ..errors import FormatError
from ..format import read_json

FORMAT = "tierfs-bench"
VERSION = 1
#: files the object-tier measurement cuts the state into (the store's shard size)
FILE_SIZE = 16 << 20

Progress = Callable[[str], None]


def _state(nbytes: int, seed: int = 0) -> dict[str, np.ndarray]:
    """About ``nbytes`` of float32 arrays in 4 entries (fixed seed; the values do not change the speed)."""
    rng = np.random.default_rng(seed)
    per = max(1, nbytes // 4 // 4)
    return {f"w{i}": np.frombuffer(rng.bytes(per * 4), dtype=np.float32).copy() for i in range(4)}


def _median_rate(nbytes: int, times: list[float]) -> float:
    t = statistics.median(times)
    return nbytes / t / 1e9 if t > 0 else float("inf")


def bench_ram(path: str | os.PathLike | None, nbytes: int, repeats: int = 3, tick: Progress | None = None
              ) -> dict[str, Any]:
    """Time RAM-tier save, commit and restore of ``nbytes`` through a ``TieredStore``.

    Parameters
    ----------
    path : path-like or None
        Directory for the tier (removed afterwards when created here); None: a fresh one in /dev/shm.
    nbytes : int
        Bytes of state.
    repeats : int
        Timed repeats after the warm-up; medians are reported.
    tick : callable, optional
        Called with a label after each save or restore (a progress bar).

    Returns
    -------
    dict
        ``save_gbps``, ``commit_gbps``, ``restore_gbps``, ``path``.
    """
    from ..policies import LatestN
    from ..store import TieredStore
    from ..tiers import MemoryTier

    made = path is None
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    root = Path(tempfile.mkdtemp(prefix="tierfs-bench-", dir=base)) if made else Path(path)  # type: ignore[arg-type]
    state = _state(nbytes)
    total = sum(a.nbytes for a in state.values())
    target = {k: np.empty_like(v) for k, v in state.items()}
    saves, commits, restores = [], [], []
    try:
        with TieredStore([MemoryTier(root, keep=LatestN(1))], background_bandwidth=None) as store:
            step = max(store.steps(), default=-1) + 1
            for i in range(3 + repeats):
                t0 = time.perf_counter()
                store.save(step + i, state, blocking=False)
                t1 = time.perf_counter()
                store.wait_until_finished()
                t2 = time.perf_counter()
                if i >= 3:
                    saves.append(t1 - t0)
                    commits.append(t2 - t0)
                if tick:
                    tick("ram save")
            for _ in range(repeats):
                t0 = time.perf_counter()
                store.restore_into(target)
                restores.append(time.perf_counter() - t0)
                if tick:
                    tick("ram restore")
        if not all(np.array_equal(target[k].view(np.uint8), state[k].view(np.uint8)) for k in state):
            raise FormatError("RAM-tier benchmark: restored bytes differ from the saved ones")
    finally:
        if made:
            shutil.rmtree(root, ignore_errors=True)
    return {"path": str(root), "save_gbps": _median_rate(total, saves),
            "commit_gbps": _median_rate(total, commits), "restore_gbps": _median_rate(total, restores)}


def bench_object(url: str, storage_options: Mapping[str, Any], nbytes: int, repeats: int = 3,
                 tick: Progress | None = None) -> dict[str, Any]:
    """Time upload and download of ``nbytes`` in 16 MiB files under ``<url>/tierfs-bench-<random>``.

    Parameters
    ----------
    url : str
        An fsspec URL the object tier would use (``s3://bucket/run``).
    storage_options : mapping
        Passed to fsspec unchanged.
    nbytes, repeats, tick
        As for :func:`bench_ram`.

    Returns
    -------
    dict
        ``write_gbps``, ``read_gbps``, ``url``. Everything written is removed, also on failure.
    """
    from ..tiers import ObjectTier

    scratch = f"{url.rstrip('/')}/tierfs-bench-{uuid.uuid4().hex[:12]}"
    tier = ObjectTier(scratch, storage_options, name="bench")
    rng = np.random.default_rng(1)
    files: dict[str, Any] = {}
    left, i = nbytes, 0
    while left > 0:
        n = min(FILE_SIZE, left)
        files[f"part.{i:04d}.bin"] = rng.bytes(n)
        left -= n
        i += 1
    total = sum(len(b) for b in files.values())
    writes, reads = [], []
    try:
        tier.open()
        for r in range(repeats):
            t0 = time.perf_counter()
            tier.write_files(r, files)
            writes.append(time.perf_counter() - t0)
            if tick:
                tick("object upload")
            t0 = time.perf_counter()
            got = tier.read_files(r, list(files))
            reads.append(time.perf_counter() - t0)
            if any(as_u8(got[k]).tobytes() != v for k, v in files.items()):
                raise FormatError(f"object-tier benchmark: bytes read back from {scratch} differ")
            del got
            tier.delete_step(r)  # keep at most one copy on the store
            if tick:
                tick("object download")
    finally:
        try:
            tier.fs.rm(tier.root, recursive=True)
        except (FileNotFoundError, OSError):
            pass
        tier.close()
    return {"url": url, "write_gbps": _median_rate(total, writes), "read_gbps": _median_rate(total, reads)}


def bench_peer(nbytes: int, repeats: int = 3, tick: Progress | None = None) -> dict[str, Any] | None:
    """Time a gloo send/recv between rank pairs when run under torchrun; None otherwise.

    Ranks ``2i`` and ``2i+1`` exchange ``nbytes`` each way; an odd last rank waits. Every rank returns the
    median over all ranks that took part (the same dict everywhere).
    """
    if int(os.environ.get("WORLD_SIZE", "1")) < 2:
        return None
    import torch
    import torch.distributed as dist

    own = not dist.is_initialized()
    if own:
        dist.init_process_group("gloo")
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        from ..ranks import env_node_rank

        nodes: list[int] = [0] * world
        dist.all_gather_object(nodes, env_node_rank(rank))
        if len(set(nodes)) > 1:
            return _bench_replication(nbytes, repeats, tick)
        buf = torch.zeros(max(1, nbytes), dtype=torch.uint8)
        peer = rank ^ 1
        times: list[float] = []
        for _ in range(1 + repeats):
            dist.barrier()
            t0 = time.perf_counter()
            if peer < world:
                if rank % 2 == 0:
                    dist.send(buf, peer)
                    dist.recv(buf, peer)
                else:
                    dist.recv(buf, peer)
                    dist.send(buf, peer)
            times.append(time.perf_counter() - t0)
            if tick:
                tick("peer transfer")
        mine = [2 * buf.numel() / t / 1e9 for t in times[1:]] if peer < world else []  # both directions
        every: list[list[float]] = [[] for _ in range(world)]
        dist.all_gather_object(every, mine)
        rates = [r for rs in every for r in rs]
        return {"world_size": world, "gbps": statistics.median(rates), "method": "gloo send/recv, rank pairs"}
    finally:
        if own:
            dist.destroy_process_group()


def _bench_replication(nbytes: int, repeats: int, tick: Progress | None) -> dict[str, Any]:
    """Median GB/s of this job's ``PeerTier`` replication of ``nbytes`` per rank (every rank's median)."""
    import logging

    import torch.distributed as dist

    from ..policies import LatestN
    from ..store import TieredStore
    from ..tiers import MemoryTier, PeerTier

    seconds: dict[int, float] = {}

    class Timing(logging.Handler):  # the store's own measure: commit -> every copy verified
        def emit(self, record: logging.LogRecord) -> None:
            if record.msg.startswith("step %d replicated to peers"):
                args: Any = record.args  # (step, bytes, seconds) of the log line: numbers
                seconds[int(args[0])] = float(args[2])

    handler = Timing()
    logger = logging.getLogger("tierfs")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    root = tempfile.mkdtemp(prefix="tierfs-bench-peer-", dir=base)
    state = _state(nbytes, seed=dist.get_rank())
    total = sum(a.nbytes for a in state.values())
    try:
        with TieredStore([MemoryTier(root, keep=LatestN(1)), PeerTier(replicas=1)],
                         background_bandwidth=None) as store:
            for step in range(2 + repeats):  # two warm-up steps: replica buffers get mapped, then reused
                store.save(step, state)
                store.wait_until_finished()
                if tick:
                    tick("peer replication")
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        shutil.rmtree(root, ignore_errors=True)
    mine = [total / seconds[s] / 1e9 for s in range(2, 2 + repeats) if seconds.get(s)]
    every: list[list[float]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(every, mine)
    rates = [r for rs in every for r in rs]
    return {"world_size": dist.get_world_size(), "gbps": statistics.median(rates),
            "method": "tierfs PeerTier replication (replicas=1), per rank"}


def run(*, size: int, repeats: int = 3, ram_dir: str | None = None, object_url: str | None = None,
        storage_options: Mapping[str, Any] | None = None, tick: Progress | None = None) -> dict[str, Any]:
    """Every measurement the options ask for, as the JSON-able dict ``tierfs bench`` writes."""
    if size < 1 or repeats < 1:
        raise ValueError("size and repeats must be positive")
    notes: list[str] = []
    out: dict[str, Any] = {"format": FORMAT, "version": VERSION, "host": socket.gethostname(),
                           "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "size_bytes": size,
                           "repeats": repeats}
    out["ram"] = bench_ram(ram_dir, size, repeats, tick)
    if object_url:
        out["object"] = bench_object(object_url, storage_options or {}, size, repeats, tick)
    else:
        out["object"] = None
        notes.append("object tier skipped: give --object URL (and -o storage options)")
    out["peer"] = bench_peer(size, repeats, tick)
    if out["peer"] is None:
        notes.append("peer transfer skipped: run under torchrun with 2 or more processes to measure it")
    out["notes"] = notes
    return out


def steps_for(repeats: int, object_url: str | None) -> int:
    """How many ticks :func:`run` makes (for a progress bar's total)."""
    n = 3 + 2 * repeats
    if object_url:
        n += 2 * repeats
    if int(os.environ.get("WORLD_SIZE", "1")) >= 2:
        n += 1 + repeats
    return n


def load(path: str | os.PathLike) -> dict[str, Any]:
    """Read a ``tierfs bench`` JSON file; FormatError if it is not one."""
    data = read_json(path, f"bench file {path}",
                     missing=f"bench file {path} does not exist; write one with 'tierfs bench --out {path}'")
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise FormatError(f"bench file {path} was not written by 'tierfs bench'")
    if data.get("version") != VERSION:
        raise FormatError(f"bench file {path}: version {data.get('version')!r}, this tierfs reads {VERSION}")
    return data


def bandwidths(data: Mapping[str, Any]) -> dict[str, float]:
    """Per-host bandwidths in bytes/s for :class:`tierfs.planning.PlanInputs` from a bench dict."""
    out: dict[str, float] = {}
    ram = data.get("ram") or {}
    if ram.get("save_gbps"):
        out["ram_save"] = float(ram["save_gbps"]) * 1e9
    if ram.get("restore_gbps"):
        out["ram_restore"] = float(ram["restore_gbps"]) * 1e9
    obj = data.get("object") or {}
    if obj.get("write_gbps"):
        out["object_write"] = float(obj["write_gbps"]) * 1e9
    if obj.get("read_gbps"):
        out["object_read"] = float(obj["read_gbps"]) * 1e9
    peer = data.get("peer") or {}
    if peer.get("gbps"):
        out["peer"] = float(peer["gbps"]) * 1e9
    return out
