"""Test hooks: run a function of yours at named points of tierfs's work (to kill a process mid-transfer,
inject a failure on one rank, or count what happened) without patching tierfs's internals.

    from tierfs.testing import hooks

    with hooks.on("transfer", lambda step, tier, nbytes: os.kill(os.getpid(), 9) if step == 2 else None):
        store.save(2, state)

Points (keyword arguments passed):

``block`` (``name``, ``nbytes``)
    Before each block of an entry is copied or checked (staging a save, verifying, restoring).
``stage`` (``stage``, ``step``, ``tier``)
    A stage of a save or a restore starts on this rank (see :mod:`tierfs.util.stages` for the stages:
    ``staging``, ``checksum``, ``manifest``, ``marker``, ``copy``, ``replication``, ``planning``,
    ``read``, ``fetch``, ``receive``, ``localize``, ``reseed``, ``retention``, ``open``). A hook that raises fails that
    stage on this rank, as a real failure there would: fault tests use it to check that every rank hears
    of it, naming the rank and the stage, and that the store stays usable.
``copy`` (``step``, ``nbytes``, ``later``)
    On tierfs's copy thread, before each chunk of a save's copies that run there (tensors on a GPU, and
    an overlapped save's); ``later``: the chunk may still be copying when ``save`` returns. A hook that
    waits holds those copies back (a test of what waits for them).
``pin`` (``nbytes``)
    Before a RAM tier buffer is page-locked for copies from a GPU. A hook that raises makes the
    registration fail, as a low locked-memory limit would: tierfs warns once and copies unpinned.
``spare`` (``nbytes``)
    In the background, before a RAM tier makes a spare buffer of ``nbytes`` for the next save (a save
    staging meanwhile counts them as free; the buffer is kept only if the tier is still within its budget
    once it is made). A hook that waits holds it back.
``rename`` (``path``)
    A local file (a manifest, a marker, a file on a ``file://`` tier) is written whole under its temporary
    name and is about to be renamed to ``path``.
``transfer`` (``step``, ``tier``, ``nbytes``)
    Before each message or batch of a background copy moves: an upload to a slower tier or a replication
    to peers, on the rank that sends.

Hooks are per process and meant for tests; a hook that raises fails the work it interrupted, as a real
failure at that point would.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

from ..util.hooks import _registry

POINTS = ("block", "copy", "pin", "rename", "spare", "stage", "transfer")


@contextlib.contextmanager
def on(point: str, fn: Callable[..., Any]) -> Iterator[None]:
    """Call ``fn(**info)`` at ``point`` while the block runs (or until :func:`clear`, see :func:`add`)."""
    add(point, fn)
    try:
        yield
    finally:
        remove(point, fn)


def add(point: str, fn: Callable[..., Any]) -> None:
    """Call ``fn(**info)`` at ``point`` from now on."""
    if point not in POINTS:
        raise ValueError(f"unknown hook point {point!r}; points are {list(POINTS)}")
    _registry.setdefault(point, []).append(fn)


def remove(point: str, fn: Callable[..., Any]) -> None:
    """Stop calling ``fn`` at ``point``."""
    fns = _registry.get(point, [])
    if fn in fns:
        fns.remove(fn)


def clear() -> None:
    """Remove every hook."""
    _registry.clear()
