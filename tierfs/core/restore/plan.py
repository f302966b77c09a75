"""The restore's plan: which steps each rank can get, from its own tiers or from a replica, agreed by
every rank in one collective step (:func:`gather_plan`), and the choice of steps it allows.

In a normal restart every rank holds the same steps and keeps the same replicas relative to itself (a
ring's neighbour's): the ranks then agree in two all-reduces of a few integers and each builds the whole
plan itself; only when the ranks' views differ (a node lost its RAM, a replica is missing) is every
rank's view gathered.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from ...util.stages import stage
from ...errors import (ArgumentError, CheckpointLostError, DeviceError, StateMismatchError, StepNotFoundError,
                       TierfsError)
from ...protocol import common_steps
from ...ranks import Group, agreement
from ...ranks.agree import views as rank_views
from ...tiers.base import AnyTier
from ..context import Context

log = logging.getLogger("tierfs")


@dataclass
class RestorePlan:
    """What one gather told every rank (the same on every rank).

    ``own[r]`` are the steps rank ``r`` can read from its own tiers (``fast[r]``: from those before the
    replicator, its RAM); ``holders[(step, r)]`` the ranks that keep a replica of rank ``r``'s shard of
    ``step``; ``local`` (this rank's alone) the steps each of its file tiers holds.
    """

    own: list[set[int]]
    holders: dict[tuple[int, int], list[int]]
    local: dict[str, set[int]]
    fast: list[set[int]] = field(default_factory=list)  # the steps each rank holds before the replicator
    #: why the replicator cannot give back shards of a step (e.g. a group that lost more than its parity)
    notes: dict[int, str] = field(default_factory=dict)
    #: the steps whose lost replicas a restore of this plan sent again (:func:`~.after.reseed`): once
    reseeded: set[int] = field(default_factory=set)

    @property
    def every(self) -> set[int]:
        """Every step some rank can read or some replica holds."""
        return set().union(*self.own, (s for s, _ in self.holders))

    def gettable(self, rank: int) -> set[int]:
        """The steps rank ``rank`` can get: from its own tiers or from a replica."""
        return self.own[rank] | {s for s, r in self.holders if r == rank}

    def steps(self, step: int | None, tiers: Sequence[str]) -> list[int]:
        """The steps to try, newest first: ``step`` alone if given, else every step each rank can get.
        Raises :class:`~tierfs.errors.CheckpointLostError` when ranks hold steps but none every rank can get."""
        gettable = [self.gettable(r) for r in range(len(self.own))]
        common = common_steps(gettable)
        if step is not None:
            if step not in common:
                lacking = [r for r, g in enumerate(gettable) if step not in g]
                raise StepNotFoundError(f"step {step} is not committed on {list(tiers)} for every rank (rank(s) "
                                        f"{lacking[:8]} lack it); available: {sorted(common)[-10:]}")
            return [step]
        if not common:
            lost = lost_steps(gettable, tiers, self.notes)
            if lost is not None:
                raise lost
            raise StepNotFoundError(f"nothing to restore: no committed step on {list(tiers)}")
        return sorted(common, reverse=True)

    def candidates(self, step: int | None, tiers: Sequence[str]) -> list[int]:
        """The steps to try, newest first: ``[step]`` when given, else every step each rank can get; none
        when no rank holds a step (and no ``step`` is given). Raises as :meth:`steps` does, also when
        ``step`` is given and ranks hold steps none of which every rank can get."""
        if not self.every and step is None:
            return []
        steps = self.steps(None, tiers) if self.every else []  # lost steps are an error, also when step is given
        return steps if step is None else self.steps(step, tiers)

    def not_in_ram(self, step: int) -> bool:
        """Whether some rank's RAM (the tiers before the peer tier) lacks ``step``. The same on every rank;
        never true without a peer tier among the tiers read (every tier counts as RAM then)."""
        return any(step not in fast for fast in self.fast)

    def only_at_peers(self, step: int) -> bool:
        """Whether some rank can get its shard of ``step`` only from a peer (none of its own tiers holds it)."""
        return any(step not in own for own in self.own)

    def localized(self, step: int, tier: str, here: bool) -> None:
        """Note that every rank's shard of ``step`` was brought into its RAM tier ``tier`` (a restore that
        localized it; ``here``: this rank's copy is committed there): a later restore of this plan reads it
        there (a rank whose copy is not there after all gets it from a peer then, as any rank whose own copy
        fails)."""
        for held in self.own + self.fast:
            held.add(step)
        if here:
            self.local.setdefault(tier, set()).add(step)

    def passed_over(self, step: int) -> list[tuple[int, str]]:
        """The steps above ``step`` some ranks can get, newest first, each with why it was passed over: the
        ranks that cannot get it (and what a tier noted, e.g. an erasure-coded group that lost too many). A
        restore of ``step`` as the newest logs them once."""
        gettable = [self.gettable(r) for r in range(len(self.own))]
        newer = sorted({x for g in gettable for x in g if x > step} - common_steps(gettable), reverse=True)
        out = [(x, f"held by only some ranks: rank(s) {[r for r, g in enumerate(gettable) if x not in g][:8]} "
                   "cannot get it" + (f" ({self.notes[x]})" if x in self.notes else "")) for x in newer]
        if out:
            log.warning("steps %s could not be restored for every rank and were passed over; the next save "
                        "removes them", [x for x, _ in out])
        return out

    def lost_replicas(self, step: int, targets: Sequence[Sequence[int]]) -> list[tuple[int, int]]:
        """``(rank, target)`` pairs whose replica of ``step`` is gone (a replaced node lost them)."""
        return [(r, t) for r in range(len(self.own)) for t in targets[r]
                if t not in self.holders.get((step, r), [])]


def lost_steps(held: Sequence[set[int]], tiers: Sequence[str],
               notes: dict[int, str] | None = None) -> CheckpointLostError | None:
    """The error of a job whose ranks hold steps (``held[r]``: what rank ``r`` can get) none of which every
    rank can get, naming the newest of them and the ranks lacking each; None when no rank holds any or
    some step is held by every rank."""
    every = set().union(*held)
    if not every or common_steps(held):
        return None
    newest = sorted(every, reverse=True)[:4]
    lacking = {x: [r for r, g in enumerate(held) if x not in g] for x in newest}
    said = "; ".join(f"step {x}: rank(s) {rs[:8]}{' ...' if len(rs) > 8 else ''}"
                     + (f", {notes[x]}" if notes and x in notes else "") for x, rs in lacking.items())
    return CheckpointLostError(
        f"the checkpoint is lost: steps {sorted(every)[-8:]} are held by only some ranks on {list(tiers)} and no "
        f"step by every rank (lacking {said}): those ranks' shards and every copy of them are gone (e.g. nodes "
        "replaced before a peer or a slower tier had a copy). Restore from another tier, or start afresh by "
        "removing the tiers' directories", steps=sorted(every), lacking=lacking)


def gather_plan(ctx: Context, usable: Sequence[AnyTier], check: Callable[[], None] = lambda: None,
                group: Group | None = None, what: str = "restore", outcome: str = "nothing restored") -> RestorePlan:
    """Every rank's view (collective): the steps it can read itself, the shards it keeps for others, each
    as an offset from the keeper's rank (so that ranks keeping their neighbours' shards have the same view
    and the ranks agree in a few integers, see the module docstring). ``check()`` runs first (the store
    raises background failures there); a rank that fails makes every rank raise."""
    g = group or ctx.group
    n = g.world_size
    view: list[list[Any]] = []
    local: dict[str, set[int]] = {}
    rep = None
    ctx.refresh(shared=g)  # collective, so before the agreement a rank may leave early: every rank takes part
    with agreement(g, what, outcome=outcome, classify=error_kind):
        with stage("planning"):
            check()
            before, rep, after = ctx.roles(usable)
            local = {t.name: ctx.ledger.holding(t.name) for t in before + after}
            held = rep.holdings() if rep is not None else {}
            kept = sorted([s, (g.rank - r) % n] for s, rs in held.items() for r in rs)
            view = [sorted(set().union(*local.values())), kept, sorted(set().union(*(local[t.name] for t in before)))]
    views = rank_views(g, view)
    holders: dict[tuple[int, int], list[int]] = {}
    for h, (_, kept, _) in enumerate(views):
        for s, off in kept:
            holders.setdefault((s, (h - off) % n), []).append(h)
    fast = [set(v[2]) for v in views]
    notes: dict[int, str] = {}
    if rep is not None:  # (a copy that needs several ranks, as erasure coding's, says which it can rebuild)
        holders = rep.rebuildable(holders, fast, notes)
    return RestorePlan([set(v[0]) for v in views], holders, local, fast, notes)


def error_kind(e: BaseException) -> type[TierfsError]:
    """How other ranks raise a rank's restore failure: a target that does not match stays a mismatch, a bad
    argument an ArgumentError, a device without room a DeviceError."""
    for cls in (StateMismatchError, ArgumentError, DeviceError):
        if isinstance(e, cls):
            return cls
    return TierfsError
