"""Where a restore reads from. Default: the newest step, from the fastest tier with a verified copy."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ..util.args import names, optional_step
from ..errors import ArgumentError


@dataclass(frozen=True)
class RestorePolicy:
    """Which tiers a restore may use, in which order, and which step.

    Parameters
    ----------
    prefer:
        Tier names to try first, in this order; the others follow in the store's order (fastest first).
    forbid:
        Tier names never to read from (e.g. ``["s3"]`` to keep egress at zero).
    step:
        A given step instead of the newest.
    """

    prefer: tuple[str, ...] = ()
    forbid: tuple[str, ...] = ()
    step: int | None = None

    def __init__(self, prefer: Sequence[str] = (), forbid: Sequence[str] = (), step: int | None = None) -> None:
        object.__setattr__(self, "prefer", tuple(names(prefer, "RestorePolicy prefer") or ()))
        object.__setattr__(self, "forbid", tuple(names(forbid, "RestorePolicy forbid") or ()))
        object.__setattr__(self, "step", optional_step(step, "RestorePolicy step"))

    def order(self, tiers: Sequence[str]) -> list[str]:
        """The tier names to try, in order."""
        unknown = (set(self.prefer) | set(self.forbid)) - set(tiers)
        if unknown:
            raise ArgumentError(f"RestorePolicy names unknown tiers {sorted(unknown)}; tiers are {list(tiers)}")
        first = [t for t in self.prefer if t not in self.forbid]
        return first + [t for t in tiers if t not in first and t not in self.forbid]
