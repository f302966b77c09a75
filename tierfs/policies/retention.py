"""What a tier keeps. Names follow Orbax's ``checkpoint_managers.preservation_policy``.

Each policy returns the set of steps to keep out of a tier's committed steps; the store deletes the rest,
except the only copy of the newest step and steps still being copied to another tier.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

from ..util.args import instance, number, shown, step_numbers
from ..errors import ArgumentError
from .base import PreservationPolicy, StepInfo


@dataclass(frozen=True)
class LatestN(PreservationPolicy):
    """Keep the ``n`` newest steps."""

    n: int

    def __post_init__(self) -> None:
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise ArgumentError(f"LatestN needs n >= 1 (an int), got {shown(self.n)}")

    uses_info = False  # the steps' numbers alone

    def keep(self, steps: Sequence[StepInfo]) -> set[int]:
        return set(sorted(s.step for s in steps)[-self.n:])


@dataclass(frozen=True)
class EveryNSteps(PreservationPolicy):
    """Keep steps divisible by ``n`` (e.g. every 1000th step, for the long run)."""

    n: int

    def __post_init__(self) -> None:
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise ArgumentError(f"EveryNSteps needs n >= 1 (an int), got {shown(self.n)}")

    uses_info = False  # the steps' numbers alone

    def keep(self, steps: Sequence[StepInfo]) -> set[int]:
        return {s.step for s in steps if s.step % self.n == 0}


@dataclass(frozen=True)
class EveryNSeconds(PreservationPolicy):
    """Keep one step per ``interval_secs`` of wall time: the first saved at least that long after the last
    kept one."""

    interval_secs: float

    def __post_init__(self) -> None:
        number(self.interval_secs, "EveryNSeconds interval_secs")

    def keep(self, steps: Sequence[StepInfo]) -> set[int]:
        kept: set[int] = set()
        last: float | None = None
        for s in sorted(steps, key=lambda i: i.step):
            if last is None or s.time - last >= self.interval_secs:
                kept.add(s.step)
                last = s.time
        return kept


@dataclass(frozen=True)
class BestN(PreservationPolicy):
    """Keep the ``n`` best steps by ``metric_fn(metrics)``; ``mode`` is ``"min"`` or ``"max"``.

    Steps without the metric (``metric_fn`` raises KeyError or returns None) are not kept by this policy.
    """

    metric_fn: Callable[[dict[str, Any]], float]
    n: int
    mode: str = "min"

    def __post_init__(self) -> None:
        if self.mode not in ("min", "max"):
            raise ArgumentError(f"BestN mode must be 'min' or 'max', got {shown(self.mode)}")
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise ArgumentError(f"BestN needs n >= 1 (an int), got {shown(self.n)}")
        if not callable(self.metric_fn):
            raise ArgumentError(f"BestN metric_fn must be a function of the metrics, e.g. lambda m: m['loss'], "
                                f"got {shown(self.metric_fn)}")

    def score(self, info: StepInfo) -> float | None:
        try:
            v = self.metric_fn(info.metrics)
        except (KeyError, TypeError):
            return None
        return None if v is None else float(v)

    def keep(self, steps: Sequence[StepInfo]) -> set[int]:
        scored = [(v, s.step) for s in steps if (v := self.score(s)) is not None]
        scored.sort(key=lambda vs: (vs[0] if self.mode == "min" else -vs[0], -vs[1]))
        return {step for _, step in scored[: self.n]}


@dataclass(frozen=True)
class CustomSteps(PreservationPolicy):
    """Keep exactly the given steps (when present)."""

    steps: frozenset[int]

    def __init__(self, steps: Iterable[int]) -> None:
        object.__setattr__(self, "steps", frozenset(step_numbers(steps, "CustomSteps steps")))

    uses_info = False  # the steps' numbers alone

    def keep(self, steps: Sequence[StepInfo]) -> set[int]:
        return {s.step for s in steps if s.step in self.steps}


@dataclass(frozen=True)
class PreserveAll(PreservationPolicy):
    """Keep every step."""

    uses_info = False  # the steps' numbers alone

    def keep(self, steps: Sequence[StepInfo]) -> set[int]:
        return {s.step for s in steps}


@dataclass(frozen=True)
class AnyPreservationPolicy(PreservationPolicy):
    """Keep a step when any of the policies keeps it."""

    policies: tuple[PreservationPolicy, ...]

    def __init__(self, policies: Sequence[PreservationPolicy]) -> None:
        if not policies:
            raise ArgumentError("AnyPreservationPolicy needs at least one policy")
        for i, p in enumerate(policies):
            instance(p, f"AnyPreservationPolicy policies[{i}]", PreservationPolicy, "a keep policy such as LatestN(2)")
        object.__setattr__(self, "policies", tuple(policies))

    def keep(self, steps: Sequence[StepInfo]) -> set[int]:
        return set().union(*(p.keep(steps) for p in self.policies))

    @property
    def uses_info(self) -> bool:
        return any(p.uses_info for p in self.policies)
