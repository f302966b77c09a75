"""Capacity planning: RAM per host, save interval per tier, expected goodput, bandwidth needed.

Pure functions of the numbers they are given (no I/O, no clock). Units: bytes, seconds, bytes per
second; printed as GB = 1e9 bytes and GB/s = 1e9 bytes/s.

- :mod:`~tierfs.planning.model`: the formulas (checkpoint size, cluster MTTF, Young/Daly, RAM per host)
  and the goodput model of a strategy; :class:`PlanInputs`, what the planner is given.
- :mod:`~tierfs.planning.optimise`: :func:`make_plan`, the intervals that maximise goodput.
- :mod:`~tierfs.planning.report`: the plan as text (``tierfs plan``) and as JSON.

- :mod:`~tierfs.planning.simulate`: a Monte-Carlo run of the same model (``tierfs simulate``), which
  checks the goodput figures.

Imports point one way: report -> optimise -> model <- simulate.
"""

from .model import (BYTES_PER_PARAM, DEFAULT_BACKGROUND_SLOWDOWN, FailureClass, PlanInputs, RamBudget, Strategy,
                    TierModel, checkpoint_bytes, cluster_mttf, expected_goodput, expected_job_time, ram_per_host,
                    sustained_bandwidth, young_daly)
from .optimise import Plan, StrategyPlan, TierPlan, make_plan, optimise, scaled
from .report import format_plan, plan_to_dict

__all__ = [
    "BYTES_PER_PARAM", "DEFAULT_BACKGROUND_SLOWDOWN", "FailureClass", "Plan", "PlanInputs", "RamBudget",
    "Strategy", "StrategyPlan", "TierModel", "TierPlan", "checkpoint_bytes", "cluster_mttf", "expected_goodput",
    "expected_job_time", "format_plan", "make_plan", "optimise", "plan_to_dict", "ram_per_host", "scaled",
    "sustained_bandwidth", "young_daly",
]
