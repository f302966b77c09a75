"""Capacity planning: RAM per host, save interval per tier, expected goodput, bandwidth needed.

Pure functions of the numbers they are given (no I/O, no clock). Units: bytes, seconds, bytes per
second; printed as GB = 1e9 bytes and GB/s = 1e9 bytes/s.

- :mod:`~tierfs.planning.formulas`: the formulas (checkpoint size, cluster MTTF, Young/Daly, RAM per host).
- :mod:`~tierfs.planning.model`: the goodput model of a strategy.
- :mod:`~tierfs.planning.inputs`: :class:`PlanInputs`, what the planner is given.
- :mod:`~tierfs.planning.optimise`: :func:`make_plan`, the intervals that maximise goodput.
- :mod:`~tierfs.planning.report`: the plan as text (``tierfs plan``) and as JSON.
- :mod:`~tierfs.planning.simulate`: a Monte-Carlo run of the same model (``tierfs simulate``), which
  checks the goodput figures.
- :mod:`~tierfs.planning.coordination`: what coordinating a save costs a job of a given size.
- :mod:`~tierfs.planning.erasure`: the peer tier's layouts, replicas and erasure coding: groups, RAM per
  host, the probability of losing a step within a save interval.
- :mod:`~tierfs.planning.layouts`: those layouts side by side for a plan (``tierfs plan --parity 4+1``).
- :mod:`~tierfs.planning.losses`: a Monte-Carlo of node losses counting each layout's lost steps
  (``tierfs simulate --parity``), which checks the formulas.

Imports point one way: report -> layouts -> optimise -> formulas, inputs, model; inputs, layouts ->
erasure -> formulas; simulate -> model; losses -> erasure, simulate.
"""

from .formulas import (BYTES_PER_PARAM, RamBudget, checkpoint_bytes, cluster_mttf, ram_per_host, sustained_bandwidth,
                       young_daly)
from .erasure import (Erasure, erasure_loss_probability, erasure_ram, group_sizes, node_loss_probability, node_mtbf,
                      parse_erasure, replica_loss_probability)
from .inputs import DEFAULT_BACKGROUND_SLOWDOWN, PlanInputs
from .model import FailureClass, Strategy, TierModel, expected_goodput, expected_job_time
from .optimise import Plan, StrategyPlan, TierPlan, make_plan, optimise, scaled
from .report import format_plan, plan_to_dict

__all__ = [
    "BYTES_PER_PARAM", "DEFAULT_BACKGROUND_SLOWDOWN", "Erasure", "FailureClass", "Plan", "PlanInputs", "RamBudget",
    "Strategy", "StrategyPlan", "TierModel", "TierPlan", "checkpoint_bytes", "cluster_mttf", "erasure_loss_probability",
    "erasure_ram", "expected_goodput", "expected_job_time", "format_plan", "group_sizes", "make_plan",
    "node_loss_probability", "node_mtbf", "optimise", "parse_erasure", "plan_to_dict", "ram_per_host",
    "replica_loss_probability", "scaled", "sustained_bandwidth", "young_daly",
]
