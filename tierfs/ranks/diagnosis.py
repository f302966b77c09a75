"""Which ranks made a collective fail, found out through the job's key-value store.

A collective (:mod:`tierfs.ranks.collectives`) fails on every rank that takes part as soon as one rank's
connection drops, or when its time runs out; the backend's message says neither which rank it was nor
whether it is gone or stuck. Every rank that saw the collective fail then reports to the job's store
(torch.distributed's TCPStore, which every rank is connected to already): its rank and what it saw, in one
append and one counter increment. The first to report waits until every rank did, or until no rank has
reported for :data:`SETTLE` seconds (ranks still in the collective fail within milliseconds of each
other), and publishes the verdict: the ranks that never reported. Every other rank waits for that verdict.

A rank whose process is gone cannot report, and neither can one stuck outside the collective: both are
named, as gone when the others saw its connection drop, else as not arriving in time. No connection to a
failed rank is ever opened (a connection to a dead rank may take several timeouts to fail), and what a
rank sends and receives does not grow with the job: a few requests each, and the verdict once. Only the
first rank to report reads every rank's report.
"""

from __future__ import annotations

import json
import secrets
import time
from typing import TYPE_CHECKING, Any

from .. import _stages
from ..errors import RankWaitError
from . import waits

if TYPE_CHECKING:
    from .groups import TorchGroup

#: seconds the first rank to report waits for more reports after the last one came in
SETTLE = 1.0
#: seconds a rank waits for the verdict beyond the collective's deadline (the first rank's settling)
_VERDICT = 2 * SETTLE + 5.0
#: seconds between two looks at the store while waiting (only ever after a collective failed)
_POLL = 0.02
_KINDS = {waits.GONE: "g", waits.LATE: "l", waits.CLOSED: "c", waits.FAILED: "f"}


def job_id(g: "TorchGroup") -> int:
    """A number every rank of this launch of the job shares, and no other launch (collective: rank 0's
    random number, by an all-reduce); the store's keys of a diagnosis start with it."""
    from . import collectives

    return collectives.all_reduce(g, [secrets.randbits(62) if g.rank == 0 else 0], "max")[0]


def diagnose(g: "TorchGroup", oper: waits.Operation, why: str, call: int) -> RankWaitError:
    """The error naming the ranks that made the ``call``-th collective of ``g`` fail with ``why`` on this
    rank (see the module docstring)."""
    where = _stages.current()
    at = f"{where}: " if where else ""
    if waits.kind_of(why) == waits.LATE:  # gloo closed this rank's connections on the group
        g._state.setdefault("closed", f"a collective timed out ({why.strip().splitlines()[0]})")
    store = job_store(g._dist)
    first_line = why.strip().splitlines()[0] if why.strip() else "no reason given"
    if store is None:
        return RankWaitError(f"{at}a collective of every rank failed ({first_line}); see the other ranks' logs",
                             stage=where)
    key = f"tierfs/who/{g._job}/{call}"
    try:
        store.append(f"{key}/ranks", f"{g.rank}{_KINDS[waits.kind_of(why)]},")
        if store.add(f"{key}/n", 1) == 1:  # the first to report
            verdict = _settle(store, key, g.world_size, oper, waits.kind_of(why) == waits.LATE)
            store.set(f"{key}/verdict", json.dumps(verdict).encode())
        else:
            verdict = _verdict(store, key, oper)
    except Exception as e:  # noqa: BLE001 - the store is gone too, or the first rank to report died
        return RankWaitError(f"{at}a collective of every rank failed ({first_line}), and which rank made it fail "
                             f"could not be found out ({str(e).strip().splitlines()[0] if str(e).strip() else e!r}); "
                             "see the other ranks' logs", stage=where)
    missing, late = verdict["missing"], verdict["late"]
    if not missing:
        return RankWaitError(f"{at}a collective of every rank failed ({first_line}) although every rank answers; "
                             "see the log", stage=where)
    err = RankWaitError.waiting(where, missing, oper.timeout, "timed out" if late else "closed by peer")
    if where is not None:
        err.tierfs_stage = where  # type: ignore[attr-defined]
    return err


def _settle(store: Any, key: str, world: int, oper: waits.Operation, late: bool) -> dict[str, Any]:
    """On the first rank to report: wait until every rank reported or none did for :data:`SETTLE` seconds
    (at most the operation's time left and the settling); when this rank's wait timed out (``late``), until
    every rank's wait of the operation timed out too (its deadline, the grace and half the settling), then the verdict: ``{"missing": [ranks that did
    not report], "late": whether a rank that did saw its wait time out}``."""
    end = time.monotonic() + oper.allowed() + SETTLE
    seen, since = store.add(f"{key}/n", 0), time.monotonic()
    # while ranks time out, the others' waits end by the operation's deadline and its grace: wait that out
    patient = oper.deadline + waits.GRACE + SETTLE / 2
    while seen < world and time.monotonic() < end and \
            (time.monotonic() < patient if late else time.monotonic() - since < SETTLE):
        time.sleep(_POLL)
        n = store.add(f"{key}/n", 0)
        if n != seen:
            seen, since = n, time.monotonic()
    reports = [r for r in store.get(f"{key}/ranks").decode().split(",") if r]
    came = {int(r[:-1]) for r in reports}
    return {"missing": [r for r in range(world) if r not in came],
            "late": any(r[-1] == _KINDS[waits.LATE] for r in reports)}


def _verdict(store: Any, key: str, oper: waits.Operation) -> dict[str, Any]:
    """On the other ranks: the first rank's verdict, once it is there."""
    end = time.monotonic() + oper.allowed() + _VERDICT
    while not store.check([f"{key}/verdict"]):
        if time.monotonic() > end:
            raise TimeoutError("the first rank to report gave no verdict")
        time.sleep(_POLL)
    return json.loads(store.get(f"{key}/verdict"))


def job_store(dist: Any) -> Any:
    """The job's key-value store (torch.distributed's default, given the ``torch.distributed`` module), or
    None when it cannot be had: the diagnosis, the pool's vote and the ranks' reports go through it."""
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - a torch without it
        return None
