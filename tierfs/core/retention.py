"""Retention: which committed steps each tier deletes, and deleting them.

A step is kept when its tier's keep policy keeps it, when it is being read or copied (pinned), when it
is transient (staged in the first tier only to be copied on), or when it is the only copy of the newest
step any tier holds. On the first tier, the newest step the replicator holds (whose restore after a lost
node needs the other ranks' own copies) takes the place of a newer one the policy keeps that the
replicator lacks. The rules are :func:`doomed`, a pure function of a ledger snapshot; the store runs them
after every save on the tiers it touched, and ``tierfs gc`` on every tier at once.

After a save, a step of a shared tier that takes deletions file by file (the object tier,
:class:`~tierfs.tiers.capabilities.FileDeletes`) is deleted by every rank, not by the owner alone: the
owner deletes the marker (the step is no longer committed), and each rank deletes its own files once it
sees the marker gone, at the retention of a later save (:class:`Spread`). What a rank asks of the object
store per save is then a few requests about its own files, whatever the job's size. The steps the last
saves dropped, whose other ranks' files no later save will take back, the owner removes when the store
closes (:meth:`Retention.close`: one listing, then what is left of them), so a clean close leaves only the
kept steps. A job that ends without closing leaves their files, without a marker; the next job's store
removes them when it opens, naming retention as their cause.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable, Collection, Mapping

from ..util.stages import stage
from ..errors import TierfsError
from ..format import MARKER, Manifest, manifest_filename
from ..policies import StepInfo
from ..tiers.base import AnyTier, Tier
from ..tiers.capabilities import FileDeletes, SharedDirectory
from .ledger import Snapshot
from .context import Context
from .reads import Reader

log = logging.getLogger("tierfs")


def doomed(tier: AnyTier, snap: Snapshot, held: Mapping[str, set[int]] | None = None,
           relied: int | None = None, unjudged: Collection[int] = ()) -> list[int]:
    """The steps of ``tier`` that retention deletes, given what every tier holds (default: the snapshot's
    holdings): not kept by the tier's policy, not pinned, not transient, and not the only copy of the
    newest step.

    ``relied``: a step another tier's copies need this one to keep (:meth:`Retention.relied`). It is kept
    in place of a newer step the policy keeps only until the next save (the oldest such, never the tier's
    newest; one the replicator lacks), never beside them: the tier holds no more steps than its policy
    keeps, and none it keeps for longer (``EveryNSteps``'s, ``BestN``'s) goes. ``unjudged``: steps the
    policy does not see (their times and metrics could not be read) and that are kept."""
    held = snap.held if held is None else held
    committed = sorted(held[tier.name] - snap.transient)
    if not committed:
        return []
    infos = [snap.info.get(s, StepInfo(s)) for s in committed if s not in unjudged]
    keep = tier.keep_policy.keep(infos) | set(unjudged)
    if relied is not None and relied in committed and relied not in keep:
        # what the policy would keep once one more step came: the steps it keeps now only until then
        ahead = tier.keep_policy.keep(infos + [StepInfo(committed[-1] + 1, max((i.time for i in infos), default=0.0))])
        newer = sorted(s for s in keep if relied < s < committed[-1] and s not in ahead)
        if newer:
            keep = keep - {newer[0]} | {relied}
    newest = max(max(h) for h in held.values() if h)
    return [s for s in committed if s not in keep and s not in snap.pinned[tier.name]
            and not (s == newest and not any(s in h for n, h in held.items() if n != tier.name))]


class Retention:
    """Applies the keep policies of a store's tiers."""

    def __init__(self, ctx: Context, reader: Reader) -> None:
        self.ctx, self.reader = ctx, reader
        self.spread = Spread(ctx)
        self.unreadable: set[int] = set()  # steps whose time and metrics could not be read: kept, not retried

    def judged(self, tier: AnyTier, snap: Snapshot) -> tuple[Snapshot, set[int]]:
        """The snapshot to judge ``tier``'s steps by, and the steps its policy cannot judge. A policy that uses
        times or metrics first gets those of the steps this process did not save (an earlier run's) from
        their markers and manifests, once per step, on the file tiers the snapshot says hold them (no
        listing); a step whose cannot be read is kept, with a warning. (The replicator's steps are judged by
        their numbers: its copies are not read that way.)"""
        if not tier.keep_policy.uses_info or tier is self.ctx.replicator:
            return snap, set()
        unknown = sorted(snap.held[tier.name] - set(snap.info) - self.unreadable)
        for s in unknown:
            try:
                holding = [t for t in self.ctx.files if s in snap.held[t.name]]
                self.ctx.ledger.learn(s, self.reader.step_info(s, holding))
            except (TierfsError, OSError, ValueError, KeyError) as e:
                log.warning("step %d: no readable marker or manifest (%s); its time and metrics are unknown, so "
                            "retention keeps it", s, e)
                self.unreadable.add(s)
        return (self.ctx.ledger.snapshot() if unknown else snap), self.unreadable & snap.held[tier.name]

    def relied(self, tier: AnyTier, held: Mapping[str, set[int]]) -> int | None:
        """The step of ``tier`` another tier's copies need it to keep: on the first tier, the newest step the
        replicator holds. A lost node's shard comes back from its peers' copies (or is rebuilt from its
        group's) while every other rank's comes from its own RAM, so the replicator's step is restorable
        only beside those. Kept in place of a newer step the replicator lacks (:func:`doomed`): with
        ``LatestN(2)``, while later steps fail to replicate; a policy that keeps one step cannot keep it."""
        rep = self.ctx.replicator
        if rep is None or tier is not self.ctx.first or not held.get(rep.name):
            return None
        return max(held[rep.name])

    def apply(self, tier: AnyTier, on_error: Callable[[BaseException], None] | None = None) -> None:
        """Delete what ``tier``'s keep policy lets go now; a failure is raised, or handed to ``on_error``."""
        try:
            snap, unjudged = self.judged(tier, self.ctx.ledger.snapshot())
            for s in doomed(tier, snap, relied=self.relied(tier, snap.held), unjudged=unjudged):
                log.debug("tier %s: retention deletes step %d", tier.name, s)
                self.delete(tier, s, spread=True)
            self.spread.sweep(tier)
        except Exception as e:
            if on_error is None:
                raise
            log.error("tier %s: retention failed (%s); raised by the next call", tier.name, e)
            on_error(e)

    def close(self) -> None:
        """At a clean close (every save and copy done): remove what is left of the steps retention dropped
        from the shared tiers it spreads over the ranks (:meth:`Spread.close`). Never raises: what a
        failure leaves, the next store's open removes."""
        for tier in self.ctx.tiers:
            self.spread.close(tier)

    def pending(self, tier: AnyTier) -> bool:
        """Whether ``tier`` holds a step its keep policy lets go that is still being read or copied (its
        space comes free once that is done)."""
        snap = self.ctx.ledger.snapshot()
        committed = sorted(snap.held[tier.name] - snap.transient)
        keep = set(tier.keep_policy.keep([snap.info.get(s, StepInfo(s)) for s in committed])) if committed else set()
        return any(s not in keep and s in snap.pinned[tier.name] for s in committed)

    def plan(self) -> dict[str, list[int]]:
        """``{tier: [steps its keep policy would delete now]}``, deleting nothing, for every tier, as the
        deletions would go tier by tier. Steps this process did not save get their commit time and metrics
        from their marker and manifest first; a step whose marker cannot be read is kept and counts for
        nothing (it would otherwise be the newest step, and the good ones would go)."""
        p = self.ctx
        p.refresh()
        out: dict[str, list[int]] = {}
        snap = p.ledger.snapshot()
        held = {n: set(h) for n, h in snap.held.items()}
        for t in p.files:  # a step whose marker does not parse is no step: kept, and never the newest
            for s in sorted(held[t.name]):
                try:
                    t.read_marker(s)
                except (TierfsError, OSError, ValueError) as e:
                    log.warning("tier %s step %d: its commit marker cannot be read (%s); kept, not counted", t.name,
                                s, e)
                    held[t.name].discard(s)
        for tier in p.tiers:
            snap, unjudged = self.judged(tier, snap)
            out[tier.name] = doomed(tier, snap, held, self.relied(tier, held), unjudged)
            held[tier.name] -= set(out[tier.name])
        return out

    def supersede(self, step: int, stale: list[int], restored: int | None) -> None:
        """Remove the steps saving ``step`` supersedes (:mod:`.timeline`) from every tier: this rank's part,
        newest first, each marker first."""
        if not stale:
            return
        why = f"it restored step {restored}" if restored is not None and restored < step else "it saves an older step"
        log.warning("step %d: removing steps %s from every tier: they are from the run this job went back from "
                    "(%s)", step, stale, why)
        for s in stale:
            for t in self.ctx.tiers:
                self.delete(t, s)

    def delete(self, tier: AnyTier, step: int, *, spread: bool = False) -> None:
        """Delete ``step`` from ``tier``, as this rank's part: ranks sharing a node's directory each take
        back their own files and the owner drops the marker; with ``spread`` (every rank deletes the step:
        the retention after a save) on a shared tier that takes deletions file by file, the same, each
        rank's files once the marker is gone (:class:`Spread`); elsewhere the owner deletes the step."""
        p = self.ctx
        if not p.ledger.claim(tier.name, step):
            return
        with stage("retention", step, tier.name):
            if spread and self.spread.applies(tier):
                self.spread.start(tier, step)
            else:
                self._delete(tier, step)

    def _delete(self, tier: AnyTier, step: int) -> None:
        p = self.ctx
        if tier is p.replicator:
            tier.delete_step(step)  # the copies this rank keeps
            return
        assert isinstance(tier, Tier)
        if isinstance(tier, SharedDirectory) and len(p.ranks.sharing(tier)) > 1:
            tier.release(step, p.group.rank, marker=p.ranks.owns(tier))
        elif p.ranks.owns(tier):
            tier.delete_step(step)


class Spread:
    """The deletions retention spreads over the ranks of a shared tier: the owner deletes a doomed step's
    marker at once; each rank keeps the step as pending and deletes its own files (those its manifest
    names, and the manifest) at a later save's retention, once the marker is gone, so no rank's files go
    while the step still reads as committed. A step saved again before then is
    dropped from the pending steps, never deleted.

    The marker's deletion is ordered before the other ranks' check by the next save's agreements on the
    tier: the owner deletes it before it takes part in them. The owner also says which markers it deleted
    in the next copy's agreement on the tier (:meth:`telling`, :meth:`heard`: a few integers in the
    all-reduce the copy does anyway), so the other ranks need not ask the store: at 8,192 ranks that is
    8,191 requests fewer on one key per save. A step a rank is not told of (more at once than
    :data:`TOLD`, or doomed there later than on the owner) it checks with the HEAD request. The steps the
    last save dropped have no next save, so the owner, which deleted their markers itself, removes what is
    left of them when the store closes (:meth:`close`), without waiting for the other ranks."""

    #: the steps the owner remembers having dropped, per tier (the newest): what :meth:`close` may remove
    REMEMBERED = 1024
    #: the markers the owner tells of in one agreement, at most
    TOLD = 8

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self._lock = threading.Lock()
        #: tier -> {step: whether the marker is known gone (else: checked at a later sweep)}
        self._pending: dict[str, dict[int, bool]] = {}
        self._fresh: dict[str, set[int]] = {}  # pending since this retention: checked from the next one
        self._dropped: dict[str, set[int]] = {}  # the owner's: markers it deleted, other ranks' files may remain
        self._told: dict[str, set[int]] = {}  # the owner's: markers deleted since its last telling

    def applies(self, tier: AnyTier) -> bool:
        return (tier is not self.ctx.replicator and isinstance(tier, Tier) and isinstance(tier, FileDeletes)
                and not tier.is_local and len(self.ctx.ranks.sharing(tier)) > 1)

    def start(self, tier: AnyTier, step: int) -> None:
        """This rank's first part of deleting ``step`` (claimed): the owner deletes the marker."""
        assert isinstance(tier, FileDeletes)
        owner = self.ctx.ranks.owns(tier)
        if owner:
            tier.delete_files(step, [MARKER])
        with self._lock:
            self._pending.setdefault(tier.name, {})[step] = owner
            if not owner:
                self._fresh.setdefault(tier.name, set()).add(step)
            else:
                self._told.setdefault(tier.name, set()).add(step)
                dropped = self._dropped.setdefault(tier.name, set())
                dropped.add(step)
                if len(dropped) > self.REMEMBERED:
                    dropped.discard(min(dropped))

    def telling(self, tier: AnyTier) -> list[int]:
        """What this rank says in the next copy's agreement on ``tier`` (the same length on every rank, to be
        reduced by maximum): the owner, the newest steps whose markers it deleted since it last said; the
        other ranks, nothing (-1)."""
        if not self.applies(tier):
            return []
        with self._lock:
            told = sorted(self._told.pop(tier.name, set()))[-self.TOLD:]
        return told + [-1] * (self.TOLD - len(told))

    def heard(self, tier: AnyTier, steps: list[int]) -> None:
        """What the agreement reduced from :meth:`telling`: the pending steps among ``steps`` are gone."""
        with self._lock:
            pending = self._pending.get(tier.name, {})
            for s in steps:
                if s in pending:
                    pending[s] = True

    def sweep(self, tier: AnyTier) -> None:
        """Delete this rank's files of the pending steps whose marker is gone."""
        if not self.applies(tier):
            return
        assert isinstance(tier, Tier) and isinstance(tier, FileDeletes)
        with self._lock:
            pending = dict(self._pending.get(tier.name, {}))
            fresh, self._fresh[tier.name] = self._fresh.get(tier.name, set()), set()
        snap = self.ctx.ledger.snapshot()
        for s, gone in sorted(pending.items()):
            if s in snap.held[tier.name] or self.ctx.ledger.busy(s):
                self._done(tier, s)  # saved again since: its files are the new save's
                continue
            if s in fresh or s in snap.pinned[tier.name]:
                continue
            if not gone and tier.sizes_of(s, [MARKER]):
                continue  # the owner has not deleted the marker yet
            with stage("retention", s, tier.name):
                self._take_back(tier, s)
            self._done(tier, s)

    def _done(self, tier: AnyTier, step: int) -> None:
        with self._lock:
            self._pending.get(tier.name, {}).pop(step, None)

    def _take_back(self, tier: Tier, step: int) -> None:
        """Delete this rank's files of ``step``: those its manifest names, and the manifest."""
        assert isinstance(tier, FileDeletes)
        name = manifest_filename(self.ctx.group.rank)
        try:
            held = Manifest.from_bytes(bytes(tier.read_file(step, name))).held_files(tier.is_local)
            own = name.split(".", 1)[0] + "."  # "rank_00003.": never another rank's file, whatever it names
            files = sorted(n for n in held if n.startswith(own) and n != name)
        except FileNotFoundError:
            files = []  # nothing of this rank's is left (or it never uploaded this step)
        except (TierfsError, ValueError) as e:  # an unreadable manifest: the next store's open removes the step
            log.warning("tier %s step %d: this rank's manifest is unreadable (%s); its files stay until the "
                        "next store opens", tier.name, step, e)
            return
        tier.delete_files(step, [*files, name])  # one batch: what a failure leaves, marker-less, the next open removes
        try:
            tier.remove_if_empty(step)
        except (TierfsError, OSError) as e:  # only an empty directory is left behind
            log.debug("tier %s step %d: directory not removed (%s)", tier.name, step, e)

    def close(self, tier: AnyTier) -> None:
        """The owner's part of a clean close: remove what is left of the steps it dropped (their marker
        deleted; the other ranks' files, which no later save takes back). One listing of the tier, then a
        deletion per step left; only steps without a marker that this store dropped and has not saved
        again. Never raises: a failure is logged, and the next store's open removes what is left."""
        with self._lock:
            dropped, self._dropped[tier.name] = self._dropped.get(tier.name, set()), set()
        if not dropped or not self.applies(tier) or not self.ctx.ranks.owns(tier):
            return
        assert isinstance(tier, Tier)
        try:
            listed = tier.list_steps()
        except Exception as e:  # noqa: BLE001 - at close: logged, never raised
            log.warning("tier %s: could not list the steps at close (%s); what is left of the steps retention "
                        "dropped is removed when the next store opens", tier.name, e)
            return
        snap = self.ctx.ledger.snapshot()
        for s in sorted(s for s, ok in listed.items() if not ok and s in dropped):
            if s in snap.held[tier.name] or self.ctx.ledger.busy(s):
                continue  # saved again since
            log.debug("tier %s: removing the remaining files of step %d, dropped by retention", tier.name, s)
            try:
                with stage("retention", s, tier.name):
                    tier.delete_step(s)
            except Exception as e:  # noqa: BLE001 - at close: logged, never raised
                log.warning("tier %s: the remaining files of step %d, dropped by retention, were not removed "
                            "(%s); the next store's open removes them", tier.name, s, e)
            self._done(tier, s)
