"""Tier kinds, registered once: the name a tiers config file gives a kind, its class, the keys a config
entry of that kind takes and how the entry builds the tier, and which command-line TARGETs name one.

Each tier module registers its own kind; the config file (:mod:`tierfs.config`), the command line and the
store find kinds here, never by a tier's class. A new kind of tier is one module that subclasses
:class:`~tierfs.tiers.base.Tier` and calls :func:`register`, and a ``tierfs.testing.TierTests`` subclass::

    register(Kind("disk", DiskTier, keys={"path"}, build=lambda entry, common: DiskTier(entry["path"], **common),
                  about='"path": a directory'))
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from ..errors import FormatError
from .base import AnyTier

#: keys every config entry may have, whatever its kind (the policies and the tier's name)
COMMON_KEYS = frozenset({"kind", "name", "save", "keep"})


@dataclass(frozen=True)
class Entry:
    """One entry of a tiers config file as a kind's ``build`` gets it: ``values`` (the kind's own keys, as
    written), ``where`` (``config PATH: tiers[I]``, for messages) and ``base`` (the config file's
    directory: relative paths are taken from it)."""

    values: Mapping[str, Any]
    where: str
    base: Path

    def path(self, key: str) -> Path | None:
        """The value of ``key`` as a local path (None when absent), relative to the config's directory."""
        value = self.values.get(key)
        if value is None:
            return None
        if not isinstance(value, str):
            raise FormatError(f"{self.where}: {key} must be a string")
        p = Path(value).expanduser()
        return p if p.is_absolute() else self.base / p


@dataclass(frozen=True)
class Kind:
    """A kind of tier.

    Attributes
    ----------
    name : str
        As a config entry's ``"kind"`` names it (``"memory"``, ``"object"``).
    cls : type
        The tier class.
    keys : frozenset of str
        The config keys of its own, besides ``kind``, ``name``, ``save`` and ``keep``.
    build : callable
        ``build(entry, common) -> tier``: a tier (not opened) from a checked :class:`Entry` and the common
        keyword arguments (``name``, ``save``, ``keep``, where the entry gives them); raises FormatError
        naming ``entry.where`` for a bad value.
    about : str
        Its keys for people, e.g. ``'"path" (a directory on tmpfs), "budget" (bytes)'``.
    target : callable or None
        ``target(text, storage_options) -> tier or None``: the tier a command-line TARGET names, when it
        is one of this kind (None: none is).
    """

    name: str
    cls: type
    keys: frozenset[str]
    build: Callable[[Entry, dict[str, Any]], AnyTier]
    about: str = ""
    target: Callable[[str, Mapping[str, Any]], AnyTier | None] | None = field(default=None)


_KINDS: dict[str, Kind] = {}


def register(kind: Kind) -> Kind:
    """Make ``kind`` known to config files and the command line (a kind registered again replaces the
    first: a module reloaded)."""
    _KINDS[kind.name] = kind
    return kind


def kinds() -> list[Kind]:
    """Every registered kind, in the order registered."""
    return list(_KINDS.values())


def kind(name: Any, where: str) -> Kind:
    """The kind named ``name``; a FormatError naming ``where`` and the kinds there are, when none is."""
    if not isinstance(name, str) or name not in _KINDS:
        known = ", ".join(f'"{k}"' for k in _KINDS)
        raise FormatError(f'{where}: "kind" must be one of {known}, got {name!r}')
    return _KINDS[name]


def from_target(text: str, storage_options: Mapping[str, Any]) -> AnyTier | None:
    """The tier a command-line TARGET names (the first kind that takes it), or None."""
    for k in _KINDS.values():
        if k.target is not None:
            tier = k.target(text, storage_options)
            if tier is not None:
                return tier
    return None
