"""Policies: when each tier saves and what it keeps. Pure functions of steps, times and metrics."""

from .base import PreservationPolicy, SaveContext, SavePolicy, StepInfo
from .retention import LatestN, PreserveAll
from .save import FixedIntervalPolicy

__all__ = [
    "FixedIntervalPolicy", "LatestN", "PreserveAll", "PreservationPolicy", "SaveContext", "SavePolicy",
    "StepInfo",
]
