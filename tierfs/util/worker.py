"""Background threads: a worker that runs jobs in order at the background priority, a bandwidth
throttle, and a function run on a thread of its own until joined."""

from __future__ import annotations

import logging
import math
import os
import queue
import threading
import time
from typing import Any, Callable

from . import args as _args, nogc
from ..errors import ArgumentError

log = logging.getLogger("tierfs")


def _background_nice() -> int:
    """``TIERFS_BACKGROUND_NICE`` (0 to 19), else 0 (a value out of range is logged and ignored)."""
    raw = os.environ.get("TIERFS_BACKGROUND_NICE", "").strip()
    if not raw:
        return 0
    if raw.isdigit() and 0 <= int(raw) <= 19:
        return int(raw)
    log.warning("TIERFS_BACKGROUND_NICE=%r is not a CPU priority from 0 to 19; background work runs at 0", raw)
    return 0


#: CPU priority (nice) of background work: tierfs's worker threads and the transfer threads of its groups.
#: 0 by default, the training thread's own: a background thread at a lower priority that holds the GIL
#: when the cores are busy waits for a core with it, and the training thread waits for the GIL meanwhile
#: (measured at nice 10, a save every 0.2 s: the GIL held by the background twice as long, the training
#: thread blocked 13-14 ms per step against 8; docs/performance.md). ``TIERFS_BACKGROUND_NICE`` sets
#: another (1 to 19), e.g. to leave the cores to data-loading processes first.
BACKGROUND_NICE = _background_nice()
#: bytes/s that background copies (to slower tiers, to peers, the fsspec drain's uploads) may move on
#: average: keeps a training loop within a few percent on a 2-core machine (see docs/performance.md)
#: while a 2 GiB shard still reaches the slow tier in about 18 s (its checksum check and upload both count)
DEFAULT_BACKGROUND_BANDWIDTH = 256e6


def lower_priority(nice: int = BACKGROUND_NICE) -> None:
    """Run the calling thread at CPU priority ``nice`` (Linux: a thread's priority is its own, so
    training threads keep theirs); never higher than it runs at, and a no-op where the platform does not
    allow it."""
    try:
        tid = threading.get_native_id()
        if nice > os.getpriority(os.PRIO_PROCESS, tid):
            os.setpriority(os.PRIO_PROCESS, tid, nice)
    except (AttributeError, OSError):
        pass


class Worker:
    """One thread running submitted jobs in order. A job's exception goes to ``on_error``, never lost."""

    def __init__(self, name: str, on_error: Callable[[BaseException], None], nice: int = BACKGROUND_NICE) -> None:
        self.name, self._on_error, self._nice = name, on_error, nice
        self._queue: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._thread: threading.Thread | None = None

    def submit(self, fn: Callable[[], None]) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            self._thread.start()
        self._queue.put(fn)

    def join(self) -> None:
        """Wait until every job submitted so far has run."""
        if self._thread is not None:
            self._queue.join()

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        if self._nice:
            lower_priority(self._nice)
        while True:
            fn = self._queue.get()
            try:
                if fn is None:
                    return
                with nogc.paused():  # a step's objects: no collection of the whole process meanwhile
                    fn()
            except BaseException as e:  # noqa: BLE001 - handed on, raised by the next call
                log.error("tierfs background work failed: %s", e)
                self._on_error(e)
            finally:
                self._queue.task_done()


#: bytes the throttle lets through at full speed before it waits (see ``Throttle``)
THROTTLE_BURST = 64 << 20


class Throttle:
    """Caps background bandwidth (bytes per second) so training keeps its memory bandwidth and cores.

    Bytes go out in bursts: callers pass at once while what they booked is at most ``burst`` bytes ahead
    of the rate; the booking that would go past it pauses every caller until all bytes booked before it
    are due, then passes (so one message larger than ``burst`` waits only for what came before it). From
    the start of a busy period (idle time is not banked), at most ``rate * t + max(burst, largest
    message)`` bytes pass in ``t`` seconds. Threads sharing a throttle pause and resume together, so each
    keeps its turn in every burst.

    Waiting in few long gaps instead of one per message costs less CPU: every message released into an
    idle connection wakes gloo's I/O threads on both sides afresh (see benchmarks/bench_pacing.py).
    """

    def __init__(self, rate: float | None, burst: int = THROTTLE_BURST, *,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> None:
        number = (int, float)
        if rate is not None and (isinstance(rate, bool) or not isinstance(rate, number) or not 0 < rate < math.inf):
            raise ArgumentError(f"background bandwidth must be positive bytes/s or None, got {_args.shown(rate)}")
        if isinstance(burst, bool) or not isinstance(burst, number) or not 0 <= burst < math.inf:
            raise ArgumentError(f"throttle burst must be >= 0 bytes, got {_args.shown(burst)}")
        self.rate, self.burst = rate, burst
        self._clock, self._sleep = clock, sleep
        self._due = clock()  # when every byte booked so far is due at ``rate``
        self._resume = self._due  # no caller passes before this (a pause)
        self._lock = threading.Lock()

    def consume(self, nbytes: int) -> None:
        """Book ``nbytes`` about to move; wait first during a pause, or if they would go past the burst."""
        if self.rate is None:
            return
        with self._lock:
            now = self._clock()
            start = max(now, self._resume)
            ahead = max(self._due - start, 0.0)
            if ahead > 0 and ahead * self.rate + nbytes > self.burst:
                start = self._resume = start + ahead  # past the burst: everyone waits until back on the rate
                ahead = 0.0
            self._due = start + ahead + nbytes / self.rate
        delay = start - self._clock()  # measured again: a preempted thread does not oversleep
        if delay > 0:
            self._sleep(delay)


class Detached:
    """Runs ``fn`` on a thread of its own from now on; :meth:`join` waits for it and returns its result or
    raises its exception (on the thread that joins)."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self._result: Any = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fn,), name="tierfs-detached", daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self._result = fn()
        except BaseException as e:  # noqa: BLE001 - raised on the thread that joins
            self._error = e

    def join(self) -> Any:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._result
