"""The tiers config file: a JSON file listing a store's tiers, read and checked in one place.

::

    {"tiers": [
      {"kind": "memory", "path": "/dev/shm/tierfs/job-42", "budget": null, "name": "ram",
       "save": {"every_n_steps": 1}, "keep": {"latest": 2}},
      {"kind": "object", "url": "s3://bucket/job-42", "storage_options": {"endpoint_url": "..."},
       "name": "s3", "save": {"every_n_steps": 100}, "keep": {"latest": 3, "every_n_steps": 1000}}]}

A memory tier takes ``path`` (default: the RAM tier's default directory), ``budget`` (bytes, or null) and
``name`` (default ``"ram"``); an object tier takes ``url`` (required), ``storage_options`` (passed to
fsspec) and ``name`` (default: the URL's protocol). ``save`` and ``keep`` are optional policy specs (see
:mod:`tierfs.policies.spec`); without ``keep`` a memory tier keeps the latest 2 and an object tier
everything. Relative paths are taken from the config file's directory.

:func:`read_config` checks every entry and returns :class:`TierSpec` objects; it builds no tier (the
command line builds them, ``tierfs plan`` only reads the ``save`` specs). Every error is one line naming
the file and the entry, e.g. ``config tiers.json: tiers[1]: an object tier needs "url", ...``.
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

#: the keys each kind of tier takes
KEYS = {
    "memory": frozenset({"kind", "name", "path", "budget", "save", "keep"}),
    "object": frozenset({"kind", "name", "url", "storage_options", "save", "keep"}),
}


@dataclass(frozen=True)
class TierSpec:
    """One checked entry of a tiers config.

    Attributes
    ----------
    where : str
        ``config PATH: tiers[I]``, the start of every message about this entry.
    kind : str
        ``"memory"`` or ``"object"``.
    name : str or None
        The tier's name; None for the tier's default.
    path : Path or None
        A memory tier's directory, absolute (relative ones are taken from the config file's directory);
        None for the default directory or an object tier.
    url : str or None
        An object tier's URL; None for a memory tier.
    budget : int or None
        A memory tier's budget in bytes; None for none.
    storage_options : dict
        An object tier's fsspec options (empty for a memory tier).
    save, keep : policy or None
        The policies the ``save`` and ``keep`` specs give; None where the entry has none.
    save_spec, keep_spec : object
        The specs as written (None where absent), for messages.
    """

    where: str
    kind: str
    name: str | None = None
    path: Path | None = None
    url: str | None = None
    budget: int | None = None
    storage_options: dict[str, Any] = field(default_factory=dict)
    save: SavePolicy | None = None
    keep: PreservationPolicy | None = None
    save_spec: Any = None
    keep_spec: Any = None

    def policies(self) -> dict[str, Any]:
        """The ``save=``/``keep=`` keyword arguments a tier takes, for the policies this entry gives."""
        out: dict[str, Any] = {}
        if self.save is not None:
            out["save"] = self.save
        if self.keep is not None:
            out["keep"] = self.keep
        return out


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


def _entry(entry: Any, where: str, base: Path) -> TierSpec:
    """One entry of ``"tiers"``, checked; relative paths are taken from ``base``."""
    if not isinstance(entry, dict):
        raise FormatError(f"{where} must be an object")
    kind = entry.get("kind")
    if not isinstance(kind, str) or kind not in KEYS:
        raise FormatError(f'{where}: "kind" must be "memory" or "object", got {kind!r}')
    allowed = KEYS[kind]
    unknown = sorted(set(entry) - allowed)
    if unknown:
        raise FormatError(f"{where}: unknown keys {unknown}; a {kind} tier takes {sorted(allowed)}")
    name = entry.get("name")
    if name is not None and not isinstance(name, str):
        raise FormatError(f"{where}: name must be a string")
    if kind == "memory":
        spec = TierSpec(where, kind, name, path=_path(entry.get("path"), where, base),
                        budget=_budget(entry.get("budget"), where))
    else:
        url, options = entry.get("url"), entry.get("storage_options") or {}
        if not isinstance(url, str) or not url:
            raise FormatError(f'{where}: an object tier needs "url", e.g. "s3://bucket/run"')
        if not isinstance(options, dict):
            raise FormatError(f"{where}: storage_options must be an object")
        spec = TierSpec(where, kind, name, url=url, storage_options=dict(options))
    return _with_policies(spec, entry.get("save"), entry.get("keep"))


def _path(value: Any, where: str, base: Path) -> Path | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise FormatError(f"{where}: path must be a string")
    p = Path(value).expanduser()
    return p if p.is_absolute() else base / p


def _budget(value: Any, where: str) -> int | None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
        raise FormatError(f"{where}: budget must be a number of bytes or null")
    return value


def _with_policies(spec: TierSpec, save: Any, keep: Any) -> TierSpec:
    """``spec`` with the policies its ``save`` and ``keep`` specs give."""
    try:
        return replace(spec, save=save_policy(save) if save is not None else None,
                       keep=keep_policy(keep) if keep is not None else None, save_spec=save, keep_spec=keep)
    except ValueError as e:
        raise FormatError(f"{spec.where}: {e}") from None
