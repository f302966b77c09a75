"""Policies: when each tier saves, what it keeps, and where restores read from.

Pure functions of step numbers, times and metrics; names follow Orbax where the concept is the same.
"""

from .base import PreservationPolicy, SaveContext, SavePolicy, StepInfo
from .restore import RestorePolicy
from .retention import (AnyPreservationPolicy, BestN, CustomSteps, EveryNSeconds, EveryNSteps, LatestN,
                        PreserveAll)
from .save import (AnySavePolicy, ContinuousCheckpointingPolicy, FixedIntervalPolicy, InitialSavePolicy,
                   PreemptionCheckpointingPolicy, SpecificStepsPolicy)

__all__ = [
    "AnyPreservationPolicy", "AnySavePolicy", "BestN", "ContinuousCheckpointingPolicy", "CustomSteps",
    "EveryNSeconds", "EveryNSteps", "FixedIntervalPolicy", "InitialSavePolicy", "LatestN",
    "PreemptionCheckpointingPolicy", "PreservationPolicy", "PreserveAll", "RestorePolicy", "SaveContext",
    "SavePolicy", "SpecificStepsPolicy", "StepInfo",
]
