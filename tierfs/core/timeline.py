"""The timeline rule: which committed steps a save supersedes.

A job's steps form one timeline. A job that goes back (restores an older step after a loss spike, starts
from scratch over the directories of an earlier run, saves a step lower than the newest) leaves the steps
it does not continue from on a timeline it abandoned. One rule, applied by every save on every tier (every
adapter saves through the store, so it holds for all of them):

- Saving step ``s`` supersedes every step above ``s`` that a tier of some rank holds or is still saving.
- When the job restored step ``r`` below ``s`` and some step above ``s`` exists, the steps between ``r``
  and ``s`` are superseded too: they belong to the run the restore went back from.
- Superseded steps are removed from every tier on every rank (newest first, each marker first) before
  ``s`` is written: a restore never offers them again, and no keep policy keeps them in place of ``s``.
- ``s`` itself, when a tier already holds it, is replaced if it is above the step the job restored (the job
  is redoing it); otherwise the save is refused (:class:`~tierfs.errors.StepExistsError`) unless the caller
  passes ``overwrite=True``, and nothing is removed.
- A save that no tier's save policy takes changes nothing.

Pure functions of step numbers: the save path gathers each rank's :func:`view` in the agreement that
precedes every save, and every rank derives the same :func:`superseded` steps from the views.
"""

from __future__ import annotations

from typing import Iterable, Sequence


def view(known: Iterable[int], step: int, restored: int | None) -> list[list[int]]:
    """This rank's part of the rule: of the steps it ``known``s (committed on some tier, or being saved),
    those above ``step``, and those between the ``restored`` step and ``step``."""
    known = set(known)
    above = sorted(x for x in known if x > step)
    between = sorted(x for x in known if restored is not None and restored < x < step)
    return [above, between]


def superseded(views: Sequence[Sequence[Sequence[int]]], step: int, restored: int | None) -> list[int]:
    """The steps saving ``step`` removes, newest first, from every rank's :func:`view` (the same on every
    rank)."""
    above: set[int] = set().union(*(v[0] for v in views))
    if not above:
        return []
    if restored is not None and restored < step:
        above |= set().union(*(v[1] for v in views))
    return sorted(above, reverse=True)


def replaces(step: int, restored: int | None) -> bool:
    """Whether saving ``step``, already committed, replaces it without ``overwrite=True``: it is above the
    step the job restored, so the job is redoing it."""
    return restored is not None and step > restored
