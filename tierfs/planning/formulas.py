"""The planner's closed-form formulas: a checkpoint's size, the cluster's MTTF, Young/Daly's interval, the
bandwidth a tier needs, and the RAM a host needs for the RAM tier (no I/O, no clock)."""

from __future__ import annotations

import math
from dataclasses import dataclass

#: bytes per parameter of a training checkpoint: fp32 weights + Adam's two fp32 moments
BYTES_PER_PARAM = 12


def checkpoint_bytes(params: float, bytes_per_param: float = BYTES_PER_PARAM) -> float:
    """Bytes of a training checkpoint of ``params`` parameters.

    Parameters
    ----------
    params : float
        Number of model parameters.
    bytes_per_param : float
        Bytes each parameter costs in the checkpoint; 12 for fp32 weights plus Adam's two moments.

    Returns
    -------
    float
        ``params * bytes_per_param``; 70e9 parameters give 840e9 bytes.
    """
    if params <= 0 or bytes_per_param <= 0:
        raise ValueError("parameters and bytes per parameter must be positive")
    return float(params) * float(bytes_per_param)


def cluster_mttf(accelerator_mttf: float, accelerators: int) -> float:
    """The cluster's mean time to failure when any one of ``accelerators`` failing stops the job.

    Parameters
    ----------
    accelerator_mttf : float
        Mean time to failure of one accelerator (with its share of host, network, software), seconds.
    accelerators : int
        Accelerators in the job.

    Returns
    -------
    float
        ``accelerator_mttf / accelerators`` (independent exponential failures).
    """
    if accelerator_mttf <= 0 or accelerators < 1:
        raise ValueError("accelerator MTTF must be positive and accelerators >= 1")
    return float(accelerator_mttf) / int(accelerators)


def young_daly(cost: float, mttf: float) -> float:
    """Young/Daly's checkpoint interval ``sqrt(2 * cost * mttf)`` (seconds of work between saves).

    Parameters
    ----------
    cost : float
        Seconds a save blocks training.
    mttf : float
        Mean time between the failures the saves protect against (``inf``: none).

    Returns
    -------
    float
        The interval; ``inf`` when ``mttf`` is infinite, 0 when the save costs nothing.
    """
    if cost < 0 or mttf <= 0:
        raise ValueError("cost must be >= 0 and mttf > 0")
    if math.isinf(mttf):
        return math.inf
    return math.sqrt(2.0 * cost * mttf)


def sustained_bandwidth(nbytes: float, interval: float) -> float:
    """Bytes per second a tier must absorb to take ``nbytes`` every ``interval`` seconds."""
    if interval <= 0:
        raise ValueError("interval must be positive")
    return 0.0 if math.isinf(interval) else float(nbytes) / float(interval)


@dataclass(frozen=True)
class RamBudget:
    """RAM a host needs for the RAM tier, in bytes (see :func:`ram_per_host`)."""

    shard: float  # this host's part of one checkpoint
    own: float  # own steps kept
    in_flight: float  # steps being written while the kept ones stay
    replicas: float  # copies of other hosts' shards held for them
    headroom: float  # safety margin

    @property
    def total(self) -> float:
        return self.own + self.in_flight + self.replicas + self.headroom


def ram_per_host(checkpoint: float, hosts: int, *, keep: int = 2, in_flight: int = 1, replicas: int = 0,
                 replica_keep: int = 1, headroom: float = 0.15) -> RamBudget:
    """RAM per host for the RAM tier: own steps kept + steps in flight + replicas held, plus headroom.

    Parameters
    ----------
    checkpoint : float
        Bytes of one whole checkpoint (all hosts).
    hosts : int
        Hosts the checkpoint is sharded over; each holds ``checkpoint / hosts``.
    keep : int
        Own steps the RAM tier keeps (its ``LatestN``; tierfs's default is 2).
    in_flight : int
        Steps being written while the kept ones stay (tierfs stages a new step before retention frees
        an old one: 1).
    replicas : int
        Peer copies of each shard; each host holds ``replicas`` other hosts' shards.
    replica_keep : int
        Steps of each replica a host keeps.
    headroom : float
        Fraction added for the pool, metadata and fragmentation (Orbax's docs suggest 10-15%).

    Returns
    -------
    RamBudget
        The parts and their ``total``. Orbax's rule ``2 * checkpoint / hosts + 15%`` is ``keep=1,
        in_flight=1, replicas=0, headroom=0.15``: 70e9 * 12 B on 32 hosts gives 60.4e9 bytes.
    """
    if checkpoint <= 0 or hosts < 1:
        raise ValueError("checkpoint bytes must be positive and hosts >= 1")
    if keep < 1 or in_flight < 0 or replicas < 0 or replica_keep < 1 or headroom < 0:
        raise ValueError("need keep >= 1, in_flight >= 0, replicas >= 0, replica_keep >= 1, headroom >= 0")
    shard = float(checkpoint) / int(hosts)
    own, flight, held = keep * shard, in_flight * shard, replicas * replica_keep * shard
    return RamBudget(shard, own, flight, held, headroom * (own + flight + held))
