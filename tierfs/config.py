"""The tiers config file: a JSON file listing a store's tiers, read and checked in one place.

::

    {"tiers": [
      {"kind": "memory", "path": "/dev/shm/tierfs/job-42", "budget": null, "name": "ram",
       "save": {"every_n_steps": 1}, "keep": {"latest": 2}},
      {"kind": "object", "url": "s3://bucket/job-42", "storage_options": {"endpoint_url": "..."},
       "name": "s3", "save": {"every_n_steps": 100}, "keep": {"latest": 3, "every_n_steps": 1000}}]}

``"kind"`` is a registered tier kind (:mod:`tierfs.tiers.registry`; built in: ``memory``, ``object`` and
``peer``, see :mod:`tierfs.tiers.kinds` for their keys), which says what other keys the entry takes and
how it builds the tier. Every entry may also have ``name``, and ``save`` and ``keep`` policy specs (see
:mod:`tierfs.policies.spec`); without ``keep`` a tier keeps its default (a memory tier the latest 2, an
object tier everything). Relative paths are taken from the config file's directory.

:func:`read_config` checks every entry and returns :class:`TierSpec` objects without building a tier
(``tierfs plan`` only reads the ``save`` specs); :func:`tiers_from_config` builds them. Every error is one
line naming the file and the entry, e.g. ``config tiers.json: tiers[1]: an object tier needs "url", ...``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from .errors import FormatError
from .format import read_json
from .policies import PreservationPolicy, SavePolicy
from .policies.spec import keep_policy, save_policy
from .tiers import registry
from .tiers.base import AnyTier


@dataclass(frozen=True)
class TierSpec:
    """One checked entry of a tiers config.

    Attributes
    ----------
    where : str
        ``config PATH: tiers[I]``, the start of every message about this entry.
    kind : str
        The tier kind's name (``"memory"``, ``"object"``, ``"peer"``, or a registered one).
    name : str or None
        The tier's name; None for the tier's default.
    entry : tierfs.tiers.registry.Entry
        The kind's own keys as written, for its ``build``.
    save, keep : policy or None
        The policies the ``save`` and ``keep`` specs give; None where the entry has none.
    save_spec, keep_spec : object
        The specs as written (None where absent), for messages.
    """

    where: str
    kind: str
    name: str | None = None
    entry: registry.Entry = field(default_factory=lambda: registry.Entry({}, "", Path(".")))
    save: SavePolicy | None = None
    keep: PreservationPolicy | None = None
    save_spec: Any = None
    keep_spec: Any = None

    def common(self) -> dict[str, Any]:
        """The keyword arguments every tier takes (``name``, ``save=``, ``keep=``) that this entry gives."""
        out: dict[str, Any] = {}
        if self.name is not None:
            out["name"] = self.name
        if self.save is not None:
            out["save"] = self.save
        if self.keep is not None:
            out["keep"] = self.keep
        return out

    def build(self) -> AnyTier:
        """The tier (not opened)."""
        return registry.kind(self.kind, self.where).build(self.entry, self.common())


def read_config(path: str | os.PathLike[str]) -> list[TierSpec]:
    """Read and check a tiers config file.

    Parameters
    ----------
    path : str or path-like
        The JSON file; messages name it as given.

    Returns
    -------
    list of TierSpec
        One per entry of ``"tiers"``, in order (at least one).

    Raises
    ------
    FormatError
        The file is missing or not JSON, or an entry is malformed (one line naming the entry).
    """
    cfg = read_json(path, f"config {path}", missing=f"config file {path} does not exist")
    entries = cfg.get("tiers") if isinstance(cfg, dict) else None
    if not isinstance(entries, list) or not entries:
        raise FormatError(f'config {path}: expected {{"tiers": [{{"kind": "memory", ...}}, ...]}} '
                          "with at least one tier")
    base = Path(path).parent
    return [_entry(entry, f"config {path}: tiers[{i}]", base) for i, entry in enumerate(entries)]


def tiers_from_config(path: str | os.PathLike[str]) -> list[AnyTier]:
    """The tiers a config file describes, built (not opened), in its order.

    Raises
    ------
    FormatError
        The config is malformed, or two tiers have the same name.
    ArgumentError
        A value a tier refuses (an object URL with a typo), naming the entry.
    """
    tiers = [spec.build() for spec in read_config(path)]
    names = [t.name for t in tiers]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise FormatError(f"config {path}: tier names must be unique, {dup} repeats; set \"name\"")
    return tiers


def _entry(entry: Any, where: str, base: Path) -> TierSpec:
    """One entry of ``"tiers"``, checked; relative paths are taken from ``base``."""
    if not isinstance(entry, dict):
        raise FormatError(f"{where} must be an object")
    kind = registry.kind(entry.get("kind"), where)
    allowed = registry.COMMON_KEYS | kind.keys
    unknown = sorted(set(entry) - allowed)
    if unknown:
        raise FormatError(f"{where}: unknown keys {unknown}; a {kind.name} tier takes {sorted(allowed)}")
    name = entry.get("name")
    if name is not None and not isinstance(name, str):
        raise FormatError(f"{where}: name must be a string")
    own = registry.Entry({k: v for k, v in entry.items() if k in kind.keys}, where, base)
    return _with_policies(TierSpec(where, kind.name, name, own), entry.get("save"), entry.get("keep"))


def _with_policies(spec: TierSpec, save: Any, keep: Any) -> TierSpec:
    """``spec`` with the policies its ``save`` and ``keep`` specs give."""
    try:
        return replace(spec, save=save_policy(save) if save is not None else None,
                       keep=keep_policy(keep) if keep is not None else None, save_spec=save, keep_spec=keep)
    except ValueError as e:
        raise FormatError(f"{spec.where}: {e}") from None
