"""When a tier saves. Names follow Orbax's ``checkpoint_managers.save_decision_policy``.

Each policy answers ``should_save(ctx)`` from the step, the store's clock and the steps this tier saved
before; none does I/O or reads a clock of its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from ..util.args import instance, number, shown, step_numbers
from ..errors import ArgumentError
from .base import SaveContext, SavePolicy


@dataclass(frozen=True)
class FixedIntervalPolicy(SavePolicy):
    """Save every ``interval`` steps (steps divisible by it)."""

    interval: int

    def __post_init__(self) -> None:
        if isinstance(self.interval, bool) or not isinstance(self.interval, int) or self.interval < 1:
            raise ArgumentError(f"FixedIntervalPolicy interval must be a positive int, got {shown(self.interval)}")

    def should_save(self, ctx: SaveContext) -> bool:
        return ctx.step % self.interval == 0


@dataclass(frozen=True)
class SpecificStepsPolicy(SavePolicy):
    """Save exactly the given steps."""

    steps: frozenset[int]

    def __init__(self, steps: Iterable[int]) -> None:
        object.__setattr__(self, "steps", frozenset(step_numbers(steps, "SpecificStepsPolicy steps")))

    def should_save(self, ctx: SaveContext) -> bool:
        return ctx.step in self.steps


@dataclass(frozen=True)
class ContinuousCheckpointingPolicy(SavePolicy):
    """Save whenever at least ``minimum_interval_secs`` have passed since this tier's last save."""

    minimum_interval_secs: float = 0.0

    def __post_init__(self) -> None:
        number(self.minimum_interval_secs, "ContinuousCheckpointingPolicy minimum_interval_secs", positive=False)

    def should_save(self, ctx: SaveContext) -> bool:
        last = ctx.last
        return last is None or ctx.time - last.time >= self.minimum_interval_secs


@dataclass(frozen=True)
class PreemptionCheckpointingPolicy(SavePolicy):
    """Save when the job has been told it will be preempted (SIGTERM, see the manager)."""

    def should_save(self, ctx: SaveContext) -> bool:
        return ctx.preempted


@dataclass(frozen=True)
class InitialSavePolicy(SavePolicy):
    """Save the first step this tier sees, so a job always has a checkpoint to come back to."""

    def should_save(self, ctx: SaveContext) -> bool:
        return not ctx.previous


@dataclass(frozen=True)
class AnySavePolicy(SavePolicy):
    """Save when any of the policies says so."""

    policies: tuple[SavePolicy, ...]

    def __init__(self, policies: Sequence[SavePolicy]) -> None:
        if not policies:
            raise ArgumentError("AnySavePolicy needs at least one policy")
        for i, p in enumerate(policies):
            instance(p, f"AnySavePolicy policies[{i}]", SavePolicy, "a save policy such as FixedIntervalPolicy(10)")
        object.__setattr__(self, "policies", tuple(policies))

    def should_save(self, ctx: SaveContext) -> bool:
        return any(p.should_save(ctx) for p in self.policies)
