"""What a store's save path, restore path and retention share: :class:`Context`.

The tiers in their roles (the first tier, the slower file tiers, the replicator) and the ledger of what
they hold are here; who the ranks are and what they share is :class:`~.ownership.Ownership`
(``ctx.ranks``), the background workers and their failures :class:`~.background.Background`
(``ctx.work``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterable, Mapping, Sequence

from ..util import args as _args
from ..errors import ArgumentError
from ..tiers.base import AnyTier, Replicator, Tier
from ..tiers.capabilities import Staging, staging
from .background import Background
from .ledger import StepLedger
from .ownership import Ownership

if TYPE_CHECKING:
    from ..ranks import Group

log = logging.getLogger("tierfs")


def check_tiers(tiers: Iterable[AnyTier]) -> tuple[list[AnyTier], list[Replicator]]:
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
class Context:
    """Everything a store's paths share (built when the store opens, :mod:`tierfs.core.lifecycle`)."""

    tiers: list[AnyTier]  # every tier, fastest first: the first is a file tier
    ledger: StepLedger
    ranks: Ownership  # who the ranks are, who owns what
    work: Background  # the background workers, their groups and failures
    threads: int | None
    file_size: int
    block_size: int
    clock: Callable[[], float] = time.time
    first: Tier = field(init=False)  # where saves land and commit first
    staging: Staging = field(init=False)  # how a save is copied into the first tier
    replicator: Replicator | None = field(init=False)  # the tier keeping other ranks' shards, if any
    files: list[Tier] = field(init=False)  # every tier holding files, fastest first

    def __post_init__(self) -> None:
        self.files = [t for t in self.tiers if isinstance(t, Tier)]
        reps = [t for t in self.tiers if isinstance(t, Replicator)]
        self.replicator = reps[0] if reps else None
        self.first = self.files[0]
        self.staging = staging(self.first)

    @property
    def group(self) -> "Group":
        """The job's ranks (the store's group)."""
        return self.ranks.group

    def roles(self, tiers: Sequence[AnyTier]) -> tuple[list[Tier], Replicator | None, list[Tier]]:
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

    def tier(self, name: str) -> AnyTier:
        for t in self.tiers:
            if t.name == name:
                return t
        raise ArgumentError(f"no tier named {name!r}; the tiers are {self.names}")

    def usable(self, names: Sequence[str] | None) -> list[AnyTier]:
        """The named tiers in the order given (default: all, fastest first)."""
        return list(self.tiers) if names is None else [self.tier(n) for n in dict.fromkeys(names)]

    def refresh(self, shared: "Group | None" = None, known: Mapping[str, set[int]] | None = None) -> None:
        """Re-list every tier (steps written by other processes become visible).

        With ``shared``, a group of every rank (collective): a tier all ranks share (the object tier) is
        listed by rank 0 alone and its steps reach the others in two all-reduces of a few integers
        (:func:`shared_listing`), so a job lists it once, not once per rank. ``known``: the committed steps
        of tiers this rank has just listed itself (by name), taken as they are.
        """
        known = known or {}

        def listing(t: AnyTier) -> set[int] | None:
            return set(known[t.name]) if t.name in known else _listing(t)
        once = [t for t in self.tiers if isinstance(t, Tier) and not t.is_local]
        listed = shared_listing(shared, once, listing) if shared is not None and shared.world_size > 1 and once else {}
        for t in self.tiers:
            self.ledger.listed(t.name, listed[t.name] if t.name in listed else listing(t))


def _listing(t: AnyTier) -> set[int] | None:
    """``t``'s committed steps, or None (said in the log) when it cannot be listed: keep what was known."""
    try:
        return set(t.committed_steps())
    except Exception as e:  # noqa: BLE001 - an unreachable tier: keep what we knew, say so
        log.warning("tier %s cannot be listed (%s); using the steps known to this process", t.name, e)
        return None


def shared_listing(group: "Group", tiers: Sequence[Tier], listing: Callable[[Tier], set[int] | None]
                   ) -> dict[str, set[int] | None]:
    """Rank 0's ``listing`` of each of ``tiers`` on every rank (collective): the counts in one all-reduce
    (a max, the other ranks giving -1; -1 from rank 0 too when it could not list the tier), then the steps
    in another, as many integers as there are steps."""
    mine = [listing(t) for t in tiers] if group.rank == 0 else [None] * len(tiers)
    counts = group.all_reduce([-1 if s is None else len(s) for s in mine], "max")
    flat = [x for s in mine if s is not None for x in sorted(s)] if group.rank == 0 else []
    total = sum(max(n, 0) for n in counts)
    values = group.all_reduce(flat or [-1] * total, "max") if total else []
    out: dict[str, set[int] | None] = {}
    at = 0
    for t, n in zip(tiers, counts):
        out[t.name] = None if n < 0 else set(values[at:at + n])
        at += max(n, 0)
    return out
