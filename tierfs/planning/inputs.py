"""What the planner is given: the job, its failures, the tiers' bandwidths and the RAM tier
(:class:`PlanInputs`), checked when made."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from .erasure import Erasure, group_sizes

#: the slowdown of training while a background copy runs, as a fraction of the copy's duration: tierfs's
#: default throttle measured +3.5% (-0.8% to +5.7%) on a training loop (docs/performance.md); 5% is the
#: bound it is held to
DEFAULT_BACKGROUND_SLOWDOWN = 0.05


@dataclass(frozen=True)
class PlanInputs:
    """What the planner needs; bandwidths are per host, bytes/s, None when unknown.

    Attributes
    ----------
    checkpoint : float
        Bytes of one whole checkpoint.
    hosts, accelerators : int
        Hosts and accelerators in the job.
    mttf : float or None
        The cluster's MTTF in seconds (see :func:`.formulas.cluster_mttf` to scale a per-accelerator one).
    node_loss : float
        Fraction of failures that lose a node's RAM (the rest only restart the process).
    replica_loss : float
        Fraction of node losses that also lose every peer holding the node's replicas.
    step_time : float or None
        Seconds per training step; intervals are rounded to whole steps when given.
    restart : float
        Seconds to restart the job after any failure, before reading a checkpoint.
    replace : float
        Extra seconds to bring in a replacement node after a node loss.
    ram_save, ram_restore, peer, object_write, object_read : float or None
        Per-host bandwidths: RAM-tier save (what training waits for) and restore, peer transfer, object
        store upload and download.
    object_total : float or None
        The object store's aggregate limit for the whole job (None: hosts x per-host bandwidth).
    keep, in_flight, replicas, replica_keep, headroom
        RAM-tier sizing, see :func:`.formulas.ram_per_host`. ``replicas`` >= 1 enables the peer strategy.
    background_slowdown : float
        Fraction of a background copy's duration that training loses to it.
    intervals : mapping
        Fixed intervals in seconds by tier name (``ram``, ``peer``, ``object``) instead of Young/Daly.
    saves_per_mttf : float or None
        Save the object tier this many times per MTTF (``interval = mttf / n``), the seed's rule.
    max_object_interval : float
        With peers, node losses rarely need the object tier; its interval is capped at this.
    data_parallel : int
        Copies of the model across hosts (DDP's replicas, HSDP's replica groups): each host holds
        ``checkpoint * data_parallel / hosts``, the object store takes each distinct byte once (the upload
        spread over every host), and a lost node's state is in the RAM of the hosts holding the same
        part, so peers replicate nothing.
    erasure : tuple of Erasure
        Erasure codes (``4+1``: ``ErasureCodedTier(data=4, parity=1)``) to compare with replicas=1 and 2
        (:mod:`.layouts`): RAM per host and the probability of losing a step; empty: no comparison.
    """

    checkpoint: float
    hosts: int
    accelerators: int
    mttf: float | None = None
    node_loss: float = 0.5
    replica_loss: float = 0.0
    step_time: float | None = None
    restart: float = 60.0
    replace: float = 0.0
    ram_save: float | None = None
    ram_restore: float | None = None
    peer: float | None = None
    object_write: float | None = None
    object_read: float | None = None
    object_total: float | None = None
    keep: int = 2
    in_flight: int = 1
    replicas: int = 0
    replica_keep: int = 1
    headroom: float = 0.15
    background_slowdown: float = DEFAULT_BACKGROUND_SLOWDOWN
    intervals: Mapping[str, float] = field(default_factory=dict)
    saves_per_mttf: float | None = None
    max_object_interval: float = 3600.0
    data_parallel: int = 1
    erasure: tuple[Erasure, ...] = ()

    def __post_init__(self) -> None:
        if not self.checkpoint > 0:
            raise ValueError("checkpoint size must be positive")
        if self.hosts < 1 or self.accelerators < self.hosts:
            raise ValueError("need hosts >= 1 and accelerators >= hosts")
        if self.mttf is not None and not self.mttf > 0:
            raise ValueError("MTTF must be positive")
        for name in ("node_loss", "replica_loss", "background_slowdown"):
            v = getattr(self, name)
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"{name.replace('_', ' ')} must be a fraction in [0, 1], got {v}")
        if self.step_time is not None and not self.step_time > 0:
            raise ValueError("step time must be positive")
        if self.restart < 0 or self.replace < 0:
            raise ValueError("restart and replace times must be >= 0")
        for name in ("ram_save", "ram_restore", "peer", "object_write", "object_read", "object_total"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise ValueError(f"bandwidth {name.replace('_', ' ')} must be positive")
        for k, v in self.intervals.items():
            if k not in ("ram", "peer", "object") or not v > 0:
                raise ValueError(f"fixed interval for {k!r} must be a positive number of seconds for ram, "
                                 "peer or object")
        if self.saves_per_mttf is not None and not self.saves_per_mttf > 0:
            raise ValueError("saves per MTTF must be positive")
        if not 1 <= self.data_parallel <= self.hosts:
            raise ValueError(f"data-parallel degree {self.data_parallel} must be from 1 to the hosts ({self.hosts})")
        for code in self.erasure:
            group_sizes(self.hosts, code.data, code.parity)  # ValueError when too few hosts

    @property
    def shard(self) -> float:
        """Bytes each host holds of one checkpoint (its part of one data-parallel copy)."""
        return self.checkpoint * self.data_parallel / self.hosts

    @property
    def peer_replicas(self) -> int:
        """Replicas the peer tier keeps of each host's shard: none when other hosts hold it (data parallel)."""
        return self.replicas if self.data_parallel == 1 else 0

    def object_rate(self, per_host: float | None) -> float | None:
        """The job's aggregate object-store bandwidth for a per-host one."""
        if per_host is None:
            return None
        agg = per_host * self.hosts
        return agg if self.object_total is None else min(agg, self.object_total)
