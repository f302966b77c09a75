"""Figures for a dashboard, through prometheus-client (the ``metrics`` extra). Off by default.

Turn them on for every store of a process with ``TIERFS_METRICS_PORT=9400`` in the environment (each rank
serves on that port plus its ``LOCAL_RANK``, so the ranks of a node use consecutive ports), or with
:func:`serve`. Prometheus scrapes ``http://NODE:PORT/metrics``. Every figure is labelled by ``rank``, and
those of a tier by ``tier`` (its name):

=====================================  ==========  ==============================================================
``tierfs_save_stall_seconds``          histogram   how long ``save`` held the training thread
``tierfs_saved_bytes_total``           counter     bytes of this rank's shards each tier took (committed or copied)
``tierfs_durable_seconds``             histogram   from ``save`` to the step committed on a tier
``tierfs_tier_lag_steps``              gauge       steps a slower tier took and does not hold yet (copies queued
                                                   or running: rises while uploads are throttled)
``tierfs_tier_backlog_bytes``          gauge       the bytes of those steps, this rank's part
``tierfs_request_faults_total``        counter     requests to a store that failed, by ``kind``: ``throttled``
                                                   (waited out), ``transient`` (retried), ``permanent``
``tierfs_copy_failures_total``         counter     copies to a tier that failed, by ``error`` (the class)
``tierfs_restore_seconds``             histogram   restores, by the tier that served them
``tierfs_restored_bytes_total``        counter     bytes restored, by tier
``tierfs_tier_used_bytes``             gauge       what a tier of this machine holds (after each commit), with
``tierfs_tier_budget_bytes``,                      its budget and the free space of its file system
``tierfs_tier_free_bytes``
=====================================  ==========  ==============================================================

The framework adapters pass :func:`latest` (the same figures, for this rank) to the framework's logger.
Nothing here ever fails a save: a port that cannot be served is a warning.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from typing import Any, Iterator

log = logging.getLogger("tierfs")

#: the environment variable that turns metrics on: the first rank's port on each node
PORT_VAR = "TIERFS_METRICS_PORT"
#: the stall and durability histograms' buckets, in seconds
BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 1800.0)


class Sink:
    """Where tierfs reports what happened: nothing (metrics off)."""

    rank = 0

    @contextlib.contextmanager
    def saving(self, step: int) -> Iterator[None]:
        """Around a ``save`` call: when ``step`` started (for :meth:`committed`), and the stall."""
        self.started(step)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.stall(time.perf_counter() - t0)

    def stall(self, seconds: float) -> None: ...
    def started(self, step: int) -> None: ...
    def committed(self, tier: str, step: int, nbytes: int) -> None: ...
    def queued(self, tier: str, step: int, nbytes: int) -> None: ...
    def copied(self, tier: str, step: int, ok: bool, error: str | None = None) -> None: ...
    def request_fault(self, tier: str, kind: str) -> None: ...
    def restored(self, tier: str, seconds: float, nbytes: int) -> None: ...
    def space(self, tier: Any) -> None: ...


class Prometheus(Sink):
    """The figures as prometheus-client metrics, in a registry of their own."""

    def __init__(self, rank: int = 0) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.rank = rank
        self.registry = reg = CollectorRegistry()
        t, r = ("tier", "rank"), ("rank",)
        self.m_stall = Histogram("tierfs_save_stall_seconds", "How long save held the training thread", r,
                                 buckets=BUCKETS, registry=reg)
        self.m_bytes = Counter("tierfs_saved_bytes", "Bytes of this rank's shards each tier took", t, registry=reg)
        self.m_durable = Histogram("tierfs_durable_seconds", "From save to the step committed on a tier", t,
                                   buckets=BUCKETS, registry=reg)
        self.m_lag = Gauge("tierfs_tier_lag_steps", "Steps a tier took and does not hold yet", t, registry=reg)
        self.m_backlog = Gauge("tierfs_tier_backlog_bytes", "Bytes of the steps a tier does not hold yet", t,
                               registry=reg)
        self.m_faults = Counter("tierfs_request_faults", "Requests to a store that failed, by kind",
                                ("tier", "kind", "rank"), registry=reg)
        self.m_failures = Counter("tierfs_copy_failures", "Copies to a tier that failed, by error",
                                  ("tier", "error", "rank"), registry=reg)
        self.m_restore = Histogram("tierfs_restore_seconds", "Restores, by the tier that served them", t,
                                   buckets=BUCKETS, registry=reg)
        self.m_restored = Counter("tierfs_restored_bytes", "Bytes restored, by tier", t, registry=reg)
        self.m_used = Gauge("tierfs_tier_used_bytes", "What a tier of this machine holds", t, registry=reg)
        self.m_budget = Gauge("tierfs_tier_budget_bytes", "A tier's budget", t, registry=reg)
        self.m_free = Gauge("tierfs_tier_free_bytes", "Free space of a tier's file system", t, registry=reg)
        self._lock = threading.Lock()
        self._started: dict[int, float] = {}
        self._pending: dict[str, dict[int, int]] = {}  # tier -> {step: bytes} handed on, not yet copied
        self.latest: dict[str, float] = {}

    def _note(self, key: str, value: float) -> None:
        self.latest[key] = value

    def stall(self, seconds: float) -> None:
        self.m_stall.labels(self.rank).observe(seconds)
        self._note("tierfs/save_stall_seconds", seconds)

    def started(self, step: int) -> None:
        with self._lock:
            self._started[step] = time.monotonic()
            while len(self._started) > 64:
                self._started.pop(min(self._started))

    def committed(self, tier: str, step: int, nbytes: int) -> None:
        self.m_bytes.labels(tier, self.rank).inc(nbytes)
        t0 = self._started.get(step)
        if t0 is not None:
            took = time.monotonic() - t0
            self.m_durable.labels(tier, self.rank).observe(took)
            self._note(f"tierfs/durable_seconds/{tier}", took)

    def _pending_changed(self, tier: str) -> None:
        pending = self._pending.get(tier, {})
        self.m_lag.labels(tier, self.rank).set(len(pending))
        self.m_backlog.labels(tier, self.rank).set(sum(pending.values()))
        self._note(f"tierfs/lag_steps/{tier}", len(pending))

    def queued(self, tier: str, step: int, nbytes: int) -> None:
        with self._lock:
            self._pending.setdefault(tier, {})[step] = nbytes
            self._pending_changed(tier)

    def copied(self, tier: str, step: int, ok: bool, error: str | None = None) -> None:
        with self._lock:
            nbytes = self._pending.get(tier, {}).pop(step, 0)
            self._pending_changed(tier)
        if ok:
            self.committed(tier, step, nbytes)
        else:
            self.m_failures.labels(tier, error or "unknown", self.rank).inc()

    def request_fault(self, tier: str, kind: str) -> None:
        self.m_faults.labels(tier, kind, self.rank).inc()

    def restored(self, tier: str, seconds: float, nbytes: int) -> None:
        self.m_restore.labels(tier, self.rank).observe(seconds)
        self.m_restored.labels(tier, self.rank).inc(nbytes)

    def space(self, tier: Any) -> None:
        """``tier``'s :meth:`~tierfs.tiers.base.Tier.capacity` (asked only while metrics are on)."""
        cap = tier.capacity()
        self.m_used.labels(tier.name, self.rank).set(cap.used)
        if cap.budget is not None:
            self.m_budget.labels(tier.name, self.rank).set(cap.budget)
        if cap.free is not None:
            self.m_free.labels(tier.name, self.rank).set(cap.free)
        self._note(f"tierfs/used_bytes/{tier.name}", cap.used)


#: the process's sink: :class:`Sink` (off) until metrics are turned on
SINK: Sink = Sink()
_served: dict[int, Any] = {}


def serve(port: int | None, rank: int = 0) -> Prometheus:
    """Turn metrics on for this process and serve them over HTTP on ``port`` (None: kept, not served, for
    :func:`latest` and the framework loggers). Once per process; later calls return the same metrics, with
    ``rank`` as given last. A port that cannot be bound is a warning: the metrics are still kept."""
    global SINK
    if not isinstance(SINK, Prometheus):
        SINK = Prometheus(rank)
    SINK.rank = rank
    if port is not None and port not in _served:
        from prometheus_client import start_http_server

        try:
            _served[port] = start_http_server(port, registry=SINK.registry)
            log.info("tierfs: metrics on http://%s:%d/metrics", os.uname().nodename, port)
        except OSError as e:
            _served[port] = None
            log.warning("tierfs: metrics cannot be served on port %d (%s); set %s to a free port", port, e, PORT_VAR)
    return SINK


def from_environment(rank: int) -> None:
    """Turn metrics on if ``TIERFS_METRICS_PORT`` says so (a store calls this as it opens)."""
    base = os.environ.get(PORT_VAR, "").strip()
    if not base and not isinstance(SINK, Prometheus):
        return
    if base:
        try:
            port = int(base) + int(os.environ.get("LOCAL_RANK", "0") or 0)
        except ValueError:
            log.warning("tierfs: %s=%r is not a port number; metrics stay off", PORT_VAR, base)
            return
        try:
            serve(port, rank)
        except ImportError:
            log.warning("tierfs: %s is set but prometheus-client is not installed (pip install "
                        "'tierfs[metrics]'); metrics stay off", PORT_VAR)
    else:
        SINK.rank = rank


def off() -> None:
    """Turn metrics off for this process (a port served keeps its last figures)."""
    global SINK
    SINK = Sink()


def latest() -> dict[str, float]:
    """The newest value of this rank's figures, for a framework's logger (empty while metrics are off)."""
    return dict(SINK.latest) if isinstance(SINK, Prometheus) else {}
