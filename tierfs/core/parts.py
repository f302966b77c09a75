"""The parts of a store that its save path, restore path and retention share.

:class:`Parts` holds the tiers in their roles (the first tier, the slower file tiers, the replicator),
the job's ranks and the store's groups, the ledger, the background workers and the throttle, and answers
the questions every path asks: which rank owns a tier's commits and deletions, which manifests must be
on a tier before its marker, how a background copy paces its bytes.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

from .. import _args, _hooks
from .._worker import Throttle, Worker
from ..dist import Group
from ..dist.nodes import Layout
from ..errors import ArgumentError
from ..format import Marker, manifest_filename
from ..tiers.base import Holder, Replicator, Tier
from .ledger import StepLedger

log = logging.getLogger("tierfs")


def check_tiers(tiers: Iterable[Holder]) -> tuple[list[Holder], list[Replicator]]:
    """A store's tiers, checked: a non-empty list of tiers with unique names, the first holding files, at
    most one replicator. Returns them as a list, and the replicators."""
    if isinstance(tiers, (str, bytes, Tier, Replicator)) or not isinstance(tiers, Iterable):
        raise ArgumentError("TieredStore takes a list of tiers, e.g. [MemoryTier(...), ObjectTier(url)], got "
                            f"{_args.shown(tiers)}")
    tiers = list(tiers)
    if not tiers:
        raise ArgumentError("TieredStore needs at least one tier, e.g. [MemoryTier(...), ObjectTier(url)]")
    for i, t in enumerate(tiers):
        _args.instance(t, f"tiers[{i}]", (Tier, Replicator), "a tier, e.g. MemoryTier(...) or ObjectTier(url)")
    names = [t.name for t in tiers]
    if len(set(names)) != len(names):
        raise ArgumentError(f"tier names must be unique, got {names}; pass name=... to tell them apart")
    reps = [t for t in tiers if isinstance(t, Replicator)]
    if len(reps) > 1 or not isinstance(tiers[0], Tier):
        raise ArgumentError("use at most one PeerTier, after the RAM tier: "
                            "[MemoryTier(...), PeerTier(), ObjectTier(url)]")
    return tiers, reps


@dataclass
class Parts:
    """Everything a store's paths share (built by :class:`~tierfs.TieredStore`)."""

    tiers: list[Holder]  # every tier, fastest first: the first is a file tier
    group: Group
    ledger: StepLedger
    throttle: Throttle
    commits: Worker  # commits and the first tier's upkeep, in order
    copies: dict[str, Worker]  # one per slower tier: a slow upload never holds back the replicas
    commit_group: Group  # the commit worker's collectives
    copy_groups: dict[str, Group]  # each slower file tier's copy worker's collectives
    threads: int | None
    file_size: int
    block_size: int
    clock: Callable[[], float] = time.time
    layout: Layout | None = None  # which ranks share each node-local tier's storage (None: each its own)
    first: Tier = field(init=False)  # where saves land and commit first
    replicator: Replicator | None = field(init=False)  # the tier keeping other ranks' shards, if any
    files: list[Tier] = field(init=False)  # every tier holding files, fastest first
    # the part of a restore that goes on after this rank returned (see core.restore.pipeline), and its failures
    restores: Worker = field(init=False)
    restore_failures: list[BaseException] = field(init=False)

    def __post_init__(self) -> None:
        self.files = [t for t in self.tiers if isinstance(t, Tier)]
        reps = [t for t in self.tiers if isinstance(t, Replicator)]
        self.replicator = reps[0] if reps else None
        self.first = self.files[0]
        self.restore_failures = []
        self.restores = Worker("tierfs-restore", self.restore_failures.append, nice=0)

    def roles(self, tiers: Sequence[Holder]) -> tuple[list[Tier], Replicator | None, list[Tier]]:
        """``tiers`` in their roles: the file tiers before the replicator, the replicator (None when it is
        not among them), the file tiers after it."""
        rep = self.replicator if self.replicator in tiers else None
        cut = list(tiers).index(rep) if rep is not None else len(tiers)
        return ([t for t in tiers[:cut] if isinstance(t, Tier)], rep,
                [t for t in tiers[cut + 1:] if isinstance(t, Tier)])

    @property
    def names(self) -> list[str]:
        """The tiers' names, fastest first."""
        return [t.name for t in self.tiers]

    def tier(self, name: str) -> Holder:
        for t in self.tiers:
            if t.name == name:
                return t
        raise ArgumentError(f"no tier named {name!r}; the tiers are {self.names}")

    def usable(self, names: Sequence[str] | None) -> list[Holder]:
        """The named tiers in the order given (default: all, fastest first)."""
        return list(self.tiers) if names is None else [self.tier(n) for n in dict.fromkeys(names)]

    def refresh(self) -> None:
        """Re-list every tier (steps written by other processes become visible)."""
        for t in self.tiers:
            try:
                steps: set[int] | None = set(t.committed_steps())
            except Exception as e:  # noqa: BLE001 - an unreachable tier: keep what we knew, say so
                log.warning("tier %s cannot be listed (%s); using the steps known to this process", t.name, e)
                steps = None
            self.ledger.listed(t.name, steps)

    def owns(self, tier: Holder) -> bool:
        """Whether this rank commits and deletes whole steps on ``tier``: per node for local tiers, rank 0
        for shared ones; on a replicator each rank its own copies."""
        if tier is self.replicator:
            return True
        assert isinstance(tier, Tier)
        return (min(self.sharing(tier)) if tier.is_local else 0) == self.group.rank

    def sharing(self, tier: Tier) -> tuple[int, ...]:
        """The ranks whose ``tier`` is the same storage as this rank's: every rank for a shared tier, the
        ranks using the same directory for a node-local one (as observed when the store opened)."""
        if not tier.is_local:
            return tuple(range(self.group.world_size))
        return self.layout.sharing(tier.name) if self.layout is not None else (self.group.rank,)

    def expected_manifests(self, tier: Tier, marker: Marker) -> dict[str, int | None]:
        """The manifests that must be on ``tier`` before its marker: this node's ranks' on a local tier,
        every rank's on a shared one."""
        if tier.is_local:
            return {manifest_filename(r): None for r in self.sharing(tier)}
        return {n: None for n in marker.manifests}

    def pace(self, step: int, tier: str) -> Callable[[int], None]:
        """The throttle of a background copy of ``step`` to ``tier`` (with its test hook)."""
        def pace(nbytes: int) -> None:
            _hooks.at("transfer", step=step, tier=tier, nbytes=nbytes)
            self.throttle.consume(nbytes)
        return pace

    def settle(self) -> None:
        """Wait for the rest of the last restore (if this rank returned before it finished); raise its
        failure here, on this rank alone (the other ranks raised theirs in the restore)."""
        self.restores.join()
        if self.restore_failures:
            failure = self.restore_failures.pop(0)
            self.restore_failures.clear()
            raise failure

    def close(self) -> None:
        self.restores.close()
        self.commits.close()
        for w in self.copies.values():
            w.close()

    def join(self) -> None:
        """Wait until every background job submitted so far has run."""
        self.restores.join()  # first: it may submit copies (re-seeding peers)
        self.commits.join()
        for w in self.copies.values():
            w.join()

