"""Stages: the named steps of tierfs's work on a rank, for error messages and test hooks.

Each step of a save or a restore runs inside ``with stage("marker", step=7):``. On entry the test hook
point ``stage`` is called (so a fault test can fail a given stage on a given rank, see
``tierfs.testing.hooks``); an exception leaving the block is labelled with the stage (the first label
wins), so that when ranks agree on a failure every rank can say where it happened; and a wait that times
out names the stage its thread is in. Work that waits on other ranks outside any stage (a peer transfer, a
restore between its stages) names itself with ``operation("fetch of step 7 on peer")``: its waits say that
unless a stage is current.

The stages: ``open``, ``staging``, ``checksum``, ``manifest``, ``marker``, ``copy`` (to a slower tier),
``replication``, ``planning`` (of a restore), ``read`` (a shard from a tier), ``fetch`` (a holder's copy
of another rank's shard, sent on), ``receive`` (this rank's shard, from a peer), ``localize``, ``reseed``,
``retention``.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

from . import hooks as _hooks

STAGES = ("open", "staging", "checksum", "manifest", "marker", "copy", "replication", "planning", "read",
          "fetch", "receive", "localize", "reseed", "retention")

_local = threading.local()


def describe(name: str, step: int | None = None, tier: str | None = None) -> str:
    """``"marker of step 7 on ram"``."""
    out = name
    if step is not None:
        out += f" of step {step}"
    if tier is not None:
        out += f" on {tier}"
    return out


@contextlib.contextmanager
def stage(name: str, step: int | None = None, tier: str | None = None) -> Iterator[None]:
    """Run the block as stage ``name`` (of ``step``, on ``tier``) of this thread's work."""
    label = describe(name, step, tier)
    before = getattr(_local, "label", None)
    _local.label = label
    try:
        _hooks.at("stage", stage=name, step=step, tier=tier)
        yield
    except BaseException as e:
        if getattr(e, "tierfs_stage", None) is None:
            try:
                e.tierfs_stage = label  # type: ignore[attr-defined]
            except AttributeError:  # an exception that takes no attributes: unlabelled
                pass
        raise
    finally:
        _local.label = before


@contextlib.contextmanager
def waiting(label: str) -> Iterator[None]:
    """Name what this thread waits for while the block runs (no hook: the ranks agreeing on ``label``)."""
    before = getattr(_local, "label", None)  # a stage's (an operation's label gives way to ``label``)
    _local.label = label if before is None else f"{before}: {label}"
    try:
        yield
    finally:
        _local.label = before


@contextlib.contextmanager
def operation(label: str) -> Iterator[None]:
    """Name the block's waits on other ranks ``label`` (e.g. ``"restore step 7"``) where no stage is current
    (no hook, no label on exceptions: the stages inside say where work failed)."""
    before = getattr(_local, "default", None)
    _local.default = label
    try:
        yield
    finally:
        _local.default = before


def current() -> str | None:
    """The stage this thread is in, described; else the operation it runs (None: neither)."""
    label = getattr(_local, "label", None)
    return label if label is not None else getattr(_local, "default", None)


def of(e: BaseException) -> str | None:
    """The stage an exception left, described (None: not raised inside a stage)."""
    label = getattr(e, "tierfs_stage", None)
    return label if isinstance(label, str) else None
