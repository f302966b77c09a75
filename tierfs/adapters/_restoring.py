"""How :meth:`CheckpointManager.restore <tierfs.CheckpointManager.restore>` restores a step: once.

The steps to try come from the store's restore plan (:func:`~tierfs.core.restore.plan.gather_plan`: the
steps each rank can get from its own tiers or from a peer's replica, agreed in a few all-reduces of a few
integers on a normal restart), so a replaced node, whose RAM holds nothing, counts the steps its peers keep
for it, as the store's restore does. Then, newest first:

- a step the store saved is restored by the store, once: the store's restore fetches a replaced node's
  shard from its peer and sends the node the replicas it kept for others;
- a step saved through DCP is read by DCP's reader, which reads tiers directly: only when some rank's RAM
  lacks the step (a replaced node, or a step only a slower tier keeps) is it first brought into every
  rank's RAM (:meth:`~tierfs.TieredStore.localize`: a replaced node's shard from a peer, a slower tier's
  entries read once however many ranks hold them).

Besides the restore itself a normal restart costs the plan (which the store's restore gathers again) and
one all-reduce (whether the step was saved through DCP).
"""

from __future__ import annotations

import logging
from typing import Any

from ..core.restore.plan import RestorePlan
from ..errors import CheckpointLostError, RestoreError, RestoreIncompleteError, StepNotFoundError, TierfsError
from ..format import DCP_SHARD_KEY
from ..ranks.agree import any_rank
from ..store import RestoreInfo, TieredStore
from . import _torchstate as ts

log = logging.getLogger("tierfs")


def restore(store: TieredStore, state: Any, step: int | None, tiers: list[str], loader: bool
            ) -> tuple[Any, RestoreInfo] | None:
    """Restore ``step`` (default: the newest every rank can get, else older ones) over ``tiers``
    (collective).

    Parameters
    ----------
    store:
        The manager's store.
    state:
        The target, loaded in place; None: into a new state.
    step:
        The step to restore; None: the newest one every rank can get, older ones when no tier holds a
        verified copy of it.
    tiers:
        The tiers to read, in order.
    loader:
        Whether this rank restores a data loader's state (read from its own shard after the restore).

    Returns
    -------
    tuple or None
        ``(step or the new state, what the restore did)``; None when no rank holds a step.

    Raises
    ------
    CheckpointLostError
        Ranks hold steps, none of which every rank can get.
    StepNotFoundError
        ``step`` is not one every rank can get.
    RestoreError
        No tier holds a verified copy of any step tried.
    """
    got = plan(store, tiers)
    steps = candidates(got, step, tiers)
    if not steps:
        return None
    skipped: list[tuple[str, int, str]] = []
    for s in steps:
        try:
            if is_dcp_step(store, s, tiers):
                from .dcp import managed

                if not_in_ram(got, s):  # a replaced node's shard is only at its peers, out of the reader's reach
                    localize(store, s, tiers)
                out, info = managed.restore(store, state, s, tiers)
            elif state is not None:
                # the loader's state is read from this rank's shard after the restore: it must be readable
                if only_at_peers(got, s) and any_rank(store.group, loader):
                    localize(store, s, tiers)
                info = store.restore_into(state, s, tiers=tiers)
                out = info.step
            else:
                out, info = store.restore(s, tiers=tiers)
        except ts.Unusable as e:
            skipped += e.skipped
            continue
        except RestoreIncompleteError:
            raise  # ranks returned this step: none may move to an older one
        except RestoreError as e:
            skipped.append((",".join(tiers), s, str(e)))
            continue
        if step is None:  # the newer steps only some ranks can get, passed over, as the store's restore says
            passed = got.passed_over(s)
            skipped += [(",".join(tiers), x, f"held by only some ranks: rank(s) {lacking[:8]} cannot get it")
                        for x, lacking in passed]
            if passed:
                log.warning("steps %s could not be restored for every rank and were passed over; the next save "
                            "removes them", [x for x, _ in passed])
        info.skipped = skipped + [x for x in info.skipped if x not in skipped]
        return out, info
    reasons = "; ".join(f"{t} step {s}: {w}" for t, s, w in skipped)
    raise RestoreError(f"no tier holds a verified copy ({reasons})")


def plan(store: TieredStore, tiers: list[str]) -> RestorePlan:
    """What the store's restore over ``tiers`` would see (collective): :meth:`TieredStore.restore_plan`."""
    return store.restore_plan(tiers)


def candidates(got: RestorePlan, step: int | None, tiers: list[str]) -> list[int]:
    """The steps to try, newest first: ``[step]`` when given, else every step each rank can get; none when
    no rank holds a step (and no ``step`` is given). Raises :class:`~tierfs.errors.CheckpointLostError`
    when ranks hold steps none of which every rank can get, and
    :class:`~tierfs.errors.StepNotFoundError` when ``step`` is not one every rank can get."""
    if not got.every and step is None:
        return []
    steps = got.steps(None, tiers) if got.every else []  # lost steps are an error, also when step is given
    return steps if step is None else got.steps(step, tiers)


def not_in_ram(got: RestorePlan, step: int) -> bool:
    """Whether some rank's RAM (the tiers before the peer tier) lacks ``step``, which every rank can get.
    The same on every rank; never true without a peer tier among the tiers read (every tier counts as RAM
    then)."""
    return any(step not in fast for fast in got.fast)


def only_at_peers(got: RestorePlan, step: int) -> bool:
    """Whether some rank can get its shard of ``step`` only from a peer (none of its own tiers holds it)."""
    return any(step not in own for own in got.own)


def localize(store: TieredStore, step: int, tiers: list[str]) -> None:
    """Bring every rank's shard of ``step`` into its RAM (collective): a replaced node's from a peer, for
    readers that read tiers directly. Failing costs only speed: the readers try the tiers."""
    try:
        store.localize(step, tiers=tiers)
    except (RestoreIncompleteError, CheckpointLostError):
        raise  # the last restore did not finish on every rank, or steps were lost
    except (StepNotFoundError, RestoreError) as e:
        log.warning("step %d could not be brought into RAM from peers (%s); restoring from the tiers", step, e)


def is_dcp_step(store: TieredStore, step: int, tiers: list[str]) -> bool:
    """Whether ``step`` was saved through TieredWriter (collective; every rank gets the same answer)."""
    g = store.group
    try:
        mine: bool | None = DCP_SHARD_KEY in store.read_manifest(step, g.rank, tiers=tiers)[0].metadata
    except (TierfsError, OSError, ValueError, KeyError):
        mine = None  # e.g. a rank beyond the saving job's world size, or a replaced node
    return any_rank(g, mine is True)
