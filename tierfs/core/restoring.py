"""Restore: every rank gets its shard of the newest step every rank can get, each from the fastest source
holding a verified copy; all ranks move on to an older step together when any rank cannot.

1. One gather (:func:`gather_plan`) tells every rank which steps each rank can read from its own tiers
   and which ranks keep a replica of each rank's shard: the :class:`RestorePlan`, the same on every rank.
2. For each step the plan offers, newest first, this rank tries its own tiers before the replicator,
   fastest first; then every rank takes part while those still without their shard fetch it from a
   holder (the load spread over holders, a bad copy sends them to the next); then the tiers after it.
3. Every rank says how it went: a caller's mistake (a target that does not match) is raised on every
   rank; if any rank has no verified copy, all go to the next older step.
4. The step restored: ``localize`` writes shards read from elsewhere into the first tier, and ranks that
   lost the replicas they kept for others (a replaced node) get them back.

When some ranks lack the step in RAM (a replaced node), a rank whose own verified copy is in its target
returns at once: steps 2-4 go on in the background (sending to the ranks without it, agreeing) on the
restore's own groups, and the store's next call waits for them. Should a rank then fail to get its shard,
every rank raises (the ranks that returned, at their next call): they cannot all move to an older step.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Any, Callable, Sequence

from .._worker import Detached
from .._stages import operation, stage
from ..dist import agree
from ..errors import ArgumentError, RestoreError, RestoreIncompleteError, StateMismatchError, TierfsError
from ..tiers.base import Holder, Replicator, Tier
from ..tiers.peer import plan_fetch
from .layout import ReadViews
from .parts import Parts
from .completing import NONE, OWNED, UNIQUE, WHOLE, complete, holds
from .landing import Landing
from .reading import UNUSABLE, Reader, Shard, Skipped, fill
from .localizing import adopt as localize
from .reseeding import reseed
from .restoreplan import RestoreInfo, RestorePlan, error_kind, gather_plan
from .sinks import Sink

__all__ = ["Restore", "RestoreInfo", "RestorePlan", "gather_plan"]

log = logging.getLogger("tierfs")

#: how a peer's copy that is itself bad fails at its receiver (not the receiver's own trouble): checksums,
#: a manifest that does not match its marker, files the holder can no longer read
BAD_COPY = ("ChecksumError", "FormatError", "TierfsError: the holder cannot send it")


class Restore:
    """One restore (collective): ``run`` picks the step and fills ``sink`` (None: verify only)."""

    def __init__(self, parts: Parts, reader: Reader, usable: Sequence[Holder], sink: Sink | None,
                 check: Callable[[], None] = lambda: None, timeout: float | None = None) -> None:
        self.parts, self.reader, self.sink, self.check = parts, reader, sink, check
        # this restore's collectives wait at most ``timeout`` (peer transfers: the store's timeout)
        self.timeout = timeout
        self.base = parts.group if timeout is None else parts.group.with_timeout(timeout)
        self.group = self.base  # the step's: the restore's own groups while ranks lack it in RAM
        self.usable = list(usable)
        # this rank's own tiers, fastest first; the replicator (peers); the tiers after it
        self.before, self.replicator, self.after = parts.roles(self.usable)
        self.skipped: Skipped = []
        self.tried: set[tuple[int, int]] = set()  # (rank, holder) pairs tried for the step being tried
        self.landing = Landing(sink)  # where a peer's entries land straight

    def run(self, step: int | None, adopt: bool = False) -> RestoreInfo:
        with operation("restore"):  # what a wait outside a stage says it waited in
            return self._run(step, adopt)

    def _run(self, step: int | None, adopt: bool) -> RestoreInfo:
        plan = gather_plan(self.parts, self.usable, self.check, self.base)
        names = [t.name for t in self.usable]
        order = plan.steps(step, names)
        leave = self.sink is not None and not adopt  # localize: every rank's first tier before returning
        for s in order:
            with operation(f"restore step {s}"):
                got, mismatch, sending = self._try(s, plan, leave)
            if sending is not None and got is not None:  # in place: the rest goes on in the background
                log.info("step %d is in place on this rank (%s); sending it on and agreeing go on in the "
                         "background", s, got[0])
                self.parts.ledger.pin(self.parts.first.name, s)  # the RAM copy it sends from stays
                self._restored(s, plan, names, step is None)
                info = got[0]
                info.skipped = list(info.skipped)  # the caller's: the background part goes on with its own
                self.parts.restores.submit(functools.partial(self._settle, s, plan, got, sending))
                return info
            with operation(f"restore step {s}"):
                if self._agreed(s, got, mismatch, left=False):
                    assert got is not None
                    self._restored(s, plan, names, step is None)
                    return self._finish(s, plan, *got, adopt=adopt)
        reasons = "; ".join(f"{t} step {s}: {w}" for t, s, w in self.skipped)
        raise RestoreError(f"no tier holds a verified copy ({reasons})")

    def _agreed(self, s: int, got: tuple[RestoreInfo, Shard] | None, mismatch: BaseException | None,
                left: bool) -> bool:
        """Whether every rank has step ``s`` (collective); a mismatch anywhere is raised on every rank, and
        so is a rank's failure once ranks have returned ``s`` (``left``: this one did)."""
        votes = agree(self.group, [got is not None, left], mismatch, f"restore step {s}", classify=error_kind)
        if all(has for has, _ in votes):
            return True
        gone = sum(1 for _, went in votes if went)
        if gone:
            lacking = [r for r, (has, _) in enumerate(votes) if not has]
            why = "; ".join(f"{t}: {w}" for t, x, w in self.skipped if x == s) if got is None else ""
            raise RestoreIncompleteError(
                f"step {s}: rank(s) {lacking[:8]} could not get their shard ({why or 'see their log'}) after "
                f"{gone} rank(s) had restored it and returned; restart the job: its restore starts over, "
                "and a peer's copy that failed its checks is no longer offered")
        if got is not None:  # all go back together
            self.skipped.append((got[0].tier, s, "another rank could not restore this step"))
        return False

    def _restored(self, s: int, plan: RestorePlan, names: list[str], newest: bool) -> None:
        """Step ``s`` is the one restored: the job goes on from it (the ledger notes it for the timeline rule);
        when it was to be the newest, the newer steps held by only some ranks, passed over, are in ``skipped``,
        naming the ranks that lack them."""
        self.parts.ledger.restore_of(s)
        passed = plan.passed_over(s) if newest else []
        for x, lacking in passed:
            self.skipped.append((",".join(names), x, f"held by only some ranks: rank(s) {lacking[:8]} cannot get it"))
        if passed:
            log.warning("steps %s could not be restored for every rank and were passed over; the next save "
                        "removes them", [x for x, _ in passed])

    def _settle(self, s: int, plan: RestorePlan, got: tuple[RestoreInfo, Shard], sending: Detached) -> None:
        """The rest of a restore this rank returned from (on the store's restore worker): its sends, the
        other ranks' completion, the agreement, then what follows a restore. A failure is raised by the
        store's next call."""
        self.sink, self.landing = None, Landing(None)  # the target is the caller's now: never written again
        try:
            sending.join()
            with operation(f"restore step {s}"):
                after, mismatch = self._rest(s, plan, got, None)
                self._agreed(s, after, mismatch, left=True)
                self._finish(s, plan, *got, adopt=False)
        except RestoreIncompleteError:
            raise
        except BaseException as e:
            raise RestoreIncompleteError(f"step {s}: this rank restored it and returned, but the restore did not "
                                         f"finish on every rank ({type(e).__name__}: {e}); restart the job") from e
        finally:
            self.parts.ledger.unpin(self.parts.first.name, s)

    # -- one step -----------------------------------------------------------------------------------
    def _try(self, s: int, plan: RestorePlan, leave: bool = False
             ) -> tuple[tuple[RestoreInfo, Shard] | None, BaseException | None, Detached | None]:
        """This rank's part of step ``s``: its own tiers, then (all ranks together) peers, then the tiers
        after the replicator. Returns ``((info, shard) or None, error to raise on every rank, sending)``;
        never raises between collectives. ``sending`` (with ``leave``): this rank's verified copy is in
        its target while ranks lacking the step in RAM still receive; the caller may return, and
        :meth:`_settle` goes on."""
        got: tuple[RestoreInfo, Shard] | None = None
        mismatch: BaseException | None = None
        self.tried = set()
        rep = self.replicator
        mine = s in plan.fast[self.parts.group.rank]
        early = [s not in fast for fast in plan.fast] if rep is not None else []
        self.group = self.base
        if any(early):  # ranks whose RAM lacks the step fetch it first; the others read theirs meanwhile
            assert rep is not None
            # the restore's own groups (made here, by every rank): its background part on a rank that
            # returned never meets the caller's collectives on the store's group
            own = rep.transfer_group()
            if own is not None:
                self.group = own if self.timeout is None else own.with_timeout(self.timeout)
            leave = leave and own is not None
            if mine:  # this rank sends what it keeps and, from its RAM copy, the entries it shares
                serve = self._unverified(s, plan)
                sending = Detached(functools.partial(self._send_early, s, plan, rep, early, serve))
                try:
                    got, mismatch = self._read_local(s, plan)
                    whole = got is not None and holds(got[1].manifest, got[1].files) == WHOLE
                except BaseException:  # never leave the sending thread running on the restore's groups
                    sending.join()
                    raise
                if leave and mismatch is None and whole:
                    return got, mismatch, sending
                sending.join()
            else:
                got, mismatch = self._from_peers(s, plan, rep, got, mismatch, early)
                got, mismatch = self._complete(s, got, mismatch)
        elif mine:
            got, mismatch = self._read_local(s, plan)
        got, mismatch = self._rest(s, plan, got, mismatch)
        return got, mismatch, None

    def _send_early(self, s: int, plan: RestorePlan, rep: Replicator, early: list[bool], serve: Shard | None) -> None:
        """A rank holding ``s`` in RAM, while it reads its own: sends the ranks without it what it keeps."""
        with operation(f"restore step {s}"):
            self._from_peers(s, plan, rep, None, None, early)
            self._complete(s, None, None, serve)

    def _rest(self, s: int, plan: RestorePlan, got: tuple[RestoreInfo, Shard] | None, mismatch: BaseException | None
              ) -> tuple[tuple[RestoreInfo, Shard] | None, BaseException | None]:
        """Step ``s`` after each rank read its own: peers, then the tiers after the replicator."""
        rep = self.replicator
        if rep is not None:
            got, mismatch = self._from_peers(s, plan, rep, got, mismatch)  # local copies that did not verify
            got, mismatch = self._complete(s, got, mismatch)  # the shared entries a peer's replica lacks
        if got is None and mismatch is None:
            try:
                got = self._from_tiers(s, self.after, plan)
            except Exception as e:  # noqa: BLE001 - as above
                mismatch = e
        return self._complete(s, got, mismatch)  # the shared entries a shared tier keeps in their owners' shards

    def _complete(self, s: int, got: tuple[RestoreInfo, Shard] | None, mismatch: BaseException | None,
                  serve: Shard | None = None) -> tuple[tuple[RestoreInfo, Shard] | None, BaseException | None]:
        """Every rank takes part while ranks whose shard lacks shared entries get them from the ranks that
        hold them (:mod:`.completing`), then fills its target; a rank that cannot drops its shard. A rank
        still reading its own copy sends from it as it is (``serve``, :meth:`_unverified`)."""
        shard = got[1] if got is not None else serve
        status = holds(shard.manifest, shard.files) if shard is not None else NONE
        every = self.group.all_gather(status) if self.group.world_size > 1 else [status]
        if not any(x in (UNIQUE, OWNED) for x in every):
            return got, mismatch
        t0 = time.perf_counter()
        if shard is not None and status in (OWNED, WHOLE):
            shard = shard.whole()  # it may send entries on
            got = (got[0], shard) if got is not None else None
        files = dict(shard.files) if shard is not None else {}
        with stage("complete", s):
            rep = self.replicator  # its groups spread a transfer over several connections
            g = rep.transfer_group() if rep is not None else None
            why = complete(g or self.group, s, shard.manifest if shard is not None else None, files, every,
                           landing=self.landing)
        if got is None or status == WHOLE:
            return got, mismatch
        info, shard = got
        if why is None:
            shard = Shard(shard.manifest, shard.mbytes, shard.marker, files,
                          self.landing.landed(shard, set(files) - set(shard.files)))
            try:
                # every block was checked: where it was read (a tier, a peer's replica) or as it landed
                fill(None, s, shard, self.sink, self.parts.threads, verified=True)
                info.seconds += time.perf_counter() - t0
                return (info, shard), mismatch
            except (StateMismatchError, ArgumentError) as e:  # the target is wrong, not the copy
                return None, e
            except UNUSABLE as e:
                why = f"{type(e).__name__}: {e}"
            except Exception as e:  # noqa: BLE001 - filling the target failed: raised by all ranks
                return None, e
        log.warning("tier %s step %d: the entries shared with other ranks could not be completed (%s)",
                    info.tier, s, why)
        self.skipped.append((info.tier, s, f"shared entries: {why}"))
        return None, mismatch

    def _read_local(self, s: int, plan: RestorePlan) -> tuple[tuple[RestoreInfo, Shard] | None, BaseException | None]:
        """This rank's shard from its tiers before the replicator: ``(got, mismatch)``."""
        try:
            return self._from_tiers(s, self.before, plan), None
        except Exception as e:  # noqa: BLE001 - a mismatch, or a failure filling the target: raised by all
            return None, e

    def _from_tiers(self, s: int, tiers: Sequence[Tier], plan: RestorePlan) -> tuple[RestoreInfo, Shard] | None:
        """This rank's shard of ``s`` from the first of ``tiers`` holding a copy that verifies, or None."""
        def read(t: Tier) -> tuple[Shard, float]:
            t0 = time.perf_counter()
            return self.reader.read_shard(t, s, self.parts.group.rank, self.sink), time.perf_counter() - t0
        found = self.reader.first_verified([t for t in tiers if s in plan.local[t.name]], s, read, self.skipped)
        if found is None:
            return None
        tier, (shard, seconds) = found
        return self._info(s, tier.name, shard, seconds), shard

    def _from_peers(self, s: int, plan: RestorePlan, rep: Replicator, got: Any, mismatch: BaseException | None,
                    needs: list[bool] | None = None) -> tuple[Any, BaseException | None]:
        """Ranks still without their shard (``needs``, the same on every rank; default: asked) get it from a
        peer that keeps a copy; every rank takes part (holders send). Holders that fail are dropped and the
        next one tried."""
        g = self.group
        needs = list(needs) if needs is not None else g.all_gather(got is None and mismatch is None)
        tried = self.tried
        while True:
            options = {r: [h for h in plan.holders.get((s, r), []) if (r, h) not in tried]
                       for r, need in enumerate(needs) if need}
            assign = plan_fetch({r: hs for r, hs in options.items() if hs})
            if not assign:
                return got, mismatch
            t0 = time.perf_counter()
            with self.parts.ledger.pinned(rep.name, s):  # retention must not delete what a holder sends
                res = rep.fetch(s, assign, landing=self.landing)
            if isinstance(res, tuple):
                manifest, mbytes, marker, files = res
                try:
                    shard = Shard(manifest, mbytes, marker, files)
                    shard.landed = self.landing.landed(shard, set(files))
                    if self.sink is not None:
                        self.sink.check(manifest)  # the target's mismatch, before the others hear it landed
                    info = self._info(s, rep.name, shard, time.perf_counter() - t0)
                    info.peer = assign[g.rank]
                    got = (info, shard)
                except (TierfsError, ValueError, KeyError) as e:
                    if isinstance(e, (StateMismatchError, ArgumentError)):  # the target is wrong, not the copy
                        mismatch = e
                    res = f"{type(e).__name__}: {e}"
                except Exception as e:  # noqa: BLE001 - filling the target failed: raised by all ranks
                    mismatch, res = e, f"{type(e).__name__}: {e}"
            if isinstance(res, str):
                why = f"from rank {assign[g.rank]}: {res}"
                log.warning("tier %s step %d: the copy %s is unusable, trying another source", rep.name, s, why)
                self.skipped.append((rep.name, s, why))
            ok = not isinstance(res, str)
            received = isinstance(res, tuple)  # this rank's shard came in this round
            # 1: got it (or its target is wrong: raised by all); -1: the copy itself is bad; 0: it failed
            vote = 1 if ok or mismatch is not None else -1 if isinstance(res, str) and res.startswith(BAD_COPY) else 0
            for r, v in enumerate(g.all_gather(vote)):
                if r in assign:
                    tried.add((r, assign[r]))
                    if v > 0:
                        needs[r] = False
                    elif v < 0:  # no later restore picks it; re-seeding after this one replaces it
                        plan.holders[(s, r)].remove(assign[r])
                        if assign[r] == g.rank:
                            _drop(rep, s, r)
            if received and got is not None and mismatch is None and holds(got[1].manifest, got[1].files) == WHOLE:
                try:  # after the others heard: this copy overlaps their own reads. Every block was checked as
                    # it landed; a failure now is the target's (else completed from other ranks first)
                    fill(None, s, got[1], self.sink, self.parts.threads, verified=True)
                    got[0].seconds = time.perf_counter() - t0
                except Exception as e:  # noqa: BLE001 - raised by all ranks
                    got, mismatch = None, e


    def _unverified(self, s: int, plan: RestorePlan) -> Shard | None:
        """This rank's whole shard of ``s`` in its fastest tier holding it, unverified (for sending on while
        it is read and verified for this rank), or None (then it neither sends nor receives meanwhile)."""
        for t in self.before:
            if s in plan.local[t.name]:
                try:
                    shard = self.reader.open_shard(t, s, self.parts.group.rank)
                    return shard if holds(shard.manifest, shard.files) == WHOLE else None
                except UNUSABLE as e:
                    log.info("tier %s step %d: sending nothing from this rank's copy (%s)", t.name, s, e)
                return None
        return None

    def _info(self, s: int, tier: str, shard: Shard, seconds: float) -> RestoreInfo:
        m = shard.manifest
        # copies: the manifest is parsed once per step and shared by later reads
        info = RestoreInfo(s, tier, m.nbytes, seconds, self.skipped, dict(m.metadata), dict(m.metrics))
        if self.sink is not None and self.sink.wanted is not None:
            info.unused = sorted(ReadViews.of(m).names - self.sink.wanted)
        return info

    # -- after the step is chosen -------------------------------------------------------------------
    def _finish(self, s: int, plan: RestorePlan, info: RestoreInfo, shard: Shard, *, adopt: bool) -> RestoreInfo:
        g = self.group
        if g.world_size > 1:
            info.ranks = g.all_gather({"rank": g.rank, "tier": info.tier, "peer": info.peer,
                                       "nbytes": info.nbytes, "seconds": info.seconds})
        log.info("restored %s", info)
        if adopt:
            localize(self.parts, self.group, s, info, shard)
        if self.replicator is not None:
            reseed(self.parts, self.replicator, s, plan, shard)
        return info

def _drop(rep: Replicator, s: int, r: int) -> None:
    try:
        rep.drop(s, r)
    except Exception as e:  # noqa: BLE001 - only the copy is left behind: the next restore checks it again
        log.warning("tier %s step %d: could not drop the copy of rank %d's shard (%s)", rep.name, s, r, e)
