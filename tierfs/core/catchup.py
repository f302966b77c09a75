"""Catch-up after a crash: copies that a process did not live to make.

A step is committed in the first tier before its copies to the slower tiers start, in the background. A
process that ends first (killed, preempted, out of memory) leaves the step in RAM only, although a slower
tier's save policy chose it: losing that node later would cost a whole interval of that tier. The marker
names the tiers whose policies took the step, so when a store opens, every committed step of the first tier
that a slower file tier took but lacks is copied there in the background, newest first (every rank agrees
on the list: a copy is collective). The log says so.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from ..errors import TierfsError
from ..policies import StepInfo
from ..ranks.agree import views as rank_views
from .context import Context
from .saving import SavePath

log = logging.getLogger("tierfs")


def missing_copies(ctx: Context) -> list[tuple[int, str]]:
    """``(step, tier)`` pairs of this rank: a step its first tier holds whose marker names ``tier``, a slower
    file tier that does not hold it."""
    first = ctx.first
    out = []
    for s in sorted(ctx.ledger.holding(first.name), reverse=True):
        lacking = [t.name for t in ctx.files[1:] if s not in ctx.ledger.holding(t.name)]
        if not lacking:
            continue
        try:
            marker = first.read_marker(s)
        except (TierfsError, OSError, ValueError) as e:
            log.debug("tier %s step %d: marker unreadable (%s); no catch-up", first.name, s, e)
            continue
        out += [(s, n) for n in lacking if n in (marker.tiers or ())]
    return out


def catch_up(ctx: Context, saving: SavePath) -> list[tuple[int, str]]:
    """Hand on, in the background, the copies a process ended before making (collective: every rank opens
    the store); returns the ``(step, tier)`` pairs handed on."""
    mine: list[Any] = [list(x) for x in missing_copies(ctx)]
    views = rank_views(ctx.group, mine)
    agreed = set.intersection(*({(int(s), str(n)) for s, n in v} for v in views))
    first = ctx.first
    for s, name in sorted(agreed, key=lambda x: (-x[0], ctx.names.index(x[1]))):
        marker = first.read_marker(s)
        log.warning("step %d is committed in tier %s but not on %s, which its policy chose (the process that saved "
                    "it ended first); copying it there now, in the background", s, first.name, name)
        ctx.ledger.catch_up(s, name, StepInfo(s, float(marker.committed or 0.0)),
                              transient=first.name not in (marker.tiers or ()))
        ctx.ledger.pin(first.name, s)
        ctx.work.copies[name].submit(functools.partial(saving.hand_on, s, ctx.tier(name), marker, {}))
    return sorted(agreed, reverse=True)
