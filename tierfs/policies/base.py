"""The two tiny interfaces every policy implements. Policies are pure: no I/O, no clocks of their own."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Sequence


@dataclass(frozen=True)
class StepInfo:
    """What a policy may know of a step: its number, when it was saved, and its metrics."""

    step: int
    time: float = 0.0
    metrics: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)


@dataclass(frozen=True)
class SaveContext:
    """What a save policy may know when asked about ``step``."""

    step: int
    time: float
    previous: tuple[StepInfo, ...] = ()  # steps this tier saved before, oldest first
    preempted: bool = False

    @property
    def last(self) -> StepInfo | None:
        return self.previous[-1] if self.previous else None


class SavePolicy(ABC):
    """Decides whether a tier takes a step."""

    @abstractmethod
    def should_save(self, ctx: SaveContext) -> bool: ...


class PreservationPolicy(ABC):
    """Decides which of a tier's committed steps to keep; the rest may be deleted."""

    @abstractmethod
    def keep(self, steps: Sequence[StepInfo]) -> set[int]: ...

    @property
    def uses_info(self) -> bool:
        """Whether :meth:`keep` reads the steps' times or metrics, not their numbers alone. The store then
        reads those of steps it did not save itself (an earlier run's) from their markers and manifests
        before it applies the policy. True unless a policy says otherwise."""
        return True
