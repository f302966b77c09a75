"""A restore, top down: every rank gets its shard of the newest step every rank can get, each from the
fastest source holding a verified copy; all ranks move on to an older step together when any rank cannot.

1. :func:`gather_plan`: one gather tells every rank which steps each rank can read from its own tiers and
   which ranks keep a replica of each rank's shard (the :class:`RestorePlan`, the same on every rank).
2. For each step the plan offers, newest first, an :class:`~.sources.Attempt` goes through the sources
   (:mod:`.sources`): this rank's tiers before the replicator (RAM), then with every rank the peers'
   replicas and the entries ranks share, then the tiers after the replicator (object storage). A source
   verifies every block and fills the sink (:mod:`.sinks`).
3. Every rank says how it went (:meth:`Restore._agreed`): a caller's mistake (a target that does not match)
   is raised on every rank; if any rank has no verified copy, all go to the next older step.
4. The step restored: what follows (:mod:`.after`): shards read from elsewhere written into the first tier
   (``localize``), replicas a replaced node lost sent to it again.

When some ranks lack the step in RAM (a replaced node), a rank whose own verified copy is in its target
returns at once: the rest (sending to the ranks without it, agreeing, what follows) goes on in the
background on the restore's own groups (:meth:`Restore._settle`), and the store's next call waits for it.
Should a rank then fail to get its shard, every rank raises (the ranks that returned, at their next call):
they cannot all move to an older step.
"""

from __future__ import annotations

import functools
import logging
from typing import Callable, Sequence

from ...util.stages import operation
from ...util.worker import Detached
from ...ranks import agreement
from ...ranks.reports import publish
from ...errors import RestoreError, RestoreIncompleteError
from ...tiers.base import AnyTier
from ..context import Context
from .after import localize, reseed
from .bundles import WHOLE, holds
from .fill import Landing
from .sinks import Shard, Sink
from .plan import RestorePlan, error_kind, gather_plan
from .sources import Attempt, Bundles, Peers, RestoreInfo, Skipped, TierSource

__all__ = ["Restore", "RestoreInfo", "RestorePlan", "gather_plan", "lost_steps"]

log = logging.getLogger("tierfs")


class Restore:
    """One restore (collective): ``run`` picks the step and fills ``sink`` (None: verify only)."""

    def __init__(self, ctx: Context, usable: Sequence[AnyTier], sink: Sink | None,
                 check: Callable[[], None] = lambda: None, timeout: float | None = None) -> None:
        self.ctx, self.sink, self.check = ctx, sink, check
        # this restore's collectives wait at most ``timeout`` (peer transfers: the store's timeout)
        self.timeout = timeout
        self.base = ctx.group if timeout is None else ctx.group.with_timeout(timeout)
        self.usable = list(usable)
        before, rep, after = ctx.roles(self.usable)
        # the sources, in order: this rank's own tiers, the replicator (peers), the tiers after it
        self.own, self.later = TierSource(ctx, before), TierSource(ctx, after)
        self.replicator = rep
        self.peers = Peers(ctx, rep) if rep is not None else None
        self.bundles = Bundles(ctx, rep)
        self.skipped: Skipped = []

    def run(self, step: int | None, adopt: bool = False, plan: RestorePlan | None = None) -> RestoreInfo:
        """Restore ``step`` (None: the newest every rank can get, else older ones), choosing from ``plan``
        (default: gathered now; a caller restoring several times over one plan gathers it once and notes
        in it what each restore changed, see :mod:`.session`)."""
        if plan is None:
            with operation("restore"):  # what a wait outside a stage says it waited in
                plan = gather_plan(self.ctx, self.usable, self.check, self.base)
        names = [t.name for t in self.usable]
        leave = self.sink is not None and not adopt  # localize: every rank's first tier before returning
        for s in plan.steps(step, names):
            with operation(f"restore step {s}"):
                a = Attempt(s, plan, self.base, self.sink, self.skipped, Landing(self.sink))
                sending = self._try(a, leave)
                if sending is not None and a.got is not None:  # in place: the rest goes on in the background
                    log.info("step %d is in place on this rank (%s); sending it on and agreeing go on in the "
                             "background", s, a.got[0])
                    self.ctx.ledger.pin(self.ctx.first.name, s)  # the RAM copy it sends from stays
                    self._restored(a, names, step is None)
                    info = a.got[0]
                    info.skipped = list(info.skipped)  # the caller's: the background part goes on with its own
                    self.ctx.work.restores.submit(functools.partial(self._settle, a, sending))
                    return info
                if self._agreed(a, left=False):
                    self._restored(a, names, step is None)
                    return self._finish(a, adopt=adopt)
        reasons = "; ".join(f"{t} step {s}: {w}" for t, s, w in self.skipped)
        raise RestoreError(f"no tier holds a verified copy ({reasons})")

    # -- one step -----------------------------------------------------------------------------------
    def _try(self, a: Attempt, leave: bool = False) -> Detached | None:
        """This rank's part of the attempt: its own tiers, then (all ranks together) peers and the entries
        ranks share, then the tiers after the replicator. Returns ``sending`` (with ``leave``) when this
        rank's verified copy is in its target while ranks lacking the step in RAM still receive: the
        caller may return, and :meth:`_settle` goes on."""
        mine = a.step in a.plan.fast[self.ctx.group.rank]
        early = [a.step not in fast for fast in a.plan.fast] if self.peers is not None else []
        if any(early):  # ranks whose RAM lacks the step fetch it first; the others read theirs meanwhile
            assert self.replicator is not None and self.peers is not None
            # the restore's own groups (made here, by every rank): its background part on a rank that
            # returned never meets the caller's collectives on the store's group
            groups = self.replicator.transfer_group()
            if groups is not None:
                a.group = groups if self.timeout is None else groups.with_timeout(self.timeout)
            leave = leave and groups is not None
            if mine:  # this rank sends what it keeps and, from its RAM copy, the entries it shares
                serving = Attempt(a.step, a.plan, a.group, None, [], a.landing, tried=a.tried)
                sending = Detached(functools.partial(self._send_early, serving, early, self.own.unverified(a)))
                try:
                    self.own(a)
                except BaseException:  # never leave the sending thread running on the restore's groups
                    sending.join()
                    raise
                whole = a.got is not None and holds(a.got[1].manifest, a.got[1].files) == WHOLE
                if leave and a.mismatch is None and whole:
                    return sending
                sending.join()
            else:
                self.peers(a, early)
                self.bundles(a)
        elif mine:
            self.own(a)
        self._rest(a)
        return None

    def _send_early(self, serving: Attempt, early: list[bool], serve: Shard | None) -> None:
        """A rank holding the step in RAM, while it reads its own: sends the ranks without it what it keeps
        (``serve``: its copy as it is, for the entries ranks share)."""
        assert self.peers is not None
        with operation(f"restore step {serving.step}"):
            self.peers(serving, early)
            self.bundles(serving, serve)

    def _rest(self, a: Attempt) -> None:
        """The attempt after each rank read its own: peers, then the tiers after the replicator."""
        if self.peers is not None:
            self.peers(a)  # local copies that did not verify
            self.bundles(a)  # the shared entries a peer's replica lacks
        self.later(a)
        self.bundles(a)  # the shared entries a shared tier keeps in their owners' shards

    def _agreed(self, a: Attempt, left: bool) -> bool:
        """Whether every rank has the step (collective); a mismatch anywhere is raised on every rank, and so
        is a rank's failure once ranks have returned the step (``left``: this one did)."""
        s = a.step
        with agreement(a.group, f"restore step {s}", classify=error_kind) as vote:
            vote.mins, vote.maxes = [int(a.got is not None)], [int(left)]  # every rank has it; a rank left
            if a.mismatch is not None:
                raise a.mismatch
        if vote.min[0]:
            return True
        if vote.max[0]:  # rare: who lacks it, and how many had gone
            mine = [a.got is not None, left]
            votes = a.group.all_gather(mine) if a.group.world_size > 1 else [mine]
            gone = sum(1 for _, went in votes if went)
            lacking = [r for r, (has, _) in enumerate(votes) if not has]
            why = "; ".join(f"{t}: {w}" for t, x, w in self.skipped if x == s) if a.got is None else ""
            raise RestoreIncompleteError(
                f"step {s}: rank(s) {lacking[:8]} could not get their shard ({why or 'see their log'}) after "
                f"{gone} rank(s) had restored it and returned; restart the job: its restore starts over, "
                "and a peer's copy that failed its checks is no longer offered")
        if a.got is not None:  # all go back together
            a.skip(a.got[0].tier, "another rank could not restore this step")
        return False

    # -- after the step is chosen -------------------------------------------------------------------
    def _restored(self, a: Attempt, names: list[str], newest: bool) -> None:
        """The attempt's step is the one restored: the job goes on from it (the ledger notes it for the
        timeline rule); when it was to be the newest, the newer steps held by only some ranks, passed over,
        are in ``skipped``, naming the ranks that lack them."""
        self.ctx.ledger.restore_of(a.step)
        if newest:
            self.skipped += [(",".join(names), x, why) for x, why in a.plan.passed_over(a.step)]

    def _settle(self, a: Attempt, sending: Detached) -> None:
        """The rest of a restore this rank returned from (on the store's restore worker): its sends, the
        other ranks' completion, the agreement, then what follows a restore. A failure is raised by the
        store's next call."""
        a.sink, a.landing = None, Landing(None)  # the target is the caller's now: never written again
        got = a.got
        try:
            sending.join()
            with operation(f"restore step {a.step}"):
                self._rest(a)
                self._agreed(a, left=True)
                a.got = got
                self._finish(a, adopt=False)
        except RestoreIncompleteError:
            raise
        except BaseException as e:
            raise RestoreIncompleteError(f"step {a.step}: this rank restored it and returned, but the restore did "
                                         f"not finish on every rank ({type(e).__name__}: {e}); restart the job") from e
        finally:
            self.ctx.ledger.unpin(self.ctx.first.name, a.step)

    def _finish(self, a: Attempt, *, adopt: bool) -> RestoreInfo:
        assert a.got is not None
        info, shard = a.got
        g = a.group
        # every rank's source, through the job's store: each rank writes its own, read on first use
        names = list(self.ctx.names)
        rows = publish(g, f"restore/{a.step}", [names.index(info.tier), -1 if info.peer is None else info.peer,
                                                info.nbytes, round(info.seconds * 1e9)])
        info._ranks, info._report = None, lambda: [
            {"rank": r, "tier": names[t], "peer": None if p < 0 else p, "nbytes": n, "seconds": ns / 1e9}
            for r, (t, p, n, ns) in enumerate(rows())]
        log.info("restored %s", info)
        if adopt:
            localize(self.ctx, g, a.step, info, shard)
        if self.replicator is not None:
            reseed(self.ctx, self.replicator, a.step, a.plan, shard)
        return info
