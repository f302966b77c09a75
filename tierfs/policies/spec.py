"""Policies from small JSON specs, as a tiers config file writes them.

Keep (what a tier keeps)::

    {"latest": 3}                          LatestN(3)
    {"every_n_steps": 1000}                EveryNSteps(1000)
    {"every_n_seconds": 3600}              EveryNSeconds(3600)
    {"best": {"metric": "loss", "n": 3, "mode": "min"}}   BestN on metrics["loss"]
    {"steps": [100, 200]}                  CustomSteps
    "all" or {"all": true}                 PreserveAll

Save (when a tier takes a step)::

    {"every_n_steps": 10}                  FixedIntervalPolicy(10)
    {"every_n_seconds": 600}               ContinuousCheckpointingPolicy(600)
    {"steps": [1, 5, 9]}                   SpecificStepsPolicy
    {"initial": true}                      InitialSavePolicy
    {"preemption": true}                   PreemptionCheckpointingPolicy

Several keys in one object mean any of them (``{"latest": 2, "every_n_steps": 1000}`` keeps the two
newest steps and every 1000th). Unknown keys and wrong types are errors (one line, an
:class:`~tierfs.errors.ArgumentError`, which is a ValueError).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, TypeVar

from ..errors import ArgumentError
from .base import PreservationPolicy, SavePolicy
from .retention import AnyPreservationPolicy, BestN, CustomSteps, EveryNSeconds, EveryNSteps, LatestN, PreserveAll
from .save import (AnySavePolicy, ContinuousCheckpointingPolicy, FixedIntervalPolicy, InitialSavePolicy,
                   PreemptionCheckpointingPolicy, SpecificStepsPolicy)

T = TypeVar("T")
P = TypeVar("P", PreservationPolicy, SavePolicy)


def _int(v: Any, what: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ArgumentError(f"{what} must be a positive integer, got {v!r}")
    return v


def _num(v: Any, what: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
        raise ArgumentError(f"{what} must be a positive number, got {v!r}")
    return float(v)


def _steps(v: Any, what: str) -> list[int]:
    if not isinstance(v, list) or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in v):
        raise ArgumentError(f"{what} must be a list of step numbers, got {v!r}")
    return v


def _true(v: Any, what: str) -> None:
    if v is not True:
        raise ArgumentError(f"{what} takes true, got {v!r}")


def _flag(what: str, make: Callable[[], T]) -> Callable[[Any], T]:
    """A spec key that takes only ``true`` and makes a policy without arguments."""
    def build(v: Any) -> T:
        _true(v, what)
        return make()
    return build


def _metric(name: str) -> Callable[[dict[str, Any]], Any]:
    def get(metrics: dict[str, Any]) -> Any:
        return metrics[name]
    get.__name__ = f"metric_{name}"
    return get


def _best(v: Any) -> PreservationPolicy:
    if not isinstance(v, dict) or set(v) - {"metric", "n", "mode"} or "metric" not in v or "n" not in v:
        raise ArgumentError(f'keep "best" takes {{"metric": NAME, "n": N, "mode": "min"|"max"}}, got {v!r}')
    if not isinstance(v["metric"], str) or not v["metric"]:
        raise ArgumentError('keep "best": "metric" must be the name of a metric, e.g. "loss"')
    return BestN(_metric(v["metric"]), _int(v["n"], 'keep "best" n'), v.get("mode", "min"))


_KEEP: dict[str, Callable[[Any], PreservationPolicy]] = {
    "latest": lambda v: LatestN(_int(v, 'keep "latest"')),
    "every_n_steps": lambda v: EveryNSteps(_int(v, 'keep "every_n_steps"')),
    "every_n_seconds": lambda v: EveryNSeconds(_num(v, 'keep "every_n_seconds"')),
    "best": _best,
    "steps": lambda v: CustomSteps(_steps(v, 'keep "steps"')),
    "all": _flag('keep "all"', PreserveAll),
}

_SAVE: dict[str, Callable[[Any], SavePolicy]] = {
    "every_n_steps": lambda v: FixedIntervalPolicy(_int(v, 'save "every_n_steps"')),
    "every_n_seconds": lambda v: ContinuousCheckpointingPolicy(_num(v, 'save "every_n_seconds"')),
    "steps": lambda v: SpecificStepsPolicy(_steps(v, 'save "steps"')),
    "initial": _flag('save "initial"', InitialSavePolicy),
    "preemption": _flag('save "preemption"', PreemptionCheckpointingPolicy),
}


def keep_policy(spec: Any) -> PreservationPolicy:
    """A :class:`PreservationPolicy` from a keep spec (see the module docstring)."""
    if spec == "all":
        return PreserveAll()
    return _combined(spec, _KEEP, "keep", '{"latest": 3} or "all"', AnyPreservationPolicy)


def save_policy(spec: Any) -> SavePolicy:
    """A :class:`SavePolicy` from a save spec (see the module docstring)."""
    return _combined(spec, _SAVE, "save", '{"every_n_steps": 10}', AnySavePolicy)


def _combined(spec: Any, table: Mapping[str, Callable[[Any], P]], kind: str, example: str,
              any_of: Callable[[list[P]], P]) -> P:
    """One policy per key of ``spec``, built by ``table``; several are combined with ``any_of``."""
    if not isinstance(spec, dict) or not spec:
        raise ArgumentError(f"a {kind} spec is an object such as {example}, got {spec!r}")
    unknown = sorted(set(spec) - set(table))
    if unknown:
        raise ArgumentError(f"unknown {kind} keys {unknown}; use {sorted(table)}")
    policies = [table[k](v) for k, v in spec.items()]
    return policies[0] if len(policies) == 1 else any_of(policies)
