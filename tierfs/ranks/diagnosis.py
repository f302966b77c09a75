"""Which ranks failed, found out once per process through the job's key-value store, and kept: after that,
every wait of tierfs on the other ranks raises at once, naming the same ranks.

A collective (:mod:`tierfs.ranks.collectives`) fails on every rank that takes part as soon as one rank's
connection drops, or when its time runs out; the backend's message says neither which rank it was nor
whether it is gone or stuck. So the first failure a process sees (a collective's, or a transfer's whose
peer is gone or late) is reported to the job's store (torch.distributed's TCPStore, which every rank is
connected to already): its rank and what it saw, in one append and one counter increment, under a key of
the job's launch. Before reporting, the rank closes its connections on every group of tierfs
(:mod:`tierfs.ranks.severing`), so that every rank still blocked on it fails and reports too, in
milliseconds, whichever group or collective it was in. The first to report waits until every rank did, or
until no rank has reported for :data:`SETTLE` seconds, and publishes the verdict: the ranks that never
reported. Every other rank waits for that verdict.

A rank whose process is gone cannot report, and neither can one stuck outside tierfs: both are named, as
gone when the ranks saw connections drop, else as not arriving in time. No connection to a failed rank is
ever opened, and what a rank sends and receives does not grow with the job: a few requests each, and the
verdict once. The job's store may be gone too: where torch.distributed started it in rank 0's process
(``env://`` or ``tcp://`` initialisation, not torchrun's agent store), its connection failing is itself
the verdict: rank 0 is gone.

The verdict is kept (:func:`raise_known`): the job's ranks are out of step on tierfs's groups for good,
so every later wait raises at once, naming the same ranks and saying that the job must restart.
"""

from __future__ import annotations

import json
import os
import threading
import time
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..util import stages as _stages
from ..errors import RankWaitError
from . import waits

if TYPE_CHECKING:
    from .member import Member

#: seconds the first rank to report waits for more reports after the last one came in
SETTLE = 1.0
#: seconds a rank waits for the verdict beyond the operation's deadline (the first rank's settling)
_VERDICT = 2 * SETTLE + 5.0
#: seconds between two looks at the store while waiting (only ever after a failure)
_POLL = 0.02
_KINDS = {waits.GONE: "g", waits.LATE: "l", waits.CLOSED: "c", waits.FAILED: "f"}


@dataclass(frozen=True)
class Verdict:
    """What this process found out about the job's failed ranks.

    ``ranks``: the ranks that failed (None: it could not be found out); ``late``: they did not arrive in
    time (else their processes are gone); ``timeout``: the wait's bound, seconds; ``where``: what this rank
    was doing when it saw the failure; ``detail``: a few more words (where the store went, why nothing is
    known).
    """

    ranks: list[int] | None
    late: bool
    timeout: float
    where: str | None
    detail: str = ""

    def error(self, where: str | None, rank: int, *, later: bool = False) -> RankWaitError:
        """The error of a wait at ``where`` on rank ``rank``; ``later``: a wait that began once the verdict
        was known (it raises at once, and says so)."""
        at = f"{where}: " if where else ""
        seen = f"seen in {self.where}" if self.where and self.where != where else "seen earlier"
        since = f"; {seen}" if later else ""
        restart = ("; tierfs's waits on the other ranks fail at once since then: the job must restart (as "
                   "torchrun's elastic agent does)") if later else ""
        ranks = None if self.ranks is None else list(self.ranks)
        if ranks is None:
            message = (f"{at}a wait on the other ranks failed, and which rank made it fail could not be found out "
                       f"({self.detail}{since})" + (restart or "; check the other ranks' logs"))
        elif not ranks:
            message = f"{at}a collective of every rank failed although every rank answers ({self.detail}{since})" + \
                (restart or "; see the log")
        elif rank in ranks:
            message = (f"{at}the other ranks gave up waiting for this rank ({rank}) after {self.timeout:g} s"
                       f"{f' ({seen})' if later else ''}; the job must restart")
        elif self.late:
            message = (f"{at}rank(s) {ranks} did not arrive within {self.timeout:g} s{f' ({seen})' if later else ''}"
                       f"{restart or '; it may be stuck or dead: check its log, or raise timeout= if it is only slow'}")
        else:
            more = f", {self.detail}" if self.detail else ""
            message = f"{at}rank(s) {ranks} is gone (its process ended{more}{since}){restart or '; check its log'}"
        err = RankWaitError(message, stage=where, ranks=ranks)
        if where is not None:
            err.tierfs_stage = where  # type: ignore[attr-defined]
        return err


class _NoVerdict(Exception):
    """The first rank to report gave no verdict in time."""


class _Job:
    """What this process knows of one launch of the job (its default group): the number naming its keys
    in the store, and the verdict, once there is one."""

    def __init__(self, world: Any) -> None:
        self.world = weakref.ref(world) if world is not None else None
        self.launch: int | None = None
        self.verdict: Verdict | None = None
        self.lock = threading.Lock()


_job: _Job | None = None
_jobs_lock = threading.Lock()


def _current(dist: Any) -> _Job:
    """The record of the job of torch.distributed's default group now (a job initialised again starts afresh)."""
    global _job
    try:
        world = dist.distributed_c10d._get_default_group()
    except Exception:  # noqa: BLE001 - not initialised (anymore)
        world = None
    with _jobs_lock:
        if _job is None or (_job.world() if _job.world is not None else None) is not world:
            _job = _Job(world)
        return _job


def launched(dist: Any, job: int) -> None:
    """Note the number of the first group of tierfs this process made for this launch of the job (the same
    on every rank): the store's keys of the diagnosis start with it."""
    record = _current(dist)
    if record.launch is None:
        record.launch = job


def launch(dist: Any) -> int | None:
    """The number of this launch of the job (see :func:`launched`), once noted."""
    return _current(dist).launch


def known(dist: Any) -> Verdict | None:
    """The verdict on this launch of the job, once this process found one out."""
    return _current(dist).verdict if dist is not None else None


def raise_known(dist: Any, rank: int, where: str | None = None) -> None:
    """Raise at once, naming the failed ranks, when this process knows of a failure of the job's ranks
    (every wait of tierfs on other ranks begins with this)."""
    record = _job
    if record is None or record.verdict is None or dist is None:
        return  # the usual case: no failure, no request
    verdict = known(dist)
    if verdict is not None:
        raise verdict.error(where if where is not None else _stages.current(), rank, later=True)


def diagnose(g: "Member", oper: waits.Operation, why: str) -> RankWaitError:
    """The error naming the ranks that made a collective of ``g`` fail with ``why`` on this rank (see the
    module docstring; this rank's connections are closed already)."""
    if waits.kind_of(why) == waits.LATE:  # gloo closed, or will close, this rank's connections on the group
        g._state.setdefault("closed", "a collective timed out")
    return find_out(g, oper, waits.kind_of(why), why).error(_stages.current(), g.rank)


def find_out(g: "Member", oper: waits.Operation, kind: str, why: str = "") -> Verdict:
    """The verdict on the job's failed ranks (see the module docstring): found out by the first failure
    this process sees, then kept; another thread failing meanwhile waits for it."""
    record = _current(g._dist)
    with record.lock:
        if record.verdict is None:
            record.verdict = _ask(g, oper, kind, why, record.launch if record.launch is not None else g._job)
        return record.verdict


def _ask(g: "Member", oper: waits.Operation, kind: str, why: str, launch: int) -> Verdict:
    """Report this rank's failure to the job's store and get the verdict."""
    where = _stages.current()
    store = job_store(g._dist)
    if store is None:
        return Verdict(None, False, oper.timeout, where, "torch.distributed has no job store to ask")
    key = f"tierfs/who/{launch}"
    try:
        store.append(f"{key}/ranks", f"{g.rank}{_KINDS[kind]},")
        if store.add(f"{key}/n", 1) == 1:  # the first to report
            verdict = _settle(store, key, g.world_size, oper, kind == waits.LATE)
            store.set(f"{key}/verdict", json.dumps(verdict).encode())
        else:
            verdict = _verdict(store, key, oper)
    except _NoVerdict:  # the first rank to report died meanwhile
        return Verdict(None, False, oper.timeout, where, "the first rank to report gave no verdict")
    except Exception as e:  # noqa: BLE001 - the store is gone too (its own errors: RuntimeErrors of torch's)
        host = store_host(g._dist)
        if host is not None and host != g.rank and kind in (waits.GONE, waits.CLOSED, waits.LATE):
            return Verdict([host], False, oper.timeout, where, "and with it the job's key-value store it held")
        said = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return Verdict(None, False, oper.timeout, where, f"the job's key-value store cannot be reached: {said}")
    missing, late = verdict["missing"], verdict["late"]
    return Verdict(list(missing), bool(late), oper.timeout, where, "" if missing else waits.said(why))


def _settle(store: Any, key: str, world: int, oper: waits.Operation, late: bool) -> dict[str, Any]:
    """On the first rank to report: wait until every rank reported or none did for :data:`SETTLE` seconds
    (at most the operation's time left and the settling); when this rank's wait timed out (``late``), until
    every rank's wait of the operation timed out too (its deadline, the grace and half the settling), then
    the verdict: ``{"missing": [ranks that did not report], "late": whether a rank that did saw its wait
    time out}``."""
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
            raise _NoVerdict()
        time.sleep(_POLL)
    return json.loads(store.get(f"{key}/verdict"))


def job_store(dist: Any) -> Any:
    """The job's key-value store (torch.distributed's default, given the ``torch.distributed`` module), or
    None when it cannot be had: the diagnosis, the pool's vote and the ranks' reports go through it."""
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - a torch without it
        return None


def store_host(dist: Any) -> int | None:
    """The rank whose process holds the job's store: 0 where torch.distributed started a TCPStore there
    (``env://`` and ``tcp://`` initialisation start it in rank 0's process), None where it lives elsewhere
    (torchrun's agent holds it when ``TORCHELASTIC_USE_AGENT_STORE`` is set) or is no TCPStore."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").strip().lower() in ("1", "true"):
        return None
    store = job_store(dist)
    for _ in range(8):  # prefixes wrap it
        inner = getattr(store, "underlying_store", None)
        if inner is None:
            break
        store = inner
    tcp = getattr(getattr(dist, "distributed_c10d", None), "TCPStore", None) or getattr(dist, "TCPStore", None)
    return 0 if tcp is not None and isinstance(store, tcp) else None
