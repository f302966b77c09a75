"""The object tier's keys: where each file of a step is (:mod:`tierfs.format.keys`), which layout each step
has, learnt from its marker's format version, and the folders a step may have files in.

A save writes the spread layout (the current version). A step's layout is known once its marker was read
(by the tier, or by a caller that tells the tier, :meth:`~tierfs.tiers.base.Tier.note_marker`) or once
this process wrote it; until then (a step cut short, or one whose marker retention already deleted) a file
is looked for where this version puts it, then where version 2 did.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable

from ..format import Marker, SPREAD_VERSION, parse_step_dirname, rank_of_file, step_dirname, validate_filename
from ..format.keys import SPREAD_DIR, is_bucket, key

#: steps whose layout a tier remembers (the newest learnt)
REMEMBERED = 256


class StepKeys:
    """Paths under an object tier's ``root``."""

    def __init__(self, root: str) -> None:
        self.root = root
        self._spread: OrderedDict[int, bool] = OrderedDict()

    # -- folders ------------------------------------------------------------------------------------
    def step_dir(self, step: int) -> str:
        """``<root>/step_…``: the marker's folder, and every file's in layouts before version 3."""
        return f"{self.root}/{step_dirname(step)}"

    @property
    def buckets_dir(self) -> str:
        return f"{self.root}/{SPREAD_DIR}"

    def bucket_dir(self, bucket: str, step: int) -> str:
        return f"{self.buckets_dir}/{bucket}/{step_dirname(step)}"

    def all_dirs(self, step: int, buckets: list[str]) -> list[str]:
        """Every folder ``step`` may have files in, given the buckets the tier has."""
        return [self.step_dir(step), *(self.bucket_dir(b, step) for b in buckets)]

    # -- layouts ------------------------------------------------------------------------------------
    def learn(self, step: int, spread: bool | None) -> None:
        """Remember whether ``step`` keeps its ranks' files in buckets (None: forget)."""
        self._spread.pop(step, None)
        if spread is not None:
            self._spread[step] = spread
            while len(self._spread) > REMEMBERED:
                self._spread.popitem(last=False)

    def learn_marker(self, step: int, marker: Marker) -> None:
        if marker.step == step:
            self.learn(step, marker.version >= SPREAD_VERSION)

    def learn_marker_bytes(self, step: int, data: Any) -> None:
        """Learn from a marker's bytes as read; a damaged one teaches nothing (its reader says why)."""
        try:
            self.learn_marker(step, Marker.from_bytes(bytes(data)))
        except Exception:  # noqa: BLE001 - FormatError and any other: the caller's check reports it
            pass

    # -- files --------------------------------------------------------------------------------------
    def written(self, step: int, name: str) -> str:
        """Where a save puts file ``name`` of ``step`` (the spread layout)."""
        return f"{self.root}/{key(step, validate_filename(name))}"

    def places(self, step: int, name: str) -> list[str]:
        """Where file ``name`` of ``step`` may be, the likeliest first: one place when the step's layout is
        known or the file is no rank's (the marker), else the spread layout's, then version 2's."""
        flat = f"{self.step_dir(step)}/{validate_filename(name)}"
        spread = self._spread.get(step)
        if spread is False or rank_of_file(name) is None:
            return [flat]
        return [self.written(step, name)] if spread else [self.written(step, name), flat]


def buckets(entries: list[dict[str, Any]]) -> list[str]:
    """The buckets among a listing of the buckets' folder."""
    names = (e["name"].rstrip("/").rsplit("/", 1)[-1] for e in entries if e.get("type") == "directory")
    return sorted(n for n in names if is_bucket(n))


def has_buckets(entries: list[dict[str, Any]]) -> bool:
    """Whether a listing of the tier's root holds the buckets' folder."""
    return any(e.get("type") == "directory" and e["name"].rstrip("/").rsplit("/", 1)[-1] == SPREAD_DIR
               for e in entries)


def first_found(paths: list[str], fn: Callable[[str], Any]) -> Any:
    """``fn(path)`` for the first of ``paths`` that exists (FileNotFoundError from the last otherwise)."""
    for path in paths[:-1]:
        try:
            return fn(path)
        except FileNotFoundError:
            continue
    return fn(paths[-1])


def step_dirs(entries: list[dict[str, Any]]) -> list[int]:
    """The steps whose folders a listing holds."""
    return sorted({s for s in (parse_step_dirname(e["name"].rstrip("/").rsplit("/", 1)[-1])
                               for e in entries if e.get("type") == "directory") if s is not None})
