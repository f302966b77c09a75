"""The save path: stage, commit, hand on.

1. **Stage** (the caller's thread): read the state's structure, reuse its layout (file placement,
   manifest entries, typed views of the RAM tier's reused mappings; :mod:`.layout`) or plan a new one,
   and copy every array into the first tier's staged buffers. Nothing else runs on the caller's thread
   when the structure is the one saved before.
2. **Commit** (the commit worker, in order; the caller waits for it when blocking): block checksums,
   this rank's manifest, then every rank agrees and the owner of the first tier writes the marker.
3. **Hand on** (one copy worker per slower tier): each slower tier whose save policy took the step gets
   it, an upload verified and marker last, or one replication exchange between all ranks; then
   retention. A step staged only to be copied on leaves the first tier once every copy is done.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Mapping

from .. import metrics as _metrics
from ..util import args as _args
from ..format import blockio as _blocks
from ..device import copies as _device
from ..util import nogc as _nogc
from ..util import readable as _readable
from ..util.stages import stage
from ..ranks import Group, agreement, check, seconds
from ..errors import StepExistsError, TierfsError
from ..format import DCP_SHARD_KEY, Manifest, Marker, crc32c, manifest_digest, manifest_filename
from ..policies import SaveContext, StepInfo
from ..protocol import check_complete, checked_manifest, commit
from ..tiers.base import AnyTier, Replicator, Tier
from .layout import ShardLayout, Staged, describe
from .layouts import RecentLayouts
from .context import Context
from .retention import Retention
from .dataparallel import check_digests, digests
from .helper import copy_out
from .savevote import Vote, cast
from . import room, timeline

log = logging.getLogger("tierfs")

def _commit_sums() -> list[int]:
    """A commit's sums before this rank's are known (a rank that fails takes part with these): the ranks
    holding data-parallel bundles, the step's bytes, and its digest (:func:`manifest_digest`)."""
    return [0] * 4


class SavePath:
    """Saves of one store (see the module docstring)."""

    def __init__(self, ctx: Context, retention: Retention) -> None:
        self.ctx, self.retention = ctx, retention
        self._layouts = RecentLayouts(ctx)  # the structures saved most recently
        self.copies: Any = None  # the newest save's copies on the copy thread (tierfs.device.copies.Copies)

    # -- choosing the tiers -------------------------------------------------------------------------
    def should_save(self, step: int, *, force: bool = False, preempted: bool = False) -> list[AnyTier]:
        """The tiers whose save policy takes ``step`` (all of them with ``force``)."""
        now = self.ctx.clock()
        return [t for t in self.ctx.tiers if force or t.save_policy.should_save(
            SaveContext(step=step, time=now, previous=self.ctx.ledger.previous(t.name), preempted=preempted))]

    # -- save ---------------------------------------------------------------------------------------
    def save(self, step: int, state: Mapping[str, Any], metadata: Mapping[str, Any] | None, *,
             metrics: Mapping[str, Any] | None, force: bool, overwrite: bool, preempted: bool, blocking: bool,
             max_in_flight: int, when_busy: str, timeout: Any = None, replicated: Any = None,
             overlap: Any = None) -> bool:
        p = self.ctx
        mine, failure, wait = None, None, None
        try:  # this rank's view; every rank hears of a failure here before any of them goes on
            # the arguments first: a bad one (a leaf of the state too) fails before anything is replaced
            step, wait = _args.step(step), None if timeout is None else seconds(timeout)
            overlap = _device.Overlap.of(overlap)
            force, overwrite, preempted, blocking = (_args.flag(v, k) for k, v in (
                ("force", force), ("overwrite", overwrite), ("preempted", preempted), ("blocking", blocking)))
            with _nogc.paused():
                names, values, structure = describe(state, keys=True)
                layout = self._layouts.get(names, values, structure, replicated)
            metadata, metrics = _args.jsonable(metadata, "metadata"), _args.jsonable(metrics, "metrics")
            p.work.raise_errors()
            chosen = room.make_room(p.ledger, p.first, step, self.should_save(
                step, force=force, preempted=preempted), max_in_flight, when_busy)
            if p.ledger.busy(step):
                raise StepExistsError(f"step {step} is still being saved; save a new step")
            mine = Vote(p.names, [t.name for t in chosen], p.ledger.holders(step),
                         timeline.view(p.ledger.known_steps() - {step}, step, p.ledger.restored), p.group.rank,
                         len(names), step)
        except BaseException as e:  # noqa: BLE001 - raised on every rank by check
            failure = e
        group = p.group if wait is None else p.group.with_timeout(wait)
        commit_group = p.work.commit_group if wait is None else p.work.commit_group.with_timeout(wait)
        vote = mine or Vote(p.names, [], [], [[], []], p.group.rank)
        early: Any = None  # the usual save stages while the ranks agree: a Staged, or what staging raised
        if mine is not None and p.group.world_size > 1 and mine.usual(len(p.tiers), bool(chosen)):
            mins, maxes, early = cast(group, mine, f"save step {step}", lambda: self._staging(
                step, layout, values, metadata, metrics, overlap), self._drop)
        else:
            mins, maxes = check(group, failure, f"save step {step}", outcome="nothing saved", mins=vote.mins,
                                maxes=vote.maxes)
        # every rank does what rank 0 decided (clocks and RAM differ); any rank's copies count
        try:  # (it raises where the ranks save different steps, or nothing)
            chosen, holders, commit_id = vote.decided(p.tiers, mins, maxes, step, p.group.world_size)
        except BaseException:
            self._drop(early)
            raise
        if not chosen:
            self._drop(early)
            if isinstance(early, BaseException) and not isinstance(early, Exception):
                raise early  # (an interrupt while it staged)
            return False
        first = p.first
        restored = p.ledger.restored
        if holders and not overwrite and timeline.replaces(step, restored):
            log.info("step %d: replacing the copies on %s from before the restore of step %d", step, holders,
                     restored)
            overwrite = True
        try:
            if holders and not overwrite:
                raise StepExistsError(f"step {step} is already committed on {holders}; pass overwrite=True to "
                                      "replace it or save a new step")
            # the steps of a run gone back from: rare, so every rank's view is gathered only then
            stale = timeline.superseded(group.all_gather(vote.view), step, restored) if vote.supersedes(maxes) else []
            if holders or stale:  # another rank's view: what this one staged goes, and comes again after
                self._drop(early)
                early = None
                p.work.finish()
                self.retention.supersede(step, stale, restored)
                for name in holders:
                    self.retention.delete(p.tier(name), step)
            if isinstance(early, BaseException):
                raise early
            staged = early if early is not None else self._staging(step, layout, values, metadata, metrics, overlap)
            staged.tiers, staged.commit = [t.name for t in chosen], commit_id
        except BaseException as e:
            self._drop(early)
            if p.group.world_size > 1:  # the other ranks wait for this one in the commit: tell them
                def abort(e: BaseException = e) -> None:
                    try:
                        check(commit_group, e, f"commit step {step}", outcome="not committed",
                              sums=_commit_sums())
                    except BaseException:  # noqa: BLE001 - already raised to the caller
                        pass
                p.work.commits.submit(abort)
            raise
        p.ledger.begin(step, StepInfo(step, p.clock(), dict(metrics or {})), [t.name for t in chosen],
                       transient=first not in chosen)
        slow = [t for t in chosen if t is not first]
        if not blocking:
            p.work.commits.submit(lambda: self._commit(staged, slow, commit_group))
            if staged.copies is not None:  # the loop may change its tensors once this returns
                with stage("device copy", step, first.name):
                    staged.copies.wait_first() if overlap is not None else staged.copies.wait()
        elif p.group.world_size == 1:
            self._commit(staged, slow, commit_group, p.threads)
        else:  # commits of all ranks go through the commit worker, in order
            failed: list[BaseException] = []
            done = threading.Event()

            def commit_now() -> None:
                try:
                    self._commit(staged, slow, commit_group, p.threads)
                except BaseException as e:  # noqa: BLE001 - raised in the caller below
                    failed.append(e)
                finally:
                    done.set()
            p.work.commits.submit(commit_now)
            done.wait()
            if failed:
                raise failed[0]
        self.copies = staged.copies
        return True

    def _drop(self, early: Any) -> None:
        """Give back the buffers of a step staged while the ranks agreed, which will not be committed."""
        if isinstance(early, Staged):
            early.settle()
            self.ctx.staging.discard(early.step)

    def _staging(self, step: int, layout: ShardLayout, values: list[Any], metadata: Mapping[str, Any] | None,
                 metrics: Mapping[str, Any] | None, overlap: Any = None) -> Staged:
        """Copy the arrays into the first tier's buffers, through the layout's views of them (a device's
        tensors and an overlapped save's are copied on the copy thread: see :mod:`tierfs.device.copies`)."""
        p = self.ctx
        with stage("staging", step, p.first.name), _nogc.paused():
            return self._stage(p, step, layout, values, metadata, metrics, overlap)

    @staticmethod
    def _stage(p: Context, step: int, layout: ShardLayout, values: list[Any], metadata: Mapping[str, Any] | None,
               metrics: Mapping[str, Any] | None, overlap: Any) -> Staged:
        # (CapacityError before anything is written; while copies hold RAM, they are waited for)
        bufs = room.when_released(p.ledger, p.first, step, lambda: p.staging.buffers(step, layout.files))
        try:
            memos = {f: p.staging.buffer_memo(step, f) for f in layout.files}
            dst, raw = layout.views(bufs, memos)
            copies = layout.copy(values, dst, step, overlap, [(memos[f], bufs[f]) for f in layout.files])
        except BaseException as e:
            p.staging.discard(step)
            if isinstance(e, (RuntimeError, NotImplementedError)):  # a tensor without values, named
                layout.check_tensors(values, DCP_SHARD_KEY in (metadata or {}))
            raise
        return Staged(layout, step, {i: values[i] for i in layout.json}, dict(metadata or {}), dict(metrics or {}),
                      raw, copies=copies)

    def _commit(self, staged: Staged, slow: list[AnyTier], group: Group, threads: int | None = 1) -> None:
        """Checksums (on ``threads``: one leaves training a core), manifest, marker, agreed over ``group``
        (the commit worker's); then hand on to the slow tiers."""
        p, first = self.ctx, self.ctx.first
        step, rank = staged.step, p.group.rank
        try:
            # every rank's manifest is written, and the marker's sums: in one all-reduce whatever the job's size;
            # data-parallel bundles' digests are compared along each group's ranks (sums[0]: the ranks with some)
            with agreement(group, f"commit step {step}", outcome="not committed") as vote:
                vote.sums = _commit_sums()  # as long on every rank, a rank that fails included
                try:
                    with _nogc.paused():
                        manifest = staged.manifest(rank, p.group.world_size, p.block_size)
                    arrays = [manifest.entries[i] for i in staged.layout.arrays]  # as the buffers are
                    with stage("checksum", step, first.name):
                        ready = staged.copies.ready if staged.copies is not None else (lambda j: None)
                        # each entry's checksum starts once its own copy is done
                        crcs = _blocks.run([_blocks.Job(e.name, buf, None, p.block_size, ready=ready(j))
                                          for j, (e, buf) in enumerate(zip(arrays, staged.buffers))],
                                         threads)
                        if staged.copies is not None:
                            staged.copies.wait()
                    for e, c in zip(arrays, crcs):
                        e.crc32c = c
                    with stage("manifest", step, first.name):
                        # the reader's checks: a step no reader takes is never committed (and so never
                        # makes retention drop the steps before it)
                        manifest.validate(entries=not staged.layout.checked)
                        staged.layout.checked = True  # its entries pass: later saves of it need not check them
                        p.staging.persist(step)
                        mbytes = manifest.to_bytes()
                        first.write_file(step, manifest_filename(rank), mbytes)
                        check_complete(first, step, {**manifest.files, manifest_filename(rank): len(mbytes)})
                    held = digests([[manifest.entries[i] for i in m] for m in staged.layout.members],
                                   manifest.bundles, manifest.groups) if manifest.bundles else []
                    vote.sums = [int(bool(held)), manifest.nbytes, *manifest_digest(rank, crc32c(mbytes))]
                except BaseException:
                    staged.settle()
                    p.staging.discard(step)
                    raise
            if vote.sums[0]:  # on every rank alike: all raise, or none
                check_digests(group, step, held, manifest.groups if held else [])
            marker = Marker(step, manifest.world_size, nbytes=vote.sums[1], tiers=staged.tiers,
                            commit=staged.commit, digest=vote.sums[2:])
            self._mark(group, first, step, marker, f"commit step {step}")
        except BaseException:
            # not committed on any rank: this rank's files of the step hold no space (its buffers go back)
            staged.settle()
            p.staging.discard(step)
            p.ledger.abandon(step)
            raise
        p.ledger.committed(step, first.name, len(slow))
        _metrics.SINK.committed(first.name, step, manifest.nbytes)
        _metrics.SINK.space(first)
        log.info("step %d committed in %s: %s%s", step, first.name, _readable.Bytes(marker.nbytes),
                 f"; copies to {[t.name for t in slow]} follow in the background" if slow else "")
        # the step is committed whatever retention does: a failure there is the next call's to raise. Before
        # the copies start: the buffers it frees take the replicas this step brings
        self.retention.apply(first, on_error=p.ledger.fail)
        for t in slow:
            p.ledger.pin(first.name, step)
            _metrics.SINK.queued(t.name, step, manifest.nbytes)
            p.work.copies[t.name].submit(lambda t=t: self.hand_on(step, t, marker, manifest.files,  # type: ignore[misc]
                                                                  (manifest, mbytes)))
        p.ledger.done(step)
        if not slow:
            self._prepare(step, manifest.files)

    def _prepare(self, step: int, sizes: Mapping[str, int]) -> None:
        """Pre-fault the next step's buffers in the first tier once the copies of ``step`` are done (see
        ``Staging.prepare``); ``held``: a step the keep policy lets go is still being uploaded, so its
        buffers are not the next saves' spares and the set is made all the same."""
        held = self.retention.pending(self.ctx.first)
        self.ctx.work.commits.submit(lambda: self.ctx.staging.prepare(step, sizes, held=held))

    def _mark(self, group: Group, tier: Tier, step: int, marker: Marker, what: str) -> None:
        """The owner of ``tier`` writes ``step``'s marker once every expected file is there; every rank
        hears whether it did. If it did not, an owner whose marker went down takes it back, so no copy looks
        committed that the others count as failed."""
        wrote = False
        try:
            with agreement(group, what, outcome="not committed"):
                if self.ctx.ranks.owns(tier):
                    with stage("marker", step, tier.name):
                        commit(tier, step, marker.to_bytes(), self.ctx.ranks.expected_manifests(tier, marker))
                        wrote = True
        except BaseException:
            if wrote:
                try:
                    tier.delete_step(step)
                except Exception as e:  # noqa: BLE001 - the caller's error says more; this one is logged
                    log.warning("tier %s step %d: could not take back the marker (%s)", tier.name, step, e)
            raise

    # -- hand on ------------------------------------------------------------------------------------
    def hand_on(self, step: int, dst: AnyTier, marker: Marker, sizes: Mapping[str, int],
                committed: tuple[Manifest, bytes] | None = None) -> None:
        """This rank's part of putting ``step`` on ``dst`` (an upload, or replication to peers), then the
        bookkeeping: a step not stored there leaves the tier's history, so its policy may take the next.
        ``committed``: this rank's manifest of the step and its bytes, as its commit wrote them."""
        p, first = self.ctx, self.ctx.first
        try:
            try:
                if dst is p.replicator:
                    stored = self._replicate(step, p.replicator, marker, committed)
                else:
                    assert isinstance(dst, Tier)
                    stored = self._upload(step, dst, marker)
            except BaseException as e:
                self._copied(step, dst, False, type(e).__name__)
                # unpinned, a step kept in the first tier only for this copy may go
                self.retention.apply(first, on_error=p.ledger.fail)
                raise
            self._copied(step, dst, stored, "NotStored")
            self.retention.apply(dst)
            if p.ledger.retire(step, first.name):  # staged only for the slower tiers, which now have it
                self.retention.delete(first, step)
            self.retention.apply(first)
        finally:
            p.ledger.released(dst.name, step)  # a save short of RAM tries again (room.when_released)
        if not p.ledger.busy(step):  # the last copy of the step
            self._prepare(step, sizes)

    def _copied(self, step: int, dst: AnyTier, stored: bool, error: str) -> None:
        """The bookkeeping of a copy of ``step`` to ``dst`` that ended: a step not stored there leaves the
        tier's history, so its policy may take the next."""
        p = self.ctx
        _metrics.SINK.copied(dst.name, step, stored, None if stored else error)
        p.ledger.copied(dst.name, step, stored)
        p.ledger.unpin(p.first.name, step)
        p.ledger.done(step)

    def _upload(self, step: int, dst: Tier, marker: Marker) -> bool:
        """Byte copy of this rank's files from the first tier to ``dst``, verified before upload, marker
        last once every rank's shard is there."""
        p, src = self.ctx, self.ctx.first
        group = p.work.copy_groups[dst.name]
        t0 = time.perf_counter()
        spread = self.retention.spread
        with agreement(group, f"copy step {step} to {dst.name}", outcome="not committed") as vote:
            vote.maxes = spread.telling(dst)  # the markers retention's owner deleted: no rank asks the store
            with stage("copy", step, dst.name):
                manifest, mbytes = checked_manifest(src, step, p.group.rank, marker)
                # a damaged RAM copy must not become the durable one; verified and sent within the cap
                pace = p.work.pace(step, dst.name, stoppable=True)
                vote.mine = copy_out(p.work.helper, src, dst, step, manifest, mbytes, pace)  # in the helper if any
        spread.heard(dst, vote.max)
        self._mark(group, dst, step, marker, f"copy step {step} to {dst.name}")
        log.info("step %d copied %s -> %s: %s in %s", step, src.name, dst.name, _readable.Bytes(vote.mine),
                 _readable.Seconds(time.perf_counter() - t0))
        return True

    def _replicate(self, step: int, dst: Replicator, marker: Marker,
                   committed: tuple[Manifest, bytes] | None = None) -> bool:
        """Every rank sends its shard to its peers at once; stored only if every copy is verified. The
        manifest is the one the commit wrote (``committed``), else read back from the first tier."""
        p, src = self.ctx, self.ctx.first
        t0 = time.perf_counter()
        mbytes, files, error, nbytes = b"", {}, None, 0
        try:
            with stage("replication", step, dst.name):
                if committed is not None:
                    manifest, mbytes = committed
                else:
                    mbytes = bytes(src.read_file(step, manifest_filename(p.group.rank)))
                    manifest = Manifest.from_bytes(mbytes)
                # only what no other node holds: the bundles shared with other ranks live in their RAM too
                sent = manifest.replica_files
                files, nbytes = src.read_files(step, list(sent)), sum(sent.values())
        except (TierfsError, OSError, ValueError) as e:
            error = f"{type(e).__name__}: {e}"  # still take part: the receivers refuse
        # no check before sending: each receiver verifies every block as it lands
        failed = dst.replicate(step, marker.to_bytes(), mbytes, files, pace=p.work.pace(step, dst.name), error=error)
        del files
        if failed:
            s, t, why = failed[0]
            log.warning("step %d is not replicated to peers (%d of the copies failed, e.g. rank %d -> %d: %s); "
                        "peers keep their previous step", step, len(failed), s, t, why)
            return False
        log.info("step %d replicated to peers: %s sent in %s", step, _readable.Bytes(nbytes),
                 _readable.Seconds(time.perf_counter() - t0))
        return True
