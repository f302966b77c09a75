"""The agreement before a save: what each rank puts in, and what the reduced numbers decide."""

from __future__ import annotations

import secrets
from typing import Callable, Sequence, TypeVar

from ..errors import ArgumentError
from ..ranks import Group, check_started
from ..tiers.base import AnyTier

T = TypeVar("T")


class Vote:
    """This rank's part of the agreement before a save, as integers reduced over the ranks in one all-reduce
    (:func:`~tierfs.ranks.check`): rank 0's choice of tiers (``mins``: 1 chosen, 0 not; other ranks 2), the
    tiers holding the step already on any rank and whether any rank knows steps the save may supersede
    (``maxes``), whether any rank's state has a leaf, the step (in both: ranks saving different steps raise),
    and rank 0's id of the save (the last of ``mins``). ``view`` is this rank's :func:`.timeline.view`."""

    def __init__(self, names: list[str], chosen: list[str], holders: list[str], view: list[list[int]],
                 rank: int, leaves: int = 0, step: int = 0) -> None:
        self.view = view
        # the id of the save (in its marker and every manifest): rank 0's, the others' the largest number
        nonce = secrets.randbits(62) if rank == 0 else (1 << 63) - 1
        self.mins = [int(n in chosen) if rank == 0 else 2 for n in names] + [step, nonce]
        self.maxes = [int(n in holders) for n in names] + [step, int(leaves > 0), len(view[0]), len(view[1])]

    @staticmethod
    def decided(tiers: Sequence[AnyTier], mins: list[int], maxes: list[int], step: int, world_size: int
                ) -> tuple[list[AnyTier], list[str], str]:
        """What the reduced vote decided, the same on every rank: the tiers rank 0 chose, the names of the
        tiers holding the step on some rank, and the save's id. ArgumentError on every rank when the ranks
        save different steps or every rank's state is empty."""
        n = len(tiers)
        if mins[n] != maxes[n]:  # their calls are out of step (e.g. threads calling in other orders)
            raise ArgumentError(f"the ranks save different steps at once (from {mins[n]} to {maxes[n]}): every rank "
                                "calls save with the same step, in the same order; nothing saved")
        if not maxes[n + 1]:  # (a rank that holds nothing of a job's state may save {})
            raise ArgumentError(f"step {step}: the state is empty{' on every rank' if world_size > 1 else ''}, "
                                "nothing to save; give the arrays and values to save")
        chosen = [t for t, flag in zip(tiers, mins) if flag == 1]
        return chosen, [t.name for t, flag in zip(tiers, maxes) if flag], f"{mins[-1]:016x}"

    @staticmethod
    def supersedes(maxes: list[int]) -> bool:
        """Whether the save may supersede steps: some rank knows a step above it (the steps between a
        restored step and this one go only along with those, :func:`.timeline.superseded`)."""
        return maxes[-2] > 0

    def usual(self, n: int, chosen: bool) -> bool:
        """Whether this rank foresees the usual save: its own policies take the step (``chosen``; rank 0's
        decide), none of its ``n`` tiers holds the step, and it knows no step above it."""
        return chosen and not any(self.maxes[:n]) and not self.maxes[n + 2]


def cast(group: Group, vote: Vote, what: str, ahead: Callable[[], T], undo: Callable[[T | BaseException], None]
         ) -> tuple[list[int], list[int], T | BaseException]:
    """The agreement on ``vote`` (:func:`~tierfs.ranks.check`, "nothing saved" if a rank failed), its
    all-reduce started before ``ahead`` runs on this thread and waited for after: the usual save stages
    while the ranks agree. Returns the reduced ``mins`` and ``maxes``, and what ``ahead`` returned or the
    exception it raised. If the agreement raises, that goes to ``undo`` first."""
    ballot = check_started(group, None, what, outcome="nothing saved", mins=vote.mins, maxes=vote.maxes)
    try:
        done: T | BaseException = ahead()
    except BaseException as e:  # noqa: BLE001 - the caller's, once every rank heard the vote
        done = e
    try:
        mins, maxes = ballot()
    except BaseException:
        undo(done)
        raise
    return mins, maxes, done
