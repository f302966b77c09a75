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

Imports point one way: report -> optimise -> formulas, inputs, model; simulate -> model.
"""

from .formulas import (BYTES_PER_PARAM, RamBudget, checkpoint_bytes, cluster_mttf, ram_per_host, sustained_bandwidth,
                       young_daly)
from .inputs import DEFAULT_BACKGROUND_SLOWDOWN, PlanInputs
from .model import FailureClass, Strategy, TierModel, expected_goodput, expected_job_time
from .optimise import Plan, StrategyPlan, TierPlan, make_plan, optimise, scaled
from .report import format_plan, plan_to_dict

__all__ = [
    "BYTES_PER_PARAM", "DEFAULT_BACKGROUND_SLOWDOWN", "FailureClass", "Plan", "PlanInputs", "RamBudget",
    "Strategy", "StrategyPlan", "TierModel", "TierPlan", "checkpoint_bytes", "cluster_mttf", "expected_goodput",
    "expected_job_time", "format_plan", "make_plan", "optimise", "plan_to_dict", "ram_per_host", "scaled",
    "sustained_bandwidth", "young_daly",
]
