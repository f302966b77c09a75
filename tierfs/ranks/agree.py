"""Agree or raise across ranks: every rank learns whether every rank got through a step of the work, and
if one did not, every rank raises, naming the rank that failed, the stage it failed in and why.

This is how a failure on one rank reaches the others without anyone waiting: the failure travels as data
in the collective that the healthy ranks were going to do anyway.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Callable, NoReturn, Sequence

from .. import errors as _errors
from ..util import stages as _stages
from .groups import Group

Classify = Callable[[BaseException], "type[_errors.TierfsError]"]


#: at most this many ranks whose view differs from the most common one are sent on their own (the ranks of
#: a lost node or two); more, and every rank's view is gathered
FEW = 64


def views(group: Group, mine: Any, few: int = FEW) -> list[Any]:
    """Every rank's ``mine`` (JSON), in rank order (collective).

    In one all-reduce of two numbers when every rank's is the same (the usual case: the same steps,
    nothing to catch up, nothing shared). When only a few ranks' differ from the most common one (up to
    :data:`FEW`: the ranks of a lost node), those and the common one are sent, after a bitmap of the ranks
    that differ (one bit per rank): five all-reduces, whose bytes grow with the ranks that differ, not
    with the job. Else (more than ``few`` differ) an all-gather. The list holds the same object for every rank of one view (``mine``
    itself when all are the same): read it, do not change it."""
    if group.world_size == 1:
        return [mine]
    data = json.dumps(mine, sort_keys=True).encode()
    h = int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 2
    lo, neg_hi = group.all_reduce([h, -h], "min")
    if lo == -neg_hi:
        return [mine] * group.world_size
    n = group.world_size
    at_lo, at_hi = group.all_reduce([int(h == lo), int(h == -neg_hi)], "sum")
    common = lo if at_lo >= at_hi else -neg_hi
    if n - max(at_lo, at_hi) > few:
        return group.all_gather(mine)
    # which ranks differ (bit r % 62 of word r // 62, set by rank r alone: the sum is the union)
    words = [0] * ((n + 61) // 62)
    if h != common:
        words[group.rank // 62] = 1 << (group.rank % 62)
    words = group.all_reduce(words, "sum")
    odd = [r for r in range(n) if words[r // 62] >> (r % 62) & 1]
    differ = set(odd)
    writers = [next(r for r in range(n) if r not in differ)] + odd  # the common view's first, then theirs
    slot = writers.index(group.rank) if group.rank in writers else -1
    sizes = [0] * len(writers)
    if slot >= 0:
        sizes[slot] = len(data)
    sizes = group.all_reduce(sizes, "sum")
    chunks = [-(-size // 7) for size in sizes]  # 7 bytes per int64: never negative
    packed = [0] * sum(chunks)
    if slot >= 0:
        start = sum(chunks[:slot])
        for i in range(chunks[slot]):
            packed[start + i] = int.from_bytes(data[7 * i:7 * i + 7], "little")
    packed = group.all_reduce(packed, "sum")
    got: list[Any] = []
    start = 0
    for size, c in zip(sizes, chunks):
        raw = b"".join(v.to_bytes(7, "little") for v in packed[start:start + c])[:size]
        got.append(json.loads(raw))
        start += c
    by_rank = dict(zip(odd, got[1:]))
    return [by_rank.get(r, got[0]) for r in range(n)]


def any_rank(group: Group, flag: bool) -> bool:
    """Whether ``flag`` is true on any rank (collective: an all-reduce of one number)."""
    return bool(group.all_reduce([int(bool(flag))], "max")[0]) if group.world_size > 1 else bool(flag)


def outcomes(group: Group, mine: Any = None, failure: BaseException | None = None, *,
             classify: Classify | None = None, what: str = "agreeing with the other ranks") -> list[list[Any]]:
    """Every rank's outcome of a step, in rank order (collective): ``[None, mine, None]`` where the rank got
    through it, ``[kind, reason, stage]`` where it failed with ``failure`` (``kind``: the name of the error
    class ``classify(failure)`` gives, TierfsError by default; ``reason``: ``"Type: message"``; ``stage``:
    where it failed, see :mod:`tierfs.util.stages`, or None)."""
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


def check(group: Group, failure: BaseException | None = None, what: str = "", *,
          classify: Classify | None = None, outcome: str = "", mins: Sequence[int] = (),
          maxes: Sequence[int] = (), sums: Sequence[int] = ()) -> tuple[list[int], list[int]]:
    """Whether every rank got through a step; if any did not, raise on every rank (collective), as
    :func:`agree` does, but in the same few bytes per rank whatever the job's size: one all-reduce of the
    lowest and highest failed rank (and of ``mins`` and ``maxes``, reduced element by element with it), and
    only when a rank failed, a broadcast of that rank's reason. Returns the reduced ``mins`` and ``maxes``.

    ``sums`` (a list, the same length on every rank, a rank that fails included; without ``mins`` and
    ``maxes``) are summed over the ranks in place, in the one all-reduce that counts the failed ranks: the
    lowest and highest of them are found in a second one only when there are some. The error names the
    lowest rank that failed (and the highest, when more did)."""
    n, me = group.world_size, group.rank
    if n == 1:
        if failure is not None:
            raise failure
        return list(mins), list(maxes)
    failed = failure is not None
    if sums:
        if mins or maxes:
            raise ValueError("check: sums are reduced without mins or maxes")
        with _stages.waiting(what or "agreeing with the other ranks"):
            total = group.all_reduce([int(failed), *sums], "sum")
        if total[0]:
            _raise_failed(group, failure, what, classify, outcome)
        sums[:] = total[1:]  # type: ignore[index]
        return [], []
    return check_started(group, failure, what, classify=classify, outcome=outcome, mins=mins, maxes=maxes)()


def check_started(group: Group, failure: BaseException | None = None, what: str = "", *,
                  classify: Classify | None = None, outcome: str = "", mins: Sequence[int] = (),
                  maxes: Sequence[int] = ()) -> Callable[[], tuple[list[int], list[int]]]:
    """:func:`check` of ``mins`` and ``maxes`` with its all-reduce started now: calling what it returns
    (once, on this thread) waits for it and returns the reduced ``mins`` and ``maxes``, or raises as
    :func:`check` does. The thread is free meanwhile (the bytes move on the backend's threads)."""
    n, me = group.world_size, group.rank
    failed = failure is not None
    vec = [me if failed else n, -(me if failed else -1), *mins, *(-int(v) for v in maxes)]
    with _stages.waiting(what or "agreeing with the other ranks"):
        started = group.all_reduce_started(vec, "min")

    def result() -> tuple[list[int], list[int]]:
        with _stages.waiting(what or "agreeing with the other ranks"):
            out = started()
        if out[0] < n:
            _raise_failed(group, failure, what, classify, outcome, (out[0], -out[1]))
        k = len(mins)
        return out[2:2 + k], [-v for v in out[2 + k:]]
    return result


def _raise_failed(group: Group, failure: BaseException | None, what: str, classify: Classify | None,
                  outcome: str, span: tuple[int, int] | None = None) -> NoReturn:
    """Raise on every rank once some rank failed (collective): the lowest failed rank's reason is told to
    every rank. ``span``: the lowest and highest failed rank, when the caller's all-reduce found them."""
    n, me = group.world_size, group.rank
    with _stages.waiting(what or "agreeing with the other ranks"):
        if span is None:
            out = group.all_reduce([me if failure is not None else n, -(me if failure is not None else -1)], "min")
            span = (out[0], -out[1])
        first, last = span
        info = group.broadcast(_payload(failure, classify) if me == first else None, first)
    if failure is not None:
        raise failure
    raise ranks_failed(what, {first: (info[0], info[1], info[2])}, outcome, last=last)


def _payload(failure: BaseException | None, classify: Classify | None) -> list[Any]:
    """``[kind, reason, stage]`` of a rank's failure, as other ranks name it."""
    assert failure is not None
    kind = (classify or (lambda e: _errors.TierfsError))(failure)
    return [kind.__name__, f"{type(failure).__name__}: {failure}", _stages.of(failure)]


def ranks_failed(what: str, failed: dict[int, tuple[str, str, str | None]], outcome: str = "",
                 last: int | None = None) -> _errors.TierfsError:
    """The error a rank raises when other ranks failed: ``{rank: (kind, reason, stage)}`` as
    :func:`outcomes` gives them; of the class the first failed rank's kind names (a tierfs error class).
    ``last``: the highest rank that failed, where only the first's reason is known (:func:`check`)."""
    first = min(failed)
    kind, why, where = failed[first]
    cls = getattr(_errors, kind, None)
    if not (isinstance(cls, type) and issubclass(cls, _errors.TierfsError)):
        cls = _errors.TierfsError
    more = f" (and rank(s) {sorted(failed)[1:]})" if len(failed) > 1 else ""
    if last is not None and last > max(failed):
        more = f" (and other ranks, up to rank {last})"
    at = f" in {where}" if where else ""
    tail = f"; {outcome}" if outcome else ""
    err = cls(f"{what}: rank {first} failed{at}{more}: {why}{tail}")
    err.failed_ranks = {r: reason for r, (_, reason, _) in failed.items()}  # type: ignore[attr-defined]
    return err


class agreement:
    """:func:`check` around a block: ``with agreement(group, "commit step 3") as vote: ...``.

    On leaving the block every rank learns whether every rank got through it; a rank whose block raised
    raises it again, the others raise as :func:`check` does. The block may set ``vote.mins`` and
    ``vote.maxes`` (integers, the same length on every rank): reduced over the ranks in the same
    all-reduce, in ``vote.min`` and ``vote.max`` (set them before anything in the block can fail: a rank
    that fails takes part with what they are then); or, instead of those, ``vote.sums`` (set alike, as
    long on every rank), summed in the same all-reduce and given back once every rank got through.
    With ``gather=True`` it is :func:`agree` instead, and ``vote.results`` holds every rank's
    ``vote.mine`` (bytes per rank that grow with the job: only where every rank's value is needed).
    """

    def __init__(self, group: Group, what: str, *, outcome: str = "", classify: Classify | None = None,
                 gather: bool = False) -> None:
        self.group, self.what, self.outcome, self.classify, self.gather = group, what, outcome, classify, gather
        self.mine: Any = None
        self.results: list[Any] = []
        self.mins: Sequence[int] = ()
        self.maxes: Sequence[int] = ()
        self.sums: list[int] = []
        self.min: list[int] = []
        self.max: list[int] = []

    def __enter__(self) -> "agreement":
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        try:
            if self.gather:
                self.results = agree(self.group, self.mine, exc, self.what, classify=self.classify,
                                     outcome=self.outcome)
            else:
                self.min, self.max = check(self.group, exc, self.what, classify=self.classify,
                                           outcome=self.outcome, mins=self.mins, maxes=self.maxes,
                                           sums=self.sums)
        except BaseException as e:
            if e is exc:
                return  # the block's own exception goes on as it was
            raise
