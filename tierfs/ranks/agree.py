"""Agree or raise across ranks: every rank learns whether every rank got through a step of the work, and
if one did not, every rank raises, naming the rank that failed, the stage it failed in and why.

This is how a failure on one rank reaches the others without anyone waiting: the failure travels as data
in the collective that the healthy ranks were going to do anyway.
"""

from __future__ import annotations

from typing import Any, Callable

from .. import _stages, errors as _errors
from .groups import Group

Classify = Callable[[BaseException], "type[_errors.TierfsError]"]


def outcomes(group: Group, mine: Any = None, failure: BaseException | None = None, *,
             classify: Classify | None = None, what: str = "agreeing with the other ranks") -> list[list[Any]]:
    """Every rank's outcome of a step, in rank order (collective): ``[None, mine, None]`` where the rank got
    through it, ``[kind, reason, stage]`` where it failed with ``failure`` (``kind``: the name of the error
    class ``classify(failure)`` gives, TierfsError by default; ``reason``: ``"Type: message"``; ``stage``:
    where it failed, see :mod:`tierfs._stages`, or None)."""
    if failure is None:
        payload: list[Any] = [None, mine, None]
    else:
        kind = (classify or (lambda e: _errors.TierfsError))(failure)
        payload = [kind.__name__, f"{type(failure).__name__}: {failure}", _stages.of(failure)]
    if group.world_size == 1:
        return [payload]
    with _stages.waiting(what):
        return group.all_gather(payload)


def agree(group: Group, mine: Any = None, failure: BaseException | None = None, what: str = "", *,
          classify: Classify | None = None, outcome: str = "") -> list[Any]:
    """Every rank's ``mine``, in rank order, once every rank reached this point; if any rank failed, raise
    on every rank (collective).

    A rank that failed passes its exception as ``failure`` and raises it again here, after the others
    heard of it; every other rank raises a :class:`~tierfs.errors.TierfsError` (or the class
    ``classify(failure)`` names on the failing rank, e.g. StateMismatchError for a caller's mistake) that
    names ``what``, the ranks that failed, the stage and the reason of the first, then ``outcome`` (e.g.
    "not committed"). The exception's ``failed_ranks`` maps each failed rank to its reason.
    """
    views = outcomes(group, mine, failure, classify=classify, what=what)
    if failure is not None:
        raise failure
    failed = {r: (v[0], v[1], v[2]) for r, v in enumerate(views) if v[0] is not None}
    if failed:
        raise ranks_failed(what, failed, outcome)
    return [v[1] for v in views]


def ranks_failed(what: str, failed: dict[int, tuple[str, str, str | None]], outcome: str = ""
                 ) -> _errors.TierfsError:
    """The error a rank raises when other ranks failed: ``{rank: (kind, reason, stage)}`` as
    :func:`outcomes` gives them; of the class the first failed rank's kind names (a tierfs error class)."""
    first = min(failed)
    kind, why, where = failed[first]
    cls = getattr(_errors, kind, None)
    if not (isinstance(cls, type) and issubclass(cls, _errors.TierfsError)):
        cls = _errors.TierfsError
    more = f" (and rank(s) {sorted(failed)[1:]})" if len(failed) > 1 else ""
    at = f" in {where}" if where else ""
    tail = f"; {outcome}" if outcome else ""
    err = cls(f"{what}: rank {first} failed{at}{more}: {why}{tail}")
    err.failed_ranks = {r: reason for r, (_, reason, _) in failed.items()}  # type: ignore[attr-defined]
    return err


class agreement:
    """``agree`` around a block: ``with agreement(group, "commit step 3") as vote: ...; vote.mine = x``.

    On leaving the block every rank learns whether every rank got through it; a rank whose block raised
    raises it again, the others raise as :func:`agree` does. ``vote.results`` holds every rank's ``mine``.
    """

    def __init__(self, group: Group, what: str, *, outcome: str = "", classify: Classify | None = None) -> None:
        self.group, self.what, self.outcome, self.classify = group, what, outcome, classify
        self.mine: Any = None
        self.results: list[Any] = []

    def __enter__(self) -> "agreement":
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        try:
            self.results = agree(self.group, self.mine, exc, self.what, classify=self.classify,
                                 outcome=self.outcome)
        except BaseException as e:
            if e is exc:
                return  # the block's own exception goes on as it was
            raise
