"""Named points in tierfs's work where a test can step in: kill the process, raise, or take note.

tierfs calls :func:`at` at each point; tests register functions with ``tierfs.testing.hooks``. With
nothing registered a call costs one dictionary lookup. The points and what they pass are listed in
``tierfs.testing.hooks``.
"""

from __future__ import annotations

from typing import Any, Callable

_registry: dict[str, list[Callable[..., Any]]] = {}


def at(point: str, **info: Any) -> None:
    """Run the functions registered for ``point`` with ``info`` as keyword arguments."""
    fns = _registry.get(point)
    if fns:
        for fn in list(fns):
            fn(**info)


def active(point: str) -> bool:
    """Whether a function is registered for ``point`` (a fast path may then take the slow, hooked one)."""
    return bool(_registry.get(point))
