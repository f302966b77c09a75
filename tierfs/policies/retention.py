"""What a tier keeps. Names follow Orbax's ``checkpoint_managers.preservation_policy``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .base import PreservationPolicy, StepInfo


@dataclass(frozen=True)
class LatestN(PreservationPolicy):
    """Keep the ``n`` newest steps."""

    n: int

    def __post_init__(self) -> None:
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"LatestN needs n >= 1, got {self.n!r}")

    def keep(self, steps: Sequence[StepInfo]) -> set[int]:
        return set(sorted(s.step for s in steps)[-self.n:])


@dataclass(frozen=True)
class PreserveAll(PreservationPolicy):
    """Keep every step."""

    def keep(self, steps: Sequence[StepInfo]) -> set[int]:
        return {s.step for s in steps}
