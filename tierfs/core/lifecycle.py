"""A store's life cycle outside its calls: opening its tiers (undone when the constructor fails) and its
background work finished when the interpreter exits.

:class:`Opening` opens a :class:`~tierfs.TieredStore`'s tiers and builds its :class:`~tierfs.core.context.Context`,
noting first which directories of local tiers (the RAM tier's, the peer tier's replicas, a ``file://`` object
tier's) do not exist yet. When the constructor fails after that (a tier that cannot be reached, a membership
contradiction, a bad argument), :meth:`Opening.undo` closes what was opened and removes the directories it
created that are still empty; a directory that existed before is never removed.

:class:`StoreWork` is what :mod:`tierfs.util.exitwork` finishes at exit for a store left open: its commits and
copies, then it closes the store.
"""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path
from typing import Callable, Iterator, Mapping, Protocol

from .. import metrics as _metrics
from ..util import readable as _readable
from ..util.retry import short
from ..tiers.rootdir import missing_dirs, remove_new_dirs
from ..util.stages import stage
from ..errors import TierfsError
from ..util.worker import BACKGROUND_NICE, Throttle, Worker
from .ledger import StepLedger
from .background import Background
from .helper import Helper
from .ownership import Ownership
from .context import Context
from ..policies import StepInfo
from ..ranks import Group, agreement
from ..ranks.nodenumbers import env_node_source
from ..ranks.nodes import observe
from ..ranks.pool import POOL, Lease
from ..tiers.base import AnyTier, Replicator, Tier
from ..tiers.capabilities import LocalFiles, SharedDirectory, SharedStore

log = logging.getLogger("tierfs")

#: seconds between two looks at a store's background work while the exit waits for it
_POLL = 0.05


def local_dirs(tier: AnyTier) -> list[Path]:
    """The local directories ``tier`` creates when it opens (none for a remote tier)."""
    return tier.local_dirs() if isinstance(tier, LocalFiles) else []


def remove_uncommitted(ctx: Context) -> dict[str, set[int]]:
    """Remove the steps without a marker on the tiers this rank owns, saying why each was left (collective:
    every rank waits for the others before the store lists its tiers). Returns the committed steps of each
    tier it listed, for the store's first listing (:meth:`Context.refresh`'s ``known``)."""
    listed: dict[str, set[int]] = {}
    for t in ctx.tiers:
        if ctx.ranks.owns(t):
            steps = t.list_steps()
            for s, ok in steps.items():
                if not ok:
                    log.info("tier %s: %s", t.name, uncommitted_cause(t, s, steps))
                    t.delete_step(s)
            listed[t.name] = {s for s, ok in steps.items() if ok}
    ctx.group.barrier()
    return listed


def uncommitted_cause(tier: AnyTier, step: int, steps: Mapping[int, bool]) -> str:
    """Why ``tier`` holds ``step`` without a marker, given every step it holds (``{step: committed}``), as
    the log says it: a step above every committed one is a save cut short (saves commit in order); one
    below a committed step that the tier's keep policy drops is one retention dropped (its marker
    deleted), whose ranks did not all delete their own files before the job ended; one the policy keeps
    is a save or copy of it that did not finish."""
    committed = sorted(s for s, ok in steps.items() if ok)
    newer = [s for s in committed if s > step]
    if not newer:
        return f"removing uncommitted step {step} left by an interrupted save"
    try:
        kept = step in tier.keep_policy.keep([StepInfo(s) for s in sorted({*committed, step})])
    except Exception:  # noqa: BLE001 - a policy that needs what the listing does not say: not claimed
        kept = True
    if not kept:
        what = "objects" if isinstance(tier, Tier) and not tier.is_local else "files"
        return (f"removing the remaining {what} of step {step}, dropped by retention (its marker was deleted; "
                "the job ended before every rank had deleted its own " + what + ")")
    return (f"removing step {step}, which has no marker although step {newer[-1]} is committed: a save or copy "
            "of it did not finish")


def _same_class(e: BaseException) -> "type[TierfsError]":
    """The class every rank raises when ``e`` failed one rank's open: its own, if it is a tierfs error."""
    return type(e) if isinstance(e, TierfsError) else TierfsError


class Opening:
    """A store's constructor's tiers and directories, undone by :meth:`undo` when it fails, and the
    process groups it took (:mod:`tierfs.ranks.pool`), given back when the store closes."""

    def __init__(self, writes: bool = True) -> None:
        self.made: list[Path] = []  # directories that did not exist before a tier opened
        self.opened: list[AnyTier] = []
        self.ctx: Context | None = None
        self.writes = writes  # a store that saves: its RAM tiers are this job's (locked when they open)
        self.groups: Lease | None = None

    @contextlib.contextmanager
    def taking_groups(self, timeout: float) -> Iterator[None]:
        """Every group made in the block (the store's, its workers', the peer tier's) is taken from the
        process's pool (collective): given back by an earlier store, else made now."""
        with POOL.opening(timeout) as self.groups:
            yield

    def give_back_groups(self, usable: bool = True) -> None:
        """Give the groups back for the next store of the process (``usable=False``: threads may still use
        them, so they are only forgotten); once."""
        lease, self.groups = self.groups, None
        if lease is not None:
            lease.give_back(usable)

    def open(self, tier: AnyTier) -> None:
        """Open ``tier``, noting the directories it is about to create."""
        for d in local_dirs(tier):
            self.made += missing_dirs(d)
        if isinstance(tier, SharedDirectory):
            tier.lock_on_open = self.writes  # a second job on the directory fails here, not at its first write
        self.opened.append(tier)
        tier.open()

    def build(self, tiers: list[AnyTier], reps: list[Replicator], group: Group, throttle: Throttle,
              threads: int | None, file_size: int, block_size: int, clock: Callable[[], float],
              helper: bool = False) -> Context:
        """Open the file tiers (every rank fails if one cannot), check which ranks share the first tier's
        directory against the node numbers, fork the groups, bind the replicators and open them."""
        _metrics.from_environment(group.rank)  # TIERFS_METRICS_PORT: this rank's figures over HTTP
        ledger = StepLedger([t.name for t in tiers])
        files = [t for t in tiers if isinstance(t, Tier)]
        # a tier one rank cannot open fails every rank, with the same class of error
        with agreement(group, "open the store", classify=_same_class):
            for t in files:
                if isinstance(t, SharedStore):  # one rank asks the store for the job (a failure fails all)
                    t.probe_on_open = group.rank == 0
                with stage("open", tier=t.name):
                    self.open(t)
        nodes = observe(group, lambda: {t.name: [t.identity(), t.location] for t in files
                                         if isinstance(t, SharedDirectory)})
        nodes.check(group.nodes, env_node_source())
        # one group per thread role, so collectives of different threads never interleave (from the
        # process's pool, while the store opens: see taking_groups)
        commit_group = group.fork()  # a blocking save waits for the commit: full priority
        copy_groups = {t.name: group.fork(nice=BACKGROUND_NICE) for t in files[1:]}
        for r in reps:
            r.bind(files[0], group)
            nodes.check(r.nodes, f"{r.name}'s node numbers")
        work = Background(
            ledger=ledger, throttle=throttle, commits=Worker("tierfs-commit", ledger.fail),
            # one copy worker per slower tier: a slow upload never holds back the replicas to peers
            copies={t.name: Worker(f"tierfs-copy-{t.name}", ledger.fail) for t in tiers[1:]},
            commit_group=commit_group, copy_groups=copy_groups, helper=Helper(group.rank) if helper else None)
        ranks = Ownership(group, nodes, reps[0] if reps else None)
        self.ctx = Context(tiers=tiers, ledger=ledger, ranks=ranks, work=work, threads=threads,
                           file_size=file_size, block_size=block_size, clock=clock)
        for r in reps:
            self.open(r)
        return self.ctx

    def undo(self) -> None:
        """Close what was opened, newest first, and remove the directories made that are empty now.
        Never raises: the constructor's own error is the one to see."""
        if self.ctx is not None:
            try:
                self.ctx.work.close()
            except Exception as e:  # noqa: BLE001 - logged; the rest is still undone
                log.warning("closing the store's workers failed (%s)", short(e, with_type=True))
        for t in reversed(self.opened):
            try:
                t.close()
            except Exception as e:  # noqa: BLE001 - logged; the rest is still undone
                log.warning("tier %s: closing after a failed open failed (%s)", t.name, short(e, with_type=True))
        self.opened.clear()
        remove_new_dirs(self.made)
        self.give_back_groups()


# -- at exit ----------------------------------------------------------------------------------------
def _idle(worker: Worker) -> bool:
    """Whether ``worker`` has run every job submitted to it."""
    q = getattr(worker, "_queue", None)
    return q is None or not q.unfinished_tasks


class Store(Protocol):
    """What the exit finishes of a :class:`~tierfs.TieredStore`: its context, whether it is closed, raising
    its background failures, closing it."""

    _ctx: Context
    _closed: bool

    def raise_background_errors(self) -> None:
        """Raise the first error background work hit since the last call, if any."""

    def close(self) -> None:
        """Finish background work, then release every tier."""


class StoreWork:
    """A store's background work at exit (:class:`tierfs.util.exitwork.Work`): the steps whose commit or copies
    are unfinished, and the jobs its workers still have."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.ctx: Context = store._ctx

    def _busy(self) -> list[int]:
        ledger = self.ctx.ledger
        return [s for s in sorted(ledger.snapshot().info) if ledger.busy(s)]

    def _done(self) -> bool:
        workers = self.ctx.work.workers()
        return not self._busy() and all(_idle(w) for w in workers)

    def _missing(self, step: int) -> list[AnyTier]:
        """The tiers that took ``step`` but do not hold it yet."""
        ledger = self.ctx.ledger
        held = set(ledger.holders(step))
        return [t for t in self.ctx.tiers
                if t.name not in held and any(i.step == step for i in ledger.previous(t.name))]

    def _nbytes(self, step: int) -> str:
        try:
            return f" ({_readable.size(sum(self.ctx.first.file_sizes(step).values()))})"
        except Exception:  # noqa: BLE001 - only for the message
            return ""

    def pending(self) -> str | None:
        if self._done():
            return None
        first = self.ctx.first.name
        said = []
        for s in self._busy():
            if first not in self.ctx.ledger.holders(s):
                said.append(f"step {s}{self._nbytes(s)} not yet committed")
            else:
                on = ", ".join(f"tier {t.name!r} ({getattr(t, 'location', t.name)})" for t in self._missing(s))
                said.append(f"step {s}{self._nbytes(s)} not yet on {on}")
        if not said and not _idle(self.ctx.work.restores):
            return "TieredStore: the rest of a restore (sending to the ranks still receiving, agreeing)"
        return "TieredStore: " + ("; ".join(said) if said else "the tiers' upkeep after the last save")

    def _drop_spares(self) -> None:
        self.ctx.staging.drop_spares()  # spare buffers for a next save that never comes

    def wait(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        self._drop_spares()
        while not self._done():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(_POLL, left))
        self.store.raise_background_errors()
        return True

    def lost(self, reason: str) -> str:
        self._drop_spares()
        first = self.ctx.first
        said = []
        for s in self._busy():
            if first.name not in self.ctx.ledger.holders(s):
                said.append(f"step {s} is not committed (the next store on {first.location} removes it)")
                continue
            for t in self._missing(s):
                where = getattr(t, "location", t.name)
                hint = (f" (`tierfs cp {first.location} {where} --step {s}` copies it)"
                        if self.ctx.group.world_size == 1 and isinstance(t, Tier) else "")
                said.append(f"step {s} is NOT durable on tier {t.name!r} ({where}): it is committed only in "
                            f"the RAM tier at {first.location}{hint}")
        if not said:
            said.append(f"a step may be NOT durable on the slower tiers; the steps committed in the RAM tier stay "
                        f"at {first.location}")
        return f"tierfs: at exit, {reason}: " + "; ".join(said)

    def close(self) -> None:
        try:  # a failure of background work that no call raised yet (the last save's copy)
            self.store.raise_background_errors()
        except Exception as e:  # noqa: BLE001 - at exit: one line
            log.warning("%s", self.lost(short(e)))
        try:
            self.store.close()
        except Exception as e:  # noqa: BLE001 - at exit: one line
            log.warning("tierfs: at exit, closing the store failed (%s)", short(e, with_type=True))


def exit_work(store: Store) -> StoreWork | None:
    """The store's work at exit; None once it is closed."""
    return None if store._closed else StoreWork(store)

