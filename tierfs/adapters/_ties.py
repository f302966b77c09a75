"""Tied weights in an export: one tensor saved under two names (an output embedding tied to the input one)
written once, as ``save_pretrained`` writes it, after checking that the two hold the same bytes."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from ..errors import ArgumentError
from ..store import TieredStore
from ..util import args as _args
from . import _steptensors as steptensors


def check_ties(tie: Any, what: str = "tie") -> dict[str, str]:
    """``{left out: kept}`` from a mapping or ``["A=B", ...]`` (the command line's ``--tie``), checked."""
    if tie is None:
        return {}
    pairs = [t.split("=", 1) if isinstance(t, str) and "=" in t else t for t in tie] \
        if not isinstance(tie, Mapping) else list(tie.items())
    out: dict[str, str] = {}
    for pair in pairs:
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2 and all(isinstance(x, str) and x for x in pair)):
            raise ArgumentError(f"{what} must name tied weights as {{'lm_head.weight': 'model.embed_tokens.weight'}}"
                                f" (--tie lm_head.weight=model.embed_tokens.weight), got {_args.shown(tie)}")
        a, b = pair
        if a == b or a in out or b in out or out.get(b) or a in out.values():
            raise ArgumentError(f"{what} {a}={b}: each tied weight is left out once, in favour of a weight "
                                "that is written")
        out[a] = b
    return out


def left_out(store: TieredStore, step: int, names: Sequence[str] | None, wanted: list[steptensors.Tensor],
          rename: Mapping[str, str], ties: Mapping[str, str]) -> set[str]:
    """The saved names of the tensors ``ties`` leaves out, each checked to hold its kept tensor's bytes."""
    by_out = {rename[t.name]: t for t in wanted}
    dropped = set()
    for a, b in ties.items():
        missing = [n for n in (a, b) if n not in by_out]
        if missing:
            some = ", ".join(repr(n) for n in list(by_out)[:5])
            raise ArgumentError(f"tie {a}={b}: step {step} has no tensor {missing[0]!r} (names as written, after "
                                f"the prefix; they include {some})")
        ta, tb = by_out[a], by_out[b]
        got = steptensors.read(store, step, names, [ta, tb])
        x, y = got[ta.name], got[tb.name]
        if x.dtype != y.dtype or x.shape != y.shape or \
                not torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)):
            raise ArgumentError(f"tie {a}={b}: the two differ in step {step} ({x.dtype} {tuple(x.shape)} against "
                                f"{y.dtype} {tuple(y.shape)}); tied weights hold the same bytes")
        dropped.add(ta.name)
    return dropped
