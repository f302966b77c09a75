"""TieredStore: one checkpoint store over several tiers, fastest first.

Save: flatten the state → copy it, with crc32c per block, into the first tier's staged buffers (the RAM
tier's reused mappings) → write the manifest → commit with the marker. Then, in one background worker,
each slower tier whose save policy takes the step gets a byte copy of the files (verified before upload,
marker last), and every tier applies its keep policy.

Restore: list what each tier holds → pick the newest step → read this rank's files from the fastest
tier whose copy verifies → copy once into the user's arrays. Every tier skipped, and why, is in the info.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from . import _copy, state as st
from .dist import SingleProcess, TorchGroup, default_group
from .errors import (BackgroundError, ChecksumError, FormatError, RestoreError, StateMismatchError,
                     StepExistsError, StepNotFoundError, TierfsError)
from .format import (DEFAULT_BLOCK_SIZE, DEFAULT_FILE_SIZE, MARKER, Entry, Manifest, Marker, crc32c,
                     manifest_filename, plan_files)
from .policies import SaveContext, StepInfo
from .tiers.base import Tier

log = logging.getLogger("tierfs")


@dataclass
class RestoreInfo:
    """What a restore did: which tier served which step, what was skipped and why, and how fast."""

    step: int
    tier: str
    nbytes: int
    seconds: float
    skipped: list[tuple[str, int, str]] = field(default_factory=list)  # (tier, step, reason)
    metadata: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)
    unused: list[str] = field(default_factory=list)  # entries in the checkpoint not in the target state

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")

    def __str__(self) -> str:
        s = f"step {self.step} from tier {self.tier!r}: {self.nbytes / 1e6:.1f} MB in {self.seconds:.3f}s"
        for tier, step, why in self.skipped:
            s += f"; skipped {tier!r} step {step}: {why}"
        return s


class TieredStore:
    """A checkpoint store over ``tiers``, given fastest first (e.g. RAM, then object storage).

    Parameters
    ----------
    tiers:
        The tiers, fastest first. ``save`` returns once the first holds a committed copy.
    group:
        The ranks of the job; by default a single process, or torch.distributed when initialised.
    threads:
        Threads for copying and checksumming on the save/restore path (default: up to 4).
    file_size, block_size:
        Shard files hold about ``file_size`` bytes; crc32c covers blocks of ``block_size`` bytes.
    clock:
        Time source for time-based policies (tests inject one).
    cleanup:
        Remove uncommitted steps (left by a crash) when the store opens. A process that only reads while
        another one saves to the same tiers (an evaluation job) must pass ``cleanup=False``.
    """

    def __init__(self, tiers: Sequence[Tier], *, group: SingleProcess | TorchGroup | None = None,
                 threads: int | None = None, file_size: int = DEFAULT_FILE_SIZE,
                 block_size: int = DEFAULT_BLOCK_SIZE, clock: Callable[[], float] = time.time,
                 cleanup: bool = True) -> None:
        tiers = list(tiers)
        if not tiers:
            raise ValueError("TieredStore needs at least one tier, e.g. [MemoryTier(...), ObjectTier(url)]")
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"tier names must be unique, got {names}; pass name=... to tell them apart")
        self.tiers = tiers
        self.group = group if group is not None else default_group()
        self.threads = threads
        self.file_size, self.block_size = int(file_size), int(block_size)
        self._clock = clock
        self._lock = threading.RLock()
        self._index: dict[str, set[int]] = {}  # tier -> committed steps (this process's view)
        self._history: dict[str, list[StepInfo]] = {t.name: [] for t in tiers}
        self._info: dict[int, StepInfo] = {}
        self._pins: dict[str, dict[int, int]] = {t.name: {} for t in tiers}  # steps being read from a tier
        self._transient: set[int] = set()  # steps staged in the first tier only to be copied on
        self._errors: list[BaseException] = []
        self._queue: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._worker: threading.Thread | None = None
        self._closed = False
        for t in tiers:
            t.open()
        if cleanup:
            self._cleanup_uncommitted()
        self.refresh()

    # -- bookkeeping --------------------------------------------------------------------------------
    def refresh(self) -> None:
        """Re-list every tier (steps written by other processes become visible)."""
        with self._lock:
            for t in self.tiers:
                self._index[t.name] = set(t.committed_steps())
                known = {i.step for i in self._history[t.name]}
                self._history[t.name] += [StepInfo(s) for s in sorted(self._index[t.name] - known)]
                self._history[t.name].sort(key=lambda i: i.step)

    def _owns(self, tier: Tier) -> bool:
        """Whether this rank commits and deletes whole steps on ``tier``."""
        return (self.group.local_rank if tier.is_local else self.group.rank) == 0

    def _cleanup_uncommitted(self) -> None:
        for t in self.tiers:
            if self._owns(t):
                for s, ok in t.list_steps().items():
                    if not ok:
                        log.info("tier %s: removing uncommitted step %d left by an interrupted save", t.name, s)
                        t.delete_step(s)
        self.group.barrier()

    def steps(self) -> dict[int, list[str]]:
        """``{step: [names of tiers holding a committed copy]}``, newest last."""
        self.refresh()
        out: dict[int, list[str]] = {}
        for t in self.tiers:
            for s in sorted(self._index[t.name]):
                out.setdefault(s, []).append(t.name)
        return dict(sorted(out.items()))

    def latest_step(self) -> int | None:
        steps = self.steps()
        return max(steps) if steps else None

    def tier(self, name: str) -> Tier:
        for t in self.tiers:
            if t.name == name:
                return t
        raise KeyError(f"no tier named {name!r}; tiers are {[t.name for t in self.tiers]}")

    # -- save ---------------------------------------------------------------------------------------
    def should_save(self, step: int, *, force: bool = False) -> list[Tier]:
        """The tiers whose save policy takes ``step`` (all of them with ``force``)."""
        now = self._clock()
        with self._lock:
            return [t for t in self.tiers if force or t.save_policy.should_save(
                SaveContext(step=step, time=now, previous=tuple(self._history[t.name])))]

    def save(self, step: int, state: Mapping[str, Any], metadata: Mapping[str, Any] | None = None, *,
             metrics: Mapping[str, Any] | None = None, force: bool = False, overwrite: bool = False) -> bool:
        """Save ``state`` as ``step`` to the tiers whose policies take it; False when none does.

        Returns once the first tier holds a committed copy; slower tiers are written in the background.
        Raises any error a background copy hit since the last call.
        """
        self._check_open()
        self.raise_background_errors()
        chosen = self.should_save(step, force=force)
        if not chosen:
            return False
        fast = self.tiers[0]
        with self._lock:
            holders = [t.name for t in self.tiers if step in self._index[t.name]]
        if holders and not overwrite:
            raise StepExistsError(f"step {step} is already committed on {holders}; pass overwrite=True to "
                                  "replace it or save a new step")
        if holders:
            self.wait_until_finished()
            for name in holders:
                self._delete(self.tier(name), step)
        t0 = time.perf_counter()
        leaves = [st.to_leaf(n, v) for n, v in st.flatten(state)]
        manifest, marker = self._write_first(fast, step, leaves, metadata, metrics)
        now = self._clock()
        info = StepInfo(step, now, dict(metrics or {}))
        with self._lock:
            self._info[step] = info
            self._index[fast.name].add(step)
            if fast in chosen:
                self._history[fast.name].append(info)
            else:
                self._transient.add(step)
        log.debug("step %d committed on %s: %.1f MB in %.3fs", step, fast.name, manifest.nbytes / 1e6,
                  time.perf_counter() - t0)
        slow = [t for t in chosen if t is not fast]
        for t in slow:
            self._pin(fast, step)
            self._submit(lambda t=t: self._copy_step(step, fast, t, marker))
        self._apply_retention(fast)
        return True

    def _write_first(self, fast: Tier, step: int, leaves: list[st.Leaf], metadata, metrics
                     ) -> tuple[Manifest, Marker]:
        rank, world = self.group.rank, self.group.world_size
        arrays = [lf for lf in leaves if lf.kind == "array"]
        placement, files = plan_files([lf.nbytes for lf in arrays], rank, self.file_size)
        bufs = fast.stage(step, files)  # raises CapacityError before anything is written
        try:
            jobs = [_copy.Job(lf.name, lf.data, bufs[f][o:o + lf.nbytes], self.block_size)
                    for lf, (f, o) in zip(arrays, placement)]
            crcs = iter(_copy.run(jobs, self.threads))
            where = iter(placement)
            entries = []
            for lf in leaves:
                if lf.kind == "json":
                    entries.append(Entry(lf.name, "json", value=lf.value))
                else:
                    f, o = next(where)
                    entries.append(Entry(lf.name, "array", lf.lib, lf.dtype, list(lf.shape), f, o, lf.nbytes,
                                         next(crcs)))
            manifest = Manifest(step, rank, world, entries, files, self.block_size,
                                metadata=_jsonable(metadata, "metadata"), metrics=_jsonable(metrics, "metrics"))
            fast.write_staged(step)
            mbytes = manifest.to_bytes()
            fast.write_file(step, manifest_filename(rank), mbytes)
            _check_complete(fast, step, {**files, manifest_filename(rank): len(mbytes)})
        except BaseException:
            fast.discard_staged(step)
            raise
        parts = self.group.all_gather([manifest_filename(rank), crc32c(mbytes), manifest.nbytes])
        marker = Marker(step, world, {n: c for n, c, _ in parts}, nbytes=sum(b for _, _, b in parts))
        if self._owns(fast):
            _check_complete(fast, step, {n: None for n in marker.manifests})
            fast.write_marker(step, marker.to_bytes())
        self.group.barrier()
        return manifest, marker

    # -- background ---------------------------------------------------------------------------------
    def _submit(self, fn: Callable[[], None]) -> None:
        if self._worker is None:
            self._worker = threading.Thread(target=self._run_worker, name="tierfs-store", daemon=True)
            self._worker.start()
        self._queue.put(fn)

    def _run_worker(self) -> None:
        while True:
            fn = self._queue.get()
            try:
                if fn is None:
                    return
                fn()
            except BaseException as e:  # noqa: BLE001 - kept and raised by the next call
                log.error("tierfs background work failed: %s", e)
                with self._lock:
                    self._errors.append(e)
            finally:
                self._queue.task_done()

    def raise_background_errors(self) -> None:
        """Raise the first error background work hit since the last call, if any."""
        with self._lock:
            errors, self._errors = self._errors, []
        if errors:
            more = f" (and {len(errors) - 1} more, see the log)" if len(errors) > 1 else ""
            raise BackgroundError(f"background copy failed: {errors[0]}{more}") from errors[0]

    def wait_until_finished(self) -> None:
        """Block until every background copy and deletion is done; raise the first failure."""
        if self._worker is not None:
            self._queue.join()
        self.raise_background_errors()

    def _pin(self, tier: Tier, step: int) -> None:
        with self._lock:
            pins = self._pins[tier.name]
            pins[step] = pins.get(step, 0) + 1

    def _unpin(self, tier: Tier, step: int) -> None:
        with self._lock:
            pins = self._pins[tier.name]
            pins[step] -= 1
            if not pins[step]:
                del pins[step]

    def _copy_step(self, step: int, src: Tier, dst: Tier, marker: Marker) -> None:
        """Byte copy of this rank's files from ``src`` to ``dst``, verified before upload, marker last."""
        try:
            t0 = time.perf_counter()
            mname = manifest_filename(self.group.rank)
            mbytes = bytes(src.read_file(step, mname))
            manifest = Manifest.from_bytes(mbytes)
            files = src.read_files(step, list(manifest.files))
            _verify(manifest, files, self.threads)  # a damaged RAM copy must not become the durable one
            dst.write_files(step, files)
            dst.write_file(step, mname, mbytes)
            _check_complete(dst, step, {**manifest.files, mname: len(mbytes)})
            del files
            self.group.barrier()
            if self._owns(dst):
                _check_complete(dst, step, {n: None for n in marker.manifests})
                dst.write_marker(step, marker.to_bytes())
            self.group.barrier()
            with self._lock:
                self._index[dst.name].add(step)
                self._history[dst.name].append(self._info.get(step, StepInfo(step)))
            log.info("step %d copied %s -> %s: %.1f MB in %.2fs", step, src.name, dst.name,
                     manifest.nbytes / 1e6, time.perf_counter() - t0)
        finally:
            self._unpin(src, step)
        self._apply_retention(dst)
        self._retire_transient(step)
        self._apply_retention(src)

    def _retire_transient(self, step: int) -> None:
        """A step staged in the first tier only for slower tiers leaves once they all have it."""
        fast = self.tiers[0]
        with self._lock:
            if step not in self._transient or self._pins[fast.name].get(step):
                return
            self._transient.discard(step)
            elsewhere = any(step in self._index[t.name] for t in self.tiers[1:])
        if elsewhere:
            self._delete(fast, step)

    # -- retention ----------------------------------------------------------------------------------
    def _apply_retention(self, tier: Tier) -> None:
        with self._lock:
            committed = sorted(self._index[tier.name] - self._transient)
            if not committed:
                return
            keep = tier.keep_policy.keep([self._info.get(s, StepInfo(s)) for s in committed])
            newest = max(max(s) for s in self._index.values() if s)
            doomed = []
            for s in committed:
                if s in keep or self._pins[tier.name].get(s):
                    continue
                if s == newest and not any(s in self._index[t.name] for t in self.tiers if t is not tier):
                    continue  # never the only copy of the newest step
                doomed.append(s)
        for s in doomed:
            log.debug("tier %s: retention deletes step %d", tier.name, s)
            self._delete(tier, s)

    def _delete(self, tier: Tier, step: int) -> None:
        with self._lock:  # claim the step so two threads never delete it at once
            if step not in self._index[tier.name]:
                return
            self._index[tier.name].discard(step)
            self._history[tier.name] = [i for i in self._history[tier.name] if i.step != step]
        if self._owns(tier):
            tier.delete_step(step)

    def delete(self, step: int, tiers: Sequence[str] | None = None) -> None:
        """Delete ``step`` from the named tiers (default: all)."""
        self.wait_until_finished()
        for t in self.tiers:
            if tiers is None or t.name in tiers:
                self._delete(t, step)

    # -- restore ------------------------------------------------------------------------------------
    def restore(self, step: int | None = None, *, tiers: Sequence[str] | None = None,
                zero_copy: bool = False) -> tuple[dict[str, Any], RestoreInfo]:
        """Read a step (default: the newest) into new arrays/tensors; returns ``(state, info)``.

        With ``zero_copy=True`` arrays served by the RAM tier are read-only views of its files.
        """
        out: dict[str, Any] = {}

        def sink(e: Entry, tier: Tier) -> tuple[np.ndarray | None, Callable[[], None]]:
            if zero_copy and tier.zero_copy:
                return None, lambda: None
            obj, raw = st.allocate(e.lib, e.dtype, e.shape)
            out[e.name] = obj
            return raw, lambda: None

        info = self._restore(step, tiers, sink, out, zero_copy)
        return st.unflatten(out), info

    def restore_into(self, state: Mapping[str, Any], step: int | None = None, *,
                     tiers: Sequence[str] | None = None) -> RestoreInfo:
        """Read a step (default: the newest) in place into the arrays/tensors of ``state``.

        Each block is verified before it is copied; if a tier fails midway the next one overwrites every
        entry. If every source fails, RestoreError is raised and ``state`` may hold a mix of values: do
        not train on it.
        """
        slots: dict[str, tuple[Any, Any]] = {}

        def walk(d: Any, prefix: str) -> None:
            for k, v in d.items():
                if isinstance(v, Mapping):
                    walk(v, f"{prefix}{k}{st.SEP}")
                else:
                    slots[f"{prefix}{k}"] = (d, k)

        walk(state, "")
        values: dict[str, Any] = {}

        def sink(e: Entry, tier: Tier) -> tuple[np.ndarray | None, Callable[[], None]]:
            parent, key = slots[e.name]
            target = parent[key]
            raw = st.target_view(e.name, target, e.lib, e.dtype, e.shape)
            if raw is not None:
                return raw, lambda: None
            tmp, traw = st.allocate(e.lib, e.dtype, e.shape)
            if st.is_tensor(target):
                return traw, lambda: target.copy_(tmp)
            if isinstance(target, np.ndarray):
                return traw, lambda: np.copyto(target, tmp)
            return traw, lambda: parent.__setitem__(key, tmp)

        info = self._restore(step, tiers, sink, values, False, wanted=set(slots))
        for name, v in values.items():
            parent, key = slots[name]
            parent[key] = v
        return info

    def _restore(self, step, tiers, sink, out, zero_copy, wanted: set[str] | None = None) -> RestoreInfo:
        self._check_open()
        self.raise_background_errors()
        usable = [t for t in self.tiers if tiers is None or t.name in tiers]
        if tiers is not None and len(usable) != len(set(tiers)):
            raise ValueError(f"unknown tier in {list(tiers)}; tiers are {[t.name for t in self.tiers]}")
        self.refresh()
        with self._lock:
            have = {t.name: set(self._index[t.name]) for t in usable}
        mine = set().union(*have.values()) if have else set()
        every = self.group.all_gather(sorted(mine))
        common = set(every[0]).intersection(*map(set, every[1:]))
        if step is not None:
            if step not in common:
                raise StepNotFoundError(f"step {step} is not committed on {[t.name for t in usable]} for every "
                                        f"rank; available: {sorted(common)[-10:]}")
            order = [step]
        else:
            order = sorted(common, reverse=True)
            if not order:
                raise StepNotFoundError(f"nothing to restore: no committed step on {[t.name for t in usable]}")
        skipped: list[tuple[str, int, str]] = []
        for s in order:
            for t in usable:
                if s not in have[t.name]:
                    continue
                t0 = time.perf_counter()
                try:
                    nbytes, manifest = self._read_step(t, s, sink, out, zero_copy, wanted)
                except StateMismatchError:
                    raise  # the caller's state does not match the checkpoint: not a tier problem
                except (TierfsError, OSError, ValueError, KeyError) as e:
                    why = f"{type(e).__name__}: {e}"
                    log.warning("tier %s step %d unusable, trying the next source (%s)", t.name, s, why)
                    skipped.append((t.name, s, why))
                    out.clear()
                    continue
                info = RestoreInfo(s, t.name, nbytes, time.perf_counter() - t0, skipped, manifest.metadata,
                                   manifest.metrics)
                if wanted is not None:
                    info.unused = sorted({e.name for e in manifest.entries} - wanted)
                log.info("restored %s", info)
                return info
        reasons = "; ".join(f"{t} step {s}: {w}" for t, s, w in skipped)
        raise RestoreError(f"no tier holds a verified copy ({reasons})")

    def _read_step(self, tier: Tier, step: int, sink, out, zero_copy, wanted) -> tuple[int, Manifest]:
        self._pin(tier, step)
        try:
            marker = tier.read_marker(step)
            mname = manifest_filename(self.group.rank)
            if marker.step != step or mname not in marker.manifests:
                raise FormatError(f"commit marker does not list {mname} for step {step}")
            mbytes = bytes(tier.read_file(step, mname))
            if crc32c(mbytes) != marker.manifests[mname]:
                raise ChecksumError(f"manifest {mname} does not match its commit marker")
            manifest = Manifest.from_bytes(mbytes)
            if manifest.step != step or manifest.rank != self.group.rank:
                raise FormatError(f"manifest {mname} is for step {manifest.step} rank {manifest.rank}")
            if wanted is not None:
                missing = wanted - {e.name for e in manifest.entries}
                if missing:
                    raise StateMismatchError(f"target state has entries the checkpoint lacks: {sorted(missing)[:5]}")
            files = tier.read_files(step, list(manifest.files))
            raw = {f: _as_u8(files[f]) for f in manifest.files}
            for f, n in manifest.files.items():
                if raw[f].size != n:
                    raise FormatError(f"{f} holds {raw[f].size} bytes, manifest says {n} (truncated copy)")
            jobs, finish = [], []
            for e in manifest.entries:
                if wanted is not None and e.name not in wanted:
                    continue
                if e.kind == "json":
                    out[e.name] = e.value
                    continue
                src = raw[e.file][e.offset:e.offset + e.length]
                dst, done = sink(e, tier)
                if dst is None:  # zero-copy: hand out a read-only view of the tier's mapping
                    view = tier.export(step, e.file)[e.offset:e.offset + e.length]
                    view.flags.writeable = False
                    out[e.name] = st.view_as(e.lib, e.dtype, e.shape, view)
                jobs.append(_copy.Job(e.name, src, dst, manifest.block_size, e.crc32c))
                finish.append(done)
            _copy.run(jobs, self.threads)
            for done in finish:
                done()
            return manifest.nbytes, manifest
        finally:
            self._unpin(tier, step)

    def verify(self, step: int, tier: str) -> Manifest:
        """Check every checksum of this rank's copy of ``step`` on ``tier``; raise on the first problem."""
        t = self.tier(tier)
        marker = t.read_marker(step)
        mname = manifest_filename(self.group.rank)
        mbytes = bytes(t.read_file(step, mname))
        if crc32c(mbytes) != marker.manifests.get(mname):
            raise ChecksumError(f"manifest {mname} does not match its commit marker")
        manifest = Manifest.from_bytes(mbytes)
        _verify(manifest, t.read_files(step, list(manifest.files)), self.threads)
        return manifest

    # -- life cycle ---------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise TierfsError("the store is closed; create a new TieredStore")

    def close(self) -> None:
        """Finish background work, then release every tier. Raises a background failure, if any."""
        if self._closed:
            return
        try:
            self.wait_until_finished()
        finally:
            self._closed = True
            if self._worker is not None:
                self._queue.put(None)
                self._worker.join()
            for t in self.tiers:
                t.close()

    def __enter__(self) -> "TieredStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _check_complete(tier: Tier, step: int, expected: Mapping[str, int | None]) -> None:
    """Before a marker is written: every file is there, at its length (None: any length)."""
    have = tier.file_sizes(step)
    bad = [n for n, size in expected.items() if n not in have or (size is not None and have[n] != size)]
    if bad:
        raise FormatError(f"tier {tier.name!r} step {step}: {len(bad)} file(s) missing or wrong size before "
                          f"commit (e.g. {bad[0]}); another process may have removed them; not committing")


def _as_u8(data: Any) -> np.ndarray:
    if isinstance(data, np.ndarray):
        return data.reshape(-1).view(np.uint8)
    return np.frombuffer(data, dtype=np.uint8)


def _verify(manifest: Manifest, files: Mapping[str, Any], threads: int | None) -> None:
    raw = {f: _as_u8(files[f]) for f in manifest.files}
    for f, n in manifest.files.items():
        if raw[f].size != n:
            raise FormatError(f"{f} holds {raw[f].size} bytes, manifest says {n} (truncated copy)")
    _copy.run([_copy.Job(e.name, raw[e.file][e.offset:e.offset + e.length], None, manifest.block_size,
                         e.crc32c) for e in manifest.entries if e.kind == "array"], threads)


def _jsonable(d: Mapping[str, Any] | None, what: str) -> dict[str, Any]:
    import json

    d = dict(d or {})
    try:
        json.dumps(d, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{what} must be JSON-serialisable ({e}); convert values to numbers or strings") from None
    return d
