"""When a tier saves. Names follow Orbax's ``checkpoint_managers.save_decision_policy``."""

from __future__ import annotations

from dataclasses import dataclass

from .base import SaveContext, SavePolicy


@dataclass(frozen=True)
class FixedIntervalPolicy(SavePolicy):
    """Save every ``interval`` steps (steps divisible by it)."""

    interval: int

    def __post_init__(self) -> None:
        if not isinstance(self.interval, int) or self.interval < 1:
            raise ValueError(f"FixedIntervalPolicy interval must be a positive int, got {self.interval!r}")

    def should_save(self, ctx: SaveContext) -> bool:
        return ctx.step % self.interval == 0
