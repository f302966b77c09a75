"""TieredStore: one checkpoint store over several tiers, fastest first.

Save: flatten the state → copy it, with crc32c per block, into the first tier's staged buffers (the RAM
tier's reused mappings) → write the manifest → commit with the marker (with ``blocking=False`` only the
copy happens on the caller's thread; a commit worker does the rest). Then one copy worker per slower tier
gives it the step if its save policy takes it: a byte copy of the files (verified before upload, marker
last), or, for a peer tier, one exchange in which every rank sends its shard to its peers and each copy
counts once its receiver has verified it. Every tier applies its keep policy.

Restore: all ranks gather what each can read and which shards each keeps for others → pick the newest
step every rank's shard is somewhere → read this rank's files from the fastest source whose copy verifies
(its own RAM, a peer, object storage) → copy once into the user's arrays. Every source skipped, and why,
is in the info.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from . import _copy, state as st
from ._worker import BACKGROUND_NICE, Throttle, Worker
from .dist import SingleProcess, TorchGroup, default_group
from .errors import (BackgroundError, ChecksumError, FormatError, RestoreError, StateMismatchError,
                     StepExistsError, StepNotFoundError, TierfsError)
from .format import (DEFAULT_BLOCK_SIZE, DEFAULT_FILE_SIZE, MARKER, Entry, Manifest, Marker, crc32c,
                     manifest_filename, plan_files)
from .policies import SaveContext, StepInfo
from .tiers.base import Tier
from .tiers.peer import plan_fetch

log = logging.getLogger("tierfs")

#: bytes/s for copies to slower tiers: keeps a training loop within a few percent on a 2-core machine
#: (see docs/benchmarks.md) while a 2 GiB shard still reaches the slow tier in about 18 s (its checksum
#: check and its upload both count).
DEFAULT_BACKGROUND_BANDWIDTH = 256e6


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
    peer: int | None = None  # the rank that sent this rank's shard, when it came from the peer tier
    #: every rank's source: ``{"rank", "tier", "peer", "nbytes", "seconds"}`` (the same on every rank)
    ranks: list[dict[str, Any]] = field(default_factory=list)

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")

    def __str__(self) -> str:
        s = f"step {self.step} from tier {self.tier!r}"
        s += f" (rank {self.peer})" if self.peer is not None else ""
        s += f": {self.nbytes / 1e6:.1f} MB in {self.seconds:.3f}s"
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
    max_in_flight:
        Saves whose background work (commit, copies) may be unfinished at once.
    when_busy:
        At that bound, ``"wait"`` until the oldest finishes, or ``"skip"`` the slow tiers for the new step
        (the first tier always takes it).
    background_bandwidth:
        Bytes per second that copies to slower tiers may move on average, checksum checks included
        (default 256 MB/s; None: no cap), in bursts of up to 64 MiB, so training keeps its cores and memory
        bandwidth. The commit to the first tier is never capped. Background threads also run at a lower CPU priority.
    """

    def __init__(self, tiers: Sequence[Tier], *, group: SingleProcess | TorchGroup | None = None,
                 threads: int | None = None, file_size: int = DEFAULT_FILE_SIZE,
                 block_size: int = DEFAULT_BLOCK_SIZE, clock: Callable[[], float] = time.time,
                 cleanup: bool = True, max_in_flight: int = 2, when_busy: str = "wait",
                 background_bandwidth: float | None = DEFAULT_BACKGROUND_BANDWIDTH) -> None:
        tiers = list(tiers)
        if not tiers:
            raise ValueError("TieredStore needs at least one tier, e.g. [MemoryTier(...), ObjectTier(url)]")
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"tier names must be unique, got {names}; pass name=... to tell them apart")
        peers = [t for t in tiers if t.is_peer]
        if len(peers) > 1 or tiers[0].is_peer:
            raise ValueError("use at most one PeerTier, after the RAM tier: "
                             "[MemoryTier(...), PeerTier(), ObjectTier(url)]")
        self.tiers = tiers
        self.group = group if group is not None else default_group()
        # one group per thread role, so collectives of different threads never interleave
        self._commit_group = self.group.fork()  # a blocking save waits for the commit: full priority
        self._copy_groups = {t.name: self.group.fork(nice=BACKGROUND_NICE) for t in tiers[1:] if not t.is_peer}
        for t in peers:
            t.bind(tiers[0], self.group)
        self.threads = threads
        self.file_size, self.block_size = int(file_size), int(block_size)
        self._clock = clock
        self._lock = threading.RLock()
        self._index: dict[str, set[int]] = {}  # tier -> committed steps (this process's view)
        self._history: dict[str, list[StepInfo]] = {t.name: [] for t in tiers}
        self._info: dict[int, StepInfo] = {}
        self._pins: dict[str, dict[int, int]] = {t.name: {} for t in tiers}  # steps being read from a tier
        self._transient: set[int] = set()  # steps staged in the first tier only to be copied on
        # steps newer than the one a restore fell back to, held by only some ranks or tiers: saving them
        # again replaces them (the job is redoing those steps)
        self._stale: set[int] = set()
        if when_busy not in ("wait", "skip"):
            raise ValueError(f"when_busy must be 'wait' or 'skip', got {when_busy!r}")
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight!r}")
        self.max_in_flight, self.when_busy = int(max_in_flight), when_busy
        self._throttle = Throttle(background_bandwidth)
        self._errors: list[BaseException] = []
        self._cond = threading.Condition(self._lock)
        self._in_flight: dict[int, int] = {}  # step -> unfinished background jobs (commit, copies)
        self._uncommitted: set[int] = set()  # staged in the first tier, marker not yet written
        self._commits = Worker("tierfs-commit", self._record_error)
        # one copy worker per slower tier: a slow upload never holds back the replicas to peers
        self._copies = {t.name: Worker(f"tierfs-copy-{t.name}", self._record_error) for t in tiers[1:]}
        self._closed = False
        for t in tiers:
            t.open()
        if cleanup:
            self._cleanup_uncommitted()
        self.refresh()

    # -- bookkeeping --------------------------------------------------------------------------------
    def refresh(self) -> None:
        """Re-list every tier (steps written by other processes become visible)."""
        for t in self.tiers:
            try:
                steps = set(t.committed_steps())
            except Exception as e:  # noqa: BLE001 - an unreachable tier: keep what we knew, say so
                log.warning("tier %s cannot be listed (%s); using the steps known to this process", t.name, e)
                if t.name in self._index:
                    continue
                steps = set()
            with self._lock:
                self._index[t.name] = steps
                known = {i.step for i in self._history[t.name]}
                self._history[t.name] += [StepInfo(s) for s in sorted(self._index[t.name] - known)]
                self._history[t.name].sort(key=lambda i: i.step)

    def _owns(self, tier: Tier) -> bool:
        """Whether this rank commits and deletes whole steps on ``tier`` (per node for local tiers; each
        rank its own replicas on a peer tier)."""
        if tier.is_peer:
            return True
        return (self.group.local_rank if tier.is_local else self.group.rank) == 0

    def _expected_manifests(self, tier: Tier, marker: Marker) -> dict[str, None]:
        """The manifests that must be on ``tier`` before its marker: this node's ranks' on a local tier."""
        if tier.is_local:
            return {manifest_filename(r): None for r in self.group.node_ranks}
        return {n: None for n in marker.manifests}

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

    def has_step(self, step: int) -> bool:
        """Whether ``step`` is being saved or is committed on some tier, as this process knows (no listing)."""
        with self._lock:
            return step in self._in_flight or any(step in s for s in self._index.values())

    def tier(self, name: str) -> Tier:
        for t in self.tiers:
            if t.name == name:
                return t
        raise KeyError(f"no tier named {name!r}; tiers are {[t.name for t in self.tiers]}")

    # -- save ---------------------------------------------------------------------------------------
    def should_save(self, step: int, *, force: bool = False, preempted: bool = False) -> list[Tier]:
        """The tiers whose save policy takes ``step`` (all of them with ``force``)."""
        now = self._clock()
        with self._lock:
            return [t for t in self.tiers if force or t.save_policy.should_save(
                SaveContext(step=step, time=now, previous=tuple(self._history[t.name]), preempted=preempted))]

    def save(self, step: int, state: Mapping[str, Any], metadata: Mapping[str, Any] | None = None, *,
             metrics: Mapping[str, Any] | None = None, force: bool = False, overwrite: bool = False,
             preempted: bool = False, blocking: bool = True) -> bool:
        """Save ``state`` as ``step`` to the tiers whose policies take it; False when none does.

        With ``blocking=True`` it returns once the first tier holds a committed copy. With
        ``blocking=False`` it returns as soon as the state is copied into the first tier's buffers (the
        caller may change the state right away); checksums and the commit follow in the background.
        Slower tiers are always written in the background. Raises any error background work hit since
        the last call.
        """
        self._check_open()
        self.raise_background_errors()
        chosen = self._make_room(step, self.should_save(step, force=force, preempted=preempted))
        with self._lock:
            if step in self._in_flight:
                raise StepExistsError(f"step {step} is still being saved; save a new step")
            holders = [t.name for t in self.tiers if step in self._index[t.name]]
        if self.group.world_size > 1:  # every rank does what rank 0 decided (clocks and RAM tiers differ)
            views = self.group.all_gather([[t.name for t in chosen], holders])
            chosen = [self.tier(n) for n in views[0][0]]
            holders = sorted({n for _, h in views for n in h})
        if not chosen:
            return False
        fast = self.tiers[0]
        if holders and step in self._stale:
            log.info("step %d: replacing the copies on %s left from before the restore", step, holders)
            overwrite = True
        self._stale.discard(step)
        if holders and not overwrite:
            raise StepExistsError(f"step {step} is already committed on {holders}; pass overwrite=True to "
                                  "replace it or save a new step")
        if holders:
            self.wait_until_finished()
            for name in holders:
                self._delete(self.tier(name), step)
        try:
            leaves = [st.to_leaf(n, v) for n, v in st.flatten(state)]
            pending = self._stage(fast, step, leaves, metadata, metrics, checksum=blocking)
        except BaseException as e:
            if self.group.world_size > 1:  # the other ranks wait for this one in the commit: tell them
                def abort(e: BaseException = e) -> None:
                    try:
                        _agree(self._commit_group, None, e, f"commit step {step}")
                    except BaseException:  # noqa: BLE001 - already raised to the caller
                        pass
                self._commits.submit(abort)
            raise
        info = StepInfo(step, self._clock(), dict(metrics or {}))
        with self._lock:
            self._info[step] = info
            for t in chosen:
                self._history[t.name].append(info)
            if fast not in chosen:
                self._transient.add(step)
            self._in_flight[step] = 1
            self._uncommitted.add(step)
        slow = [t for t in chosen if t is not fast]
        if not blocking:
            self._commits.submit(lambda: self._commit(pending, slow))
        elif self.group.world_size == 1:
            self._commit(pending, slow)
        else:  # commits of all ranks go through the commit worker, in order
            failed: list[BaseException] = []
            done = threading.Event()

            def commit() -> None:
                try:
                    self._commit(pending, slow)
                except BaseException as e:  # noqa: BLE001 - raised in the caller below
                    failed.append(e)
                finally:
                    done.set()
            self._commits.submit(commit)
            done.wait()
            if failed:
                raise failed[0]
        return True

    def _make_room(self, step: int, chosen: list[Tier]) -> list[Tier]:
        """Apply the in-flight bound: wait, or drop the slow tiers for this step."""
        with self._cond:
            if self.when_busy == "skip" and len(self._in_flight) >= self.max_in_flight:
                slow = [t.name for t in chosen if t is not self.tiers[0]]
                if slow:
                    log.warning("step %d: %d saves still in flight, skipping it on %s", step,
                                len(self._in_flight), slow)
                chosen = [t for t in chosen if t is self.tiers[0]]
                busy = lambda: len(self._uncommitted) >= self.max_in_flight  # noqa: E731
            else:
                busy = lambda: len(self._in_flight) >= self.max_in_flight  # noqa: E731
            while chosen and busy() and not self._errors:
                self._cond.wait()
        return chosen

    def _done(self, step: int) -> None:
        with self._cond:
            self._in_flight[step] -= 1
            if not self._in_flight[step]:
                del self._in_flight[step]
            self._cond.notify_all()

    def _stage(self, fast: Tier, step: int, leaves: list[st.Leaf], metadata, metrics, checksum: bool
               ) -> "_Pending":
        """Copy the arrays into the first tier's buffers (with block checksums when ``checksum``)."""
        rank = self.group.rank
        arrays = [lf for lf in leaves if lf.kind == "array"]
        placement, files = plan_files([lf.nbytes for lf in arrays], rank, self.file_size)
        metadata, metrics = _jsonable(metadata, "metadata"), _jsonable(metrics, "metrics")
        bufs = fast.stage(step, files)  # raises CapacityError before anything is written
        try:
            jobs = [_copy.Job(lf.name, lf.data, bufs[f][o:o + lf.nbytes], self.block_size)
                    for lf, (f, o) in zip(arrays, placement)]
            if checksum:
                crcs = _copy.run(jobs, self.threads)
            else:
                _copy.run(jobs, self.threads, checksum=False)
                crcs = None
        except BaseException:
            fast.discard_staged(step)
            raise
        where = iter(placement)
        entries = []
        for lf in leaves:
            if lf.kind == "json":
                entries.append(Entry(lf.name, "json", value=lf.value))
            else:
                f, o = next(where)
                entries.append(Entry(lf.name, "array", lf.lib, lf.dtype, list(lf.shape), f, o, lf.nbytes))
        manifest = Manifest(step, rank, self.group.world_size, entries, files, self.block_size,
                            metadata=metadata, metrics=metrics)
        staged = [j.dst for j in jobs]
        return _Pending(fast, manifest, staged, crcs)

    def _commit(self, p: "_Pending", slow: list[Tier]) -> None:
        """Checksums (if not done while copying), manifest, marker; then hand on to the slow tiers."""
        fast, manifest = p.tier, p.manifest
        step, rank = manifest.step, manifest.rank
        try:
            mine, failure = None, None
            try:
                crcs = p.crcs if p.crcs is not None else _copy.run(
                    [_copy.Job(e.name, buf, None, self.block_size) for e, buf in
                     zip((e for e in manifest.entries if e.kind == "array"), p.buffers)], 1)  # leave training a core
                for e, c in zip((e for e in manifest.entries if e.kind == "array"), crcs):
                    e.crc32c = c
                fast.write_staged(step)
                mbytes = manifest.to_bytes()
                fast.write_file(step, manifest_filename(rank), mbytes)
                _check_complete(fast, step, {**manifest.files, manifest_filename(rank): len(mbytes)})
                mine = [manifest_filename(rank), crc32c(mbytes), manifest.nbytes]
            except BaseException as e:  # noqa: BLE001 - the other ranks must hear of it, then it is raised
                fast.discard_staged(step)
                failure = e
            parts = _agree(self._commit_group, mine, failure, f"commit step {step}")
            marker = Marker(step, manifest.world_size, {n: c for n, c, _ in parts},
                            nbytes=sum(b for _, _, b in parts))
            if self._owns(fast):
                _check_complete(fast, step, self._expected_manifests(fast, marker))
                fast.write_marker(step, marker.to_bytes())
            self._commit_group.barrier()
        except BaseException:
            with self._cond:
                for t in self.tiers:
                    self._history[t.name] = [i for i in self._history[t.name] if i.step != step]
                self._transient.discard(step)
                self._uncommitted.discard(step)
            self._done(step)
            raise
        with self._cond:
            self._index[fast.name].add(step)
            self._uncommitted.discard(step)
            self._in_flight[step] += len(slow)
            self._cond.notify_all()
        for t in slow:
            self._pin(fast, step)
            self._copies[t.name].submit(lambda t=t: self._copy_step(step, fast, t, marker))
        self._done(step)
        self._apply_retention(fast)
        self._commits.submit(lambda: fast.prepare(step, manifest.files))  # pre-fault the next step's buffers

    # -- background ---------------------------------------------------------------------------------
    def _record_error(self, e: BaseException) -> None:
        with self._cond:
            self._errors.append(e)
            self._cond.notify_all()

    def raise_background_errors(self) -> None:
        """Raise the first error background work hit since the last call, if any."""
        with self._lock:
            errors, self._errors = self._errors, []
        if errors:
            more = f" (and {len(errors) - 1} more, see the log)" if len(errors) > 1 else ""
            raise BackgroundError(f"background copy failed: {errors[0]}{more}") from errors[0]

    def wait_until_finished(self) -> None:
        """Block until every background commit, copy and deletion is done; raise the first failure."""
        self._commits.join()
        for w in self._copies.values():
            w.join()
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
        """This rank's part of putting ``step`` on ``dst`` (an upload, or replication to peers), then the
        bookkeeping: a step not stored there leaves the tier's history, so its policy may take the next."""
        stored = False
        try:
            stored = (self._replicate if dst.is_peer else self._upload)(step, src, dst, marker)
        finally:
            with self._lock:
                if stored:
                    self._index[dst.name].add(step)
                else:
                    self._history[dst.name] = [i for i in self._history[dst.name] if i.step != step]
            self._unpin(src, step)
            self._done(step)
        self._apply_retention(dst)
        self._retire_transient(step)
        self._apply_retention(src)

    def _upload(self, step: int, src: Tier, dst: Tier, marker: Marker) -> bool:
        """Byte copy of this rank's files from ``src`` to ``dst``, verified before upload, marker last."""
        group = self._copy_groups[dst.name]
        t0 = time.perf_counter()
        mname = manifest_filename(self.group.rank)
        done, failure = None, None
        try:
            mbytes = bytes(src.read_file(step, mname))
            manifest = Manifest.from_bytes(mbytes)
            files = src.read_files(step, list(manifest.files))
            # a damaged RAM copy must not become the durable one; verified and sent within the cap
            _copy.verify(manifest, files, 1, pace=self._throttle.consume)
            dst.write_files(step, files, pace=self._throttle.consume)
            dst.write_file(step, mname, mbytes)
            _check_complete(dst, step, {**manifest.files, mname: len(mbytes)})
            del files
            done = manifest.nbytes
        except BaseException as e:  # noqa: BLE001 - the other ranks must hear of it, then it is raised
            failure = e
        _agree(group, done, failure, f"copy step {step} to {dst.name}")
        if self._owns(dst):
            _check_complete(dst, step, self._expected_manifests(dst, marker))
            dst.write_marker(step, marker.to_bytes())
        group.barrier()
        log.info("step %d copied %s -> %s: %.1f MB in %.2fs", step, src.name, dst.name,
                 done / 1e6, time.perf_counter() - t0)
        return True

    def _replicate(self, step: int, src: Tier, dst: Tier, marker: Marker) -> bool:
        """Every rank sends its shard to its peers at once; stored only if every copy is verified."""
        t0 = time.perf_counter()
        mbytes, files, error, nbytes = b"", {}, None, 0
        try:
            mbytes = bytes(src.read_file(step, manifest_filename(self.group.rank)))
            manifest = Manifest.from_bytes(mbytes)
            files, nbytes = src.read_files(step, list(manifest.files)), manifest.nbytes
        except (TierfsError, OSError, ValueError) as e:
            error = f"{type(e).__name__}: {e}"  # still take part: the receivers refuse
        # no check before sending: each receiver verifies every block as it lands
        failed = dst.replicate(step, marker.to_bytes(), mbytes, files, pace=self._throttle.consume, error=error)
        del files
        if failed:
            s, t, why = failed[0]
            log.warning("step %d is not replicated to peers (%d of the copies failed, e.g. rank %d -> %d: %s); "
                        "peers keep their previous step", step, len(failed), s, t, why)
            return False
        log.info("step %d replicated to peers: %.1f MB sent in %.2fs", step, nbytes / 1e6, time.perf_counter() - t0)
        return True

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
    def _doomed(self, tier: Tier, held: Mapping[str, set[int]]) -> list[int]:
        """The steps of ``tier`` that retention deletes, given what every tier holds (lock held): not kept
        by the tier's policy, not being read or copied, and not the only copy of the newest step."""
        committed = sorted(held[tier.name] - self._transient)
        if not committed:
            return []
        keep = tier.keep_policy.keep([self._info.get(s, StepInfo(s)) for s in committed])
        newest = max(max(h) for h in held.values() if h)
        return [s for s in committed if s not in keep and not self._pins[tier.name].get(s)
                and not (s == newest and not any(s in held[t.name] for t in self.tiers if t is not tier))]

    def _apply_retention(self, tier: Tier) -> None:
        with self._lock:
            doomed = self._doomed(tier, self._index)
        for s in doomed:
            log.debug("tier %s: retention deletes step %d", tier.name, s)
            self._delete(tier, s)

    def _delete(self, tier: Tier, step: int) -> None:
        with self._lock:  # claim the step so two threads never delete it at once
            if step not in self._index[tier.name]:
                return
            self._index[tier.name].discard(step)
            self._history[tier.name] = [i for i in self._history[tier.name] if i.step != step]
        if tier.is_peer:
            tier.delete_step(step)  # the replicas this rank keeps
        elif tier.is_local and len(self.group.node_ranks) > 1:
            # ranks sharing a node's directory each take back their own buffers; the owner drops the marker
            tier.release(step, self.group.rank, marker=self._owns(tier))
        elif self._owns(tier):
            tier.delete_step(step)

    def retention_plan(self) -> dict[str, list[int]]:
        """``{tier: [steps its keep policy would delete now]}``, deleting nothing.

        The rules of the retention that runs after each save: a step is kept when the tier's keep policy
        keeps it, when it is being read or copied, or when it is the only copy of the newest step. Steps
        this process did not save get their commit time and metrics from their marker and manifest, so
        time- and metric-based policies see them (``tierfs gc`` runs on a store that saved nothing).
        """
        self.wait_until_finished()
        self.refresh()
        with self._lock:
            unknown = sorted(set().union(*self._index.values()) - set(self._info))
        for s in unknown:
            when, metrics = 0.0, {}
            try:
                when = float(self.read_marker(s).committed or 0.0)
                metrics = dict(self.read_manifest(s, self.group.rank)[0].metrics)
            except (TierfsError, OSError, ValueError, KeyError) as e:
                log.warning("step %d: no readable marker or manifest (%s); its time and metrics are unknown", s, e)
            with self._lock:
                self._info.setdefault(s, StepInfo(s, when, metrics))
        out: dict[str, list[int]] = {}
        with self._lock:
            held = {t.name: set(self._index[t.name]) for t in self.tiers}  # as the deletions go, tier by tier
            for tier in self.tiers:
                out[tier.name] = self._doomed(tier, held)
                held[tier.name] -= set(out[tier.name])
        return out

    def apply_retention(self) -> dict[str, list[int]]:
        """Apply every tier's keep policy now (see :meth:`retention_plan`); returns the steps deleted."""
        doomed = self.retention_plan()
        for tier in self.tiers:
            for s in doomed[tier.name]:
                log.info("tier %s: retention deletes step %d", tier.name, s)
                self._delete(tier, s)
        return doomed

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

    def localize(self, step: int | None = None, *, tiers: Sequence[str] | None = None) -> RestoreInfo:
        """Bring this rank's shard of a step (default: the newest every rank can get) into the first tier.

        Collective. Picks the step as ``restore`` does; a rank whose first tier lacks it gets its shard
        from a peer or a slower tier, verifies it and writes it into the first tier (committed once every
        rank of its node has it). Readers that read tiers directly, without collectives (the DCP reader),
        then find it in RAM. Returns what ``restore`` would: per rank, where the shard came from.
        """
        return self._restore(step, tiers, None, {}, False, adopt=True)

    def _restore(self, step, tiers, sink, out, zero_copy, wanted: set[str] | None = None,
                 adopt: bool = False) -> RestoreInfo:
        self._check_open()
        self.raise_background_errors()
        usable = list(self.tiers) if tiers is None else [self.tier(n) for n in dict.fromkeys(tiers)]
        self.refresh()
        peer = next((t for t in usable if t.is_peer), None)
        with self._lock:
            have = {t.name: set(self._index[t.name]) for t in usable if not t.is_peer}
        mine = set().union(*have.values()) if have else set()
        held = peer.holdings() if peer is not None else {}
        # every rank learns which steps each rank can read itself and which shards each rank keeps for others
        views = self.group.all_gather([sorted(mine), [[s, r] for s, rs in held.items() for r in rs]])
        own = [set(v[0]) for v in views]
        holders: dict[tuple[int, int], list[int]] = {}
        for h, (_, kept) in enumerate(views):
            for s, r in kept:
                holders.setdefault((s, r), []).append(h)
        ranks = range(self.group.world_size)
        every = set().union(*own, (s for s, _ in holders))
        common = {s for s in every if all(s in own[r] or (s, r) in holders for r in ranks)}
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
            got, mismatch = self._restore_step(s, usable, have, holders, sink, out, zero_copy, wanted, skipped)
            if self.group.world_size > 1:
                kind = "mismatch" if isinstance(mismatch, StateMismatchError) else "error"
                views = self.group.all_gather([got is not None, [kind, str(mismatch)] if mismatch else None])
                bad = [(r, m) for r, (_, m) in enumerate(views) if m]
                if bad and mismatch is None:
                    r, (kind, why) = bad[0]
                    mismatch = (StateMismatchError if kind == "mismatch" else TierfsError)(f"rank {r}: {why}")
                if got is not None and not all(ok for ok, _ in views):  # all go back together
                    skipped.append((got[0].tier, s, "another rank could not restore this step"))
                    got = None
            if mismatch is not None:
                raise mismatch
            if got is not None:
                info, shard = got
                if self.group.world_size > 1:
                    info.ranks = self.group.all_gather({"rank": self.group.rank, "tier": info.tier, "peer": info.peer,
                                                        "nbytes": info.nbytes, "seconds": info.seconds})
                log.info("restored %s", info)
                if adopt:
                    self._adopt(s, info, shard)
                if peer is not None:
                    self._reseed(peer, s, holders, shard)
                if step is None:
                    self._stale = {x for x in every if x > s}
                    if self._stale:
                        log.warning("steps %s could not be restored for every rank and were passed over; saving them "
                                    "again replaces them", sorted(self._stale))
                return info
            out.clear()
            if step is not None:
                break
        reasons = "; ".join(f"{t} step {s}: {w}" for t, s, w in skipped)
        raise RestoreError(f"no tier holds a verified copy ({reasons})")

    def _restore_step(self, s, usable, have, holders, sink, out, zero_copy, wanted, skipped):
        """This rank's part of step ``s``: from its own tiers up to the peer tier, then (all ranks together)
        from peers, then from the tiers after it. Returns ``((info, shard) or None, mismatch error)``; never
        raises between collectives."""
        cut = next((i for i, t in enumerate(usable) if t.is_peer), len(usable))
        got, mismatch = None, None
        try:
            got = self._restore_local(s, usable[:cut], have, sink, out, zero_copy, wanted, skipped)
        except Exception as e:  # noqa: BLE001 - a mismatch, or a failure filling the target: raised by all
            mismatch = e
        if cut < len(usable):
            got, mismatch = self._restore_from_peers(s, usable[cut], holders, got, mismatch, sink, out, wanted,
                                                     skipped)
        if got is None and mismatch is None:
            try:
                got = self._restore_local(s, usable[cut + 1:], have, sink, out, zero_copy, wanted, skipped)
            except Exception as e:  # noqa: BLE001 - as above
                mismatch = e
        return got, mismatch

    def _restore_local(self, s, usable, have, sink, out, zero_copy, wanted, skipped):
        """This rank's part of step ``s`` from the first of its own tiers whose copy verifies, or None."""
        for t in usable:
            if s not in have[t.name]:
                continue
            t0 = time.perf_counter()
            try:
                shard = self._read_step(t, s, sink, out, zero_copy, wanted)
            except StateMismatchError:
                raise  # the caller's state does not match the checkpoint: not a tier problem
            except (TierfsError, OSError, ValueError, KeyError) as e:
                why = f"{type(e).__name__}: {e}"
                log.warning("tier %s step %d unusable, trying the next source (%s)", t.name, s, why)
                skipped.append((t.name, s, why))
                out.clear()
                continue
            return self._restored(s, t.name, shard, time.perf_counter() - t0, skipped, wanted), shard
        return None

    def _restore_from_peers(self, s, peer, holders, got, mismatch, sink, out, wanted, skipped):
        """Ranks still without their shard get it from a peer that keeps a copy; every rank takes part
        (holders send). Holders that fail are dropped and the next one tried. Returns ``(got, error)``."""
        needs = self.group.all_gather(got is None and mismatch is None)
        tried: set[tuple[int, int]] = set()
        while True:
            options = {r: [h for h in holders.get((s, r), []) if (r, h) not in tried]
                       for r, need in enumerate(needs) if need}
            assign = plan_fetch({r: hs for r, hs in options.items() if hs})
            if not assign:
                return got, mismatch
            t0 = time.perf_counter()
            self._pin(peer, s)  # retention must not delete what a holder is sending
            try:
                res = peer.fetch(s, assign)
            finally:
                self._unpin(peer, s)
            ok = True
            if isinstance(res, tuple):
                manifest, mbytes, marker, files = res
                try:
                    shard = _Shard(manifest, mbytes, marker, files)
                    self._fill(peer, s, shard, sink, out, False, wanted)
                    info = self._restored(s, peer.name, shard, time.perf_counter() - t0, skipped, wanted)
                    info.peer = assign[self.group.rank]
                    got = (info, shard)
                except (TierfsError, ValueError, KeyError) as e:
                    if isinstance(e, StateMismatchError):  # the target is wrong, not the copy: stop here
                        mismatch = e
                    res = f"{type(e).__name__}: {e}"
                    out.clear()
                except Exception as e:  # noqa: BLE001 - filling the target failed: raised by all ranks
                    mismatch, res = e, f"{type(e).__name__}: {e}"
                    out.clear()
            if isinstance(res, str):
                ok = False
                why = f"from rank {assign[self.group.rank]}: {res}"
                log.warning("tier %s step %d: the copy %s is unusable, trying another source", peer.name, s, why)
                skipped.append((peer.name, s, why))
            for r, good in enumerate(self.group.all_gather(ok or mismatch is not None)):
                if r in assign:
                    tried.add((r, assign[r]))
                    if good:
                        needs[r] = False

    def _restored(self, s, tier, shard, seconds, skipped, wanted) -> RestoreInfo:
        m = shard.manifest
        info = RestoreInfo(s, tier, m.nbytes, seconds, skipped, m.metadata, m.metrics)
        if wanted is not None:
            info.unused = sorted({e.name for e in m.entries} - wanted)
        return info

    def _adopt(self, s: int, info: RestoreInfo, shard: "_Shard") -> None:
        """Write a shard read from elsewhere into the first tier; each node's owner commits it there once
        all of the node's ranks have theirs (collective). A failure only costs speed: it is logged."""
        fast = self.tiers[0]
        wrote = False
        if info.tier != fast.name:
            try:
                bufs = fast.stage(s, shard.manifest.files)
                for name, data in _copy.shard_views(shard.manifest, shard.files).items():
                    np.copyto(bufs[name], data)
                fast.write_staged(s)
                fast.write_file(s, manifest_filename(self.group.rank), shard.mbytes)
                wrote = True
            except Exception as e:  # noqa: BLE001 - only speed is lost: the other ranks must not wait
                fast.discard_staged(s)
                log.warning("step %d: could not copy this rank's shard into tier %s (%s)", s, fast.name, e)
        wrote_by = self.group.all_gather(wrote)
        if self._owns(fast) and any(wrote_by[r] for r in self.group.node_ranks):
            marker = Marker.from_bytes(shard.marker)
            try:
                _check_complete(fast, s, self._expected_manifests(fast, marker))
                fast.write_marker(s, shard.marker)
            except (TierfsError, OSError) as e:
                log.warning("step %d: not committed in tier %s (%s)", s, fast.name, e)
        self.group.barrier()
        self.refresh()

    def _reseed(self, peer: Tier, s: int, holders, shard: "_Shard") -> None:
        """After restoring the newest step, give ranks that lost their replicas (a replaced node) the
        copies they kept for others again."""
        if any(step > s for step, _ in holders):
            return  # peers keep a newer step: that one matters
        pairs = [(r, t) for r in range(self.group.world_size) for t in peer.targets[r]
                 if t not in holders.get((s, r), [])]
        if not pairs:
            return
        t0 = time.perf_counter()
        failed = peer.replicate(s, shard.marker, shard.mbytes, shard.files, pairs=pairs, role="main")
        if failed:
            log.warning("step %d: re-seeding %d peer copies failed (e.g. %s)", s, len(failed), failed[0])
            return
        with self._lock:
            if peer.holdings().get(s):
                self._index[peer.name].add(s)
        log.info("step %d: re-seeded %d peer copies in %.2fs", s, len(pairs), time.perf_counter() - t0)

    def _read_step(self, tier: Tier, step: int, sink, out, zero_copy, wanted) -> "_Shard":
        self._pin(tier, step)
        try:
            marker = bytes(tier.read_file(step, MARKER))
            manifest, mbytes = self._checked_manifest(tier, step, self.group.rank, with_bytes=True)
            _check_wanted(manifest, wanted)  # before reading: a wrong target costs no download
            shard = _Shard(manifest, mbytes, marker, tier.read_files(step, list(manifest.files)))
            self._fill(tier, step, shard, sink, out, zero_copy, wanted)
            return shard
        finally:
            self._unpin(tier, step)

    def _fill(self, tier: Tier, step: int, shard: "_Shard", sink, out, zero_copy, wanted) -> None:
        """Verify every block of the shard's wanted entries and copy them into the sink's arrays (no sink:
        only verify)."""
        manifest = shard.manifest
        if sink is None:
            _copy.verify(manifest, shard.files, self.threads)
            return
        raw = _copy.shard_views(manifest, shard.files)
        _check_wanted(manifest, wanted)
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

    # -- reading any rank's shard (no collectives: for adapters such as DCP that reshard) -----------
    def _holders(self, step: int, tiers: Sequence[str] | None) -> list[Tier]:
        usable = list(self.tiers) if tiers is None else [self.tier(n) for n in dict.fromkeys(tiers)]
        self.refresh()
        with self._lock:
            held = [t for t in usable if step in self._index[t.name] and not t.is_peer]
        if not held:
            raise StepNotFoundError(f"step {step} is not committed on {[t.name for t in usable]}")
        return held

    @staticmethod
    def _checked_manifest(tier: Tier, step: int, rank: int, with_bytes: bool = False):
        """Rank ``rank``'s manifest of ``step`` on ``tier``, checked against the tier's marker (and its
        bytes, ``with_bytes``)."""
        marker = tier.read_marker(step)
        mname = manifest_filename(rank)
        if marker.step != step or mname not in marker.manifests:
            raise FormatError(f"commit marker does not list {mname} for step {step}")
        mbytes = bytes(tier.read_file(step, mname))
        if crc32c(mbytes) != marker.manifests[mname]:
            raise ChecksumError(f"manifest {mname} does not match its commit marker")
        manifest = Manifest.from_bytes(mbytes)
        if manifest.step != step or manifest.rank != rank:
            raise FormatError(f"manifest {mname} is for step {manifest.step} rank {manifest.rank}")
        return (manifest, mbytes) if with_bytes else manifest

    def read_marker(self, step: int, *, tiers: Sequence[str] | None = None) -> Marker:
        """The commit marker of ``step`` from the fastest tier holding a readable one."""
        errors = []
        for t in self._holders(step, tiers):
            try:
                return t.read_marker(step)
            except (TierfsError, OSError, ValueError) as e:
                errors.append(f"{t.name}: {type(e).__name__}: {e}")
        raise RestoreError(f"step {step}: no readable commit marker ({'; '.join(errors)})")

    def read_manifest(self, step: int, rank: int, *, tiers: Sequence[str] | None = None
                      ) -> tuple[Manifest, str]:
        """Any rank's manifest of ``step``, checked against the marker, from the fastest tier holding it.

        Returns ``(manifest, tier name)``. Needs no collective (any rank may call it alone).
        """
        errors = []
        for t in self._holders(step, tiers):
            self._pin(t, step)
            try:
                return self._checked_manifest(t, step, rank), t.name
            except (TierfsError, OSError, ValueError, KeyError) as e:
                errors.append(f"{t.name}: {type(e).__name__}: {e}")
            finally:
                self._unpin(t, step)
        raise RestoreError(f"step {step}: no tier holds a verified manifest of rank {rank} ({'; '.join(errors)})")

    def read_entries(self, step: int, rank: int, names: Sequence[str] | None = None, *,
                     tiers: Sequence[str] | None = None, consume: Callable[[Mapping[str, tuple[Entry, Any]], str], None]
                     ) -> tuple[str, list[tuple[str, int, str]]]:
        """Read entries of any rank's shard of ``step`` from the fastest tier whose copy verifies.

        For each tier holding the step, fastest first: check the manifest against the marker, read the
        needed shard files (RAM: mapped views, no copy), verify every block of the wanted entries, then
        call ``consume({name: (entry, value)}, tier_name)`` while the tier's files are pinned. ``value``
        is a read-only 1-D uint8 array for array entries (valid only during the call: copy out of it) and
        the JSON value for json entries. A tier that fails before ``consume`` is called is skipped and the
        next one tried. Returns ``(tier name, skipped)`` with ``skipped`` as in :class:`RestoreInfo`.
        Needs no collective (any rank may read any rank's shard, e.g. to reshard).
        """
        skipped: list[tuple[str, int, str]] = []
        for t in self._holders(step, tiers):
            self._pin(t, step)
            try:
                try:
                    manifest = self._checked_manifest(t, step, rank)
                    by_name = {e.name: e for e in manifest.entries}
                    wanted = list(by_name) if names is None else list(dict.fromkeys(names))
                    missing = [n for n in wanted if n not in by_name]
                    if missing:
                        raise StateMismatchError(f"step {step} rank {rank} has no entries {missing[:5]}")
                    entries = [by_name[n] for n in wanted]
                    need = sorted({e.file for e in entries if e.kind == "array"})
                    raw = _copy.shard_views(manifest, t.read_files(step, need) if need else {})
                    out: dict[str, tuple[Entry, Any]] = {}
                    jobs = []
                    for e in entries:
                        if e.kind == "json":
                            out[e.name] = (e, e.value)
                            continue
                        src = raw[e.file][e.offset:e.offset + e.length]
                        jobs.append(_copy.Job(e.name, src, None, manifest.block_size, e.crc32c))
                        out[e.name] = (e, src)
                    _copy.run(jobs, self.threads)
                except StateMismatchError:
                    raise
                except (TierfsError, OSError, ValueError, KeyError) as e:
                    why = f"{type(e).__name__}: {e}"
                    log.warning("tier %s step %d rank %d unusable, trying the next source (%s)", t.name, step,
                                rank, why)
                    skipped.append((t.name, step, why))
                    continue
                consume(out, t.name)
                return t.name, skipped
            finally:
                self._unpin(t, step)
        reasons = "; ".join(f"{t} step {s}: {w}" for t, s, w in skipped)
        raise RestoreError(f"step {step} rank {rank}: no tier holds a verified copy ({reasons})")

    def manifest(self, step: int) -> Manifest:
        """This rank's manifest of ``step`` (metadata, metrics, entries), from the first tier holding it."""
        return self.read_manifest(step, self.group.rank)[0]

    def verify(self, step: int, tier: str) -> Manifest:
        """Check every checksum of this rank's copy of ``step`` on ``tier``; raise on the first problem."""
        t = self.tier(tier)
        manifest = self._checked_manifest(t, step, self.group.rank)
        _copy.verify(manifest, t.read_files(step, list(manifest.files)), self.threads)
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
            self._commits.close()
            for w in self._copies.values():
                w.close()
            for t in self.tiers:
                t.close()

    def __enter__(self) -> "TieredStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _agree(group, mine: Any, failure: BaseException | None, what: str) -> list[Any]:
    """Every rank's result of ``what``; raise (on every rank) if any rank failed."""
    results = group.all_gather([failure is None, mine if failure is None else None])
    if failure is not None:
        raise failure
    if not all(ok for ok, _ in results):
        bad = [r for r, (ok, _) in enumerate(results) if not ok]
        raise TierfsError(f"{what}: rank(s) {bad} failed (see their logs); not committed")
    return [m for _, m in results]


def _check_wanted(manifest: Manifest, wanted: set[str] | None) -> None:
    """A target state with entries the checkpoint lacks is the caller's mistake, not a damaged copy."""
    missing = wanted - {e.name for e in manifest.entries} if wanted is not None else set()
    if missing:
        raise StateMismatchError(f"target state has entries the checkpoint lacks: {sorted(missing)[:5]}")


def _check_complete(tier: Tier, step: int, expected: Mapping[str, int | None]) -> None:
    """Before a marker is written: every file is there, at its length (None: any length)."""
    have = tier.file_sizes(step)
    bad = [n for n, size in expected.items() if n not in have or (size is not None and have[n] != size)]
    if bad:
        raise FormatError(f"tier {tier.name!r} step {step}: {len(bad)} file(s) missing or wrong size before "
                          f"commit (e.g. {bad[0]}); another process may have removed them; not committing")


@dataclass
class _Shard:
    """One rank's shard of a step as read from some source: kept until a restore has re-seeded peers."""

    manifest: Manifest
    mbytes: bytes
    marker: bytes
    files: Mapping[str, Any]


@dataclass
class _Pending:
    """A step staged in the first tier, waiting for its checksums and commit."""

    tier: Tier
    manifest: Manifest
    buffers: list[np.ndarray]  # one per array entry, in manifest order
    crcs: list[list[int]] | None


def _jsonable(d: Mapping[str, Any] | None, what: str) -> dict[str, Any]:
    import json

    d = dict(d or {})
    try:
        json.dumps(d, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{what} must be JSON-serialisable ({e}); convert values to numbers or strings") from None
    return d

