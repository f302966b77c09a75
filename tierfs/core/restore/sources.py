"""Sources of a rank's shard in a restore, and the attempt they fill.

An :class:`Attempt` is one rank's try at one step: what it got (a :class:`RestoreInfo` and the
:class:`~.sinks.Shard`, already in the sink) or the error every rank must raise, what it tried and why each
source failed. The restore (:mod:`.pipeline`) hands it to the sources in order; each takes it only while it
has nothing yet, records what it delivered or why not, and never raises between collectives:

- :class:`TierSource`: this rank's copy on its own file tiers, the first that verifies (no collective):
  the tiers before the replicator (RAM), and later the tiers after it (object storage);
- :class:`Peers`: a replica kept by another rank (collective: holders send, ranks lacking their shard
  receive, a bad copy sends its receiver to the next holder);
- :class:`Bundles`: the entries ranks share (data parallelism), from the ranks holding them (collective,
  :mod:`.bundles`).

:func:`read_shard` and :func:`first_verified` are also the reads without collectives (:mod:`..reads`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Sequence, TypeVar

from ...format import blockio as _blocks
from ...util import readable as _readable
from ...util.stages import stage
from ...ranks import Group
from ...ranks.agree import views
from ...errors import ArgumentError, DeviceError, StateMismatchError, TierfsError
from ...format import MARKER, Marker
from ...protocol import checked_manifest
from ...tiers.base import Replicator, Tier
from ...tiers.capabilities import ZeroCopy
from ...tiers.placement import plan_fetch
from ..layout import ReadViews
from ..context import Context
from .bundles import NONE, OWNED, UNIQUE, WHOLE, complete, holds
from .fill import Landing, fill
from .sinks import Shard, Sink

if TYPE_CHECKING:
    from .plan import RestorePlan

log = logging.getLogger("tierfs")
T = TypeVar("T")
#: errors that make one tier's copy unusable (the next source is tried)
UNUSABLE = (TierfsError, OSError, ValueError, KeyError)
#: failures of the caller's side, not of the copy (a target that does not fit, a device without room): no
#: other source does better, so they are raised, not tried past
THE_CALLERS = (StateMismatchError, ArgumentError, DeviceError)
Skipped = list[tuple[str, int, str]]  # (tier, step, reason)
#: how a peer's copy that is itself bad fails at its receiver (not the receiver's own trouble, nor the
#: holder's of the moment: no memory left): checksums, a manifest that does not match its marker, files the
#: holder found damaged or missing
BAD_COPY = ("ChecksumError", "FormatError", "TierfsError: the holder's copy is bad")


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
    _ranks: list[dict[str, Any]] | None = field(default=None, repr=False)
    _report: Callable[[], list[dict[str, Any]]] | None = field(default=None, repr=False, compare=False)

    @property
    def ranks(self) -> list[dict[str, Any]]:
        """Every rank's source: ``{"rank", "tier", "peer", "nbytes", "seconds"}``, the same on every rank.
        Each rank wrote its own to the job's store as it finished; they are read on first use (on a rank
        that returned before the others, once they are done): a restore moves nothing more for them."""
        if self._ranks is None:
            self._ranks = self._report() if self._report is not None else []
        return self._ranks

    @ranks.setter
    def ranks(self, value: list[dict[str, Any]]) -> None:
        self._ranks, self._report = list(value), None

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")

    def __str__(self) -> str:
        s = f"step {self.step} from tier {self.tier!r}"
        s += f" (rank {self.peer})" if self.peer is not None else ""
        s += f": {_readable.size(self.nbytes)} in {_readable.duration(self.seconds)}"
        s += f" ({_readable.rate(self.nbytes, self.seconds)})" if self.seconds > 0 else ""
        for tier, step, why in self.skipped:
            s += f"; skipped {tier!r} step {step}: {why}"
        return s


@dataclass
class Attempt:
    """One rank's try at step ``step``: ``got`` once a source delivered its shard into ``sink`` (None: verify
    only), or ``mismatch``, the error every rank raises (a target that does not match, a failure filling
    it). ``skipped`` (the restore's, across its attempts) says why each source failed; ``tried`` the
    ``(rank, holder)`` pairs of peers' copies tried; ``group`` the step's collectives."""

    step: int
    plan: RestorePlan
    group: Group
    sink: Sink | None
    skipped: Skipped
    landing: Landing
    got: tuple[RestoreInfo, Shard] | None = None
    mismatch: BaseException | None = None
    tried: set[tuple[int, int]] = field(default_factory=set)

    @property
    def open(self) -> bool:
        """Whether a source should still try: nothing delivered, nothing to raise."""
        return self.got is None and self.mismatch is None

    def info(self, tier: str, shard: Shard, seconds: float) -> RestoreInfo:
        """What the restore says of this rank's shard from ``tier``."""
        m = shard.manifest
        # copies: the manifest is parsed once per step and shared by later reads
        info = RestoreInfo(self.step, tier, m.nbytes, seconds, self.skipped, dict(m.metadata), dict(m.metrics))
        if self.sink is not None and self.sink.wanted is not None:
            info.unused = sorted(ReadViews.of(m).names - self.sink.wanted)
        return info

    def skip(self, tier: str, why: str) -> None:
        self.skipped.append((tier, self.step, why))


# -- a shard from a tier (no collectives) -----------------------------------------------------------
class _Files(Mapping[str, Any]):
    """Files of a step in a tier, each read when first used, to be sent on."""

    def __init__(self, tier: Tier, step: int, names: Sequence[str]) -> None:
        self.tier, self.step, self.names = tier, step, list(names)

    def __getitem__(self, name: str) -> Any:
        if name not in self.names:
            raise KeyError(name)
        if isinstance(self.tier, ZeroCopy):  # only sent on: the wire maps the pages as it reads them
            return self.tier.view(self.step, name)
        return self.tier.read_file(self.step, name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


def read_shard(ctx: Context, tier: Tier, step: int, rank: int, sink: Sink | None) -> Shard:
    """Rank ``rank``'s shard of ``step`` from ``tier``, verified and delivered to ``sink``.

    A shared tier holds the entries several ranks share only in their owner's shard
    (:meth:`~tierfs.format.Manifest.held_files`): there the shard comes back without those files, what is
    there verified, and is delivered to no sink (:class:`Bundles` completes it from other ranks); a partial
    sink (``read_entries``) gets the others' names in ``sink.away``, by owner, to read from the owners'
    shards."""
    with ctx.ledger.pinned(tier.name, step), stage("read", step, tier.name):
        marker = bytes(tier.read_file(step, MARKER))
        manifest, mbytes = checked_manifest(tier, step, rank, Marker.from_bytes(marker))
        if sink is not None:
            sink.check(manifest)  # before reading: a wrong target costs no download
        held = manifest.held_files(tier.is_local)
        whole = len(held) == len(manifest.files)
        names = list(held)
        if sink is not None and sink.partial and sink.wanted is not None:  # the files holding wanted arrays
            if not whole:
                sink.elsewhere(manifest, held)
            names = sorted({e.file for e in manifest.entries if e.kind == "array" and e.name in sink.wanted})
        shard = Shard(manifest, mbytes, marker, tier.read_files(step, names) if names else {})
        if not whole and (sink is None or not sink.partial):
            _blocks.verify(manifest.subset(names), shard.files, ctx.threads)
            return shard
        fill(tier, step, shard, sink, ctx.threads)
        return shard


def open_shard(tier: Tier, step: int, rank: int) -> Shard:
    """Rank ``rank``'s shard of ``step`` in ``tier`` as it is, for sending on: its manifest checked against
    the marker, its blocks not read (each receiver checks them as they land); each file is read when first
    used."""
    marker = bytes(tier.read_file(step, MARKER))
    manifest, mbytes = checked_manifest(tier, step, rank, Marker.from_bytes(marker))
    return Shard(manifest, mbytes, marker, _Files(tier, step, list(manifest.held_files(tier.is_local))))


def first_verified(tiers: Sequence[Tier], step: int, read: Callable[[Tier], T], skipped: Skipped,
                   what: str = "") -> tuple[Tier, T] | None:
    """``(tier, read(tier))`` for the first of ``tiers`` (fastest first) whose copy of ``step`` reads and
    verifies; each one skipped is logged and recorded in ``skipped``. A StateMismatchError (the caller's
    target is wrong, not the copy) is raised at once. None when every tier failed."""
    for t in tiers:
        try:
            return t, read(t)
        except THE_CALLERS:  # the caller's mistake: no other copy does better
            raise
        except UNUSABLE as e:
            why = f"{type(e).__name__}: {e}"
            log.warning("tier %s step %d%s unusable, trying the next source (%s)", t.name, step, what, why)
            skipped.append((t.name, step, why))
    return None


class TierSource:
    """This rank's shard from the first of its file ``tiers`` (fastest first) holding a copy that verifies."""

    def __init__(self, ctx: Context, tiers: Sequence[Tier]) -> None:
        self.ctx, self.tiers = ctx, list(tiers)

    def __call__(self, a: Attempt) -> None:
        if not a.open:
            return
        rank = self.ctx.group.rank

        def read(t: Tier) -> tuple[Shard, float]:
            t0 = time.perf_counter()
            return read_shard(self.ctx, t, a.step, rank, a.sink), time.perf_counter() - t0
        try:
            found = first_verified([t for t in self.tiers if a.step in a.plan.local[t.name]], a.step, read, a.skipped)
        except Exception as e:  # noqa: BLE001 - a mismatch, or a failure filling the target: raised by all
            a.mismatch = e
            return
        if found is not None:
            tier, (shard, seconds) = found
            a.got = a.info(tier.name, shard, seconds), shard

    def unverified(self, a: Attempt) -> Shard | None:
        """This rank's whole shard of the step in its fastest tier holding it, unverified (for sending on
        while it is read and verified for this rank), or None (then it neither sends nor receives)."""
        for t in self.tiers:
            if a.step in a.plan.local[t.name]:
                try:
                    shard = open_shard(t, a.step, self.ctx.group.rank)
                    return shard if holds(shard.manifest, shard.files) == WHOLE else None
                except UNUSABLE as e:
                    log.info("tier %s step %d: sending nothing from this rank's copy (%s)", t.name, a.step, e)
                return None
        return None


# -- from other ranks (collective) ----------------------------------------------------------------
class Peers:
    """Ranks still without their shard get it from a peer keeping a replica; every rank takes part."""

    def __init__(self, ctx: Context, rep: Replicator) -> None:
        self.ctx, self.rep = ctx, rep

    def __call__(self, a: Attempt, needs: list[bool] | None = None) -> None:
        """``needs``: the ranks fetching (the same on every rank; default: each says whether it is open).
        Holders that fail are dropped and the next one tried."""
        g, rep, s = a.group, self.rep, a.step
        needs = list(needs) if needs is not None else list(views(g, a.open))
        while True:
            options = {r: [h for h in a.plan.holders.get((s, r), []) if (r, h) not in a.tried]
                       for r, need in enumerate(needs) if need}
            assign = plan_fetch({r: hs for r, hs in options.items() if hs})
            if not assign:
                return
            t0 = time.perf_counter()
            with self.ctx.ledger.pinned(rep.name, s):  # retention must not delete what a holder sends
                res = rep.fetch(s, assign, landing=a.landing)
            if isinstance(res, tuple):
                manifest, mbytes, marker, files = res
                try:
                    shard = Shard(manifest, mbytes, marker, files)
                    shard.landed = a.landing.landed(shard, set(files))
                    if a.sink is not None:
                        a.sink.check(manifest)  # the target's mismatch, before the others hear it landed
                    info = a.info(rep.name, shard, time.perf_counter() - t0)
                    info.peer = assign[g.rank]
                    a.got = (info, shard)
                except (TierfsError, ValueError, KeyError) as e:
                    if isinstance(e, THE_CALLERS):  # the target is wrong, not the copy
                        a.mismatch = e
                    res = f"{type(e).__name__}: {e}"
                except Exception as e:  # noqa: BLE001 - filling the target failed: raised by all ranks
                    a.mismatch, res = e, f"{type(e).__name__}: {e}"
            if isinstance(res, str):
                why = f"from rank {assign[g.rank]}: {res}"
                log.warning("tier %s step %d: the copy %s is unusable, trying another source", rep.name, s, why)
                a.skip(rep.name, why)
            received = isinstance(res, tuple)  # this rank's shard came in this round
            # 1: got it (or its target is wrong: raised by all); -1: the copy itself is bad; 0: it failed
            bad = isinstance(res, str) and res.startswith(BAD_COPY)
            vote = 1 if not isinstance(res, str) or a.mismatch is not None else -1 if bad else 0
            self._heard(a, assign, needs, views(g, vote))  # all 1 when every fetch went well: one all-reduce
            if received and a.got is not None and a.mismatch is None and \
                    holds(a.got[1].manifest, a.got[1].files) == WHOLE:
                try:  # after the others heard: this copy overlaps their own reads. Every block was checked as
                    # it landed; a failure now is the target's (else completed from other ranks first)
                    fill(None, s, a.got[1], a.sink, self.ctx.threads, verified=True)
                    a.got[0].seconds = time.perf_counter() - t0
                except Exception as e:  # noqa: BLE001 - raised by all ranks
                    a.got, a.mismatch = None, e

    def _heard(self, a: Attempt, assign: Mapping[int, int], needs: list[bool], votes: Sequence[int]) -> None:
        """Every rank's outcome of one round: got it (no longer needs), failed (the next holder), or a copy
        bad in itself (no later restore picks it: dropped; re-seeding after this one replaces it)."""
        for r, v in enumerate(votes):
            if r in assign:
                a.tried.add((r, assign[r]))
                if v > 0:
                    needs[r] = False
                elif v < 0:
                    a.plan.holders[(a.step, r)].remove(assign[r])
                    if assign[r] == a.group.rank:
                        try:
                            self.rep.drop(a.step, r)
                        except Exception as e:  # noqa: BLE001 - the next restore checks the copy again
                            log.warning("tier %s step %d: could not drop the copy of rank %d's shard (%s)",
                                        self.rep.name, a.step, r, e)


class Bundles:
    """Ranks whose shard lacks the entries they share with others (a peer's replica, a shared tier's copy)
    get them from the ranks holding them (:mod:`.bundles`); every rank takes part, then fills its target."""

    def __init__(self, ctx: Context, rep: Replicator | None) -> None:
        self.ctx, self.rep = ctx, rep

    def __call__(self, a: Attempt, serve: Shard | None = None) -> None:
        """``serve``: a rank still reading its own copy sends from it as it is (:meth:`TierSource.unverified`)."""
        shard = a.got[1] if a.got is not None else serve
        status = holds(shard.manifest, shard.files) if shard is not None else NONE
        every = views(a.group, status)
        if not any(x in (UNIQUE, OWNED) for x in every):
            return
        t0 = time.perf_counter()
        if shard is not None and status in (OWNED, WHOLE):
            shard = shard.whole()  # it may send entries on
            a.got = (a.got[0], shard) if a.got is not None else None
        files = dict(shard.files) if shard is not None else {}
        with stage("complete", a.step):
            g = self.rep.transfer_group() if self.rep is not None else None  # several connections
            why = complete(g or a.group, a.step, shard.manifest if shard is not None else None, files, every,
                           landing=a.landing)
        if a.got is None or status == WHOLE:
            return
        info, shard = a.got
        if why is None:
            shard = Shard(shard.manifest, shard.mbytes, shard.marker, files,
                          a.landing.landed(shard, set(files) - set(shard.files)))
            try:
                # every block was checked: where it was read (a tier, a peer's replica) or as it landed
                fill(None, a.step, shard, a.sink, self.ctx.threads, verified=True)
                info.seconds += time.perf_counter() - t0
                a.got = (info, shard)
                return
            except THE_CALLERS as e:  # the target is wrong, not the copy
                a.got, a.mismatch = None, e
                return
            except UNUSABLE as e:
                why = f"{type(e).__name__}: {e}"
            except Exception as e:  # noqa: BLE001 - filling the target failed: raised by all ranks
                a.got, a.mismatch = None, e
                return
        log.warning("tier %s step %d: the entries shared with other ranks could not be completed (%s)",
                    info.tier, a.step, why)
        a.skip(info.tier, f"shared entries: {why}")
        a.got = None
