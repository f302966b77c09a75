"""A TARGET on the command line into tiers: a tier directory, an fsspec URL or a tiers config file.

Storage options for a URL come from ``--storage-options JSON`` and ``-o KEY=VALUE``; a config file carries
its own (:mod:`tierfs.config`). Nothing here opens a tier: the commands decide how (``ls`` and ``verify``
only check that it can be read).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from ..util import args as _args
from ..tiers.rootdir import check_local_url
from .. import config
from ..errors import TierUnavailableError
from ..tiers import registry
from ..tiers.base import Tier
from . import UsageError


def is_url(target: str) -> bool:
    """Whether ``target`` is an fsspec URL (``s3://...``, ``file://...``) rather than a local path."""
    return "://" in target


def is_config(target: str) -> bool:
    """Whether ``target`` names a tiers config file (``*.json``, not a URL)."""
    return not is_url(target) and target.lower().endswith(".json")


def _parse_option_value(v: str) -> Any:
    """``-o k=v`` values are strings, except true/false/null and JSON objects/arrays.

    Numbers stay strings on purpose (an access key of digits must not become an int); pass typed
    values with ``--storage-options '{...}'``.
    """
    low = v.strip().lower()
    if low in ("true", "false", "null", "none"):
        return {"true": True, "false": False}.get(low)
    if v.strip()[:1] in ("{", "["):
        try:
            return json.loads(v)
        except ValueError as e:
            raise UsageError(f"-o value {v!r} looks like JSON but does not parse ({e})") from None
    return v


def storage_options_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """Storage options from ``args.storage_options`` (a JSON object) and ``args.option`` (``KEY=VALUE``s).

    Parameters
    ----------
    args : argparse.Namespace
        With ``storage_options`` (str or None) and ``option`` (list of str or None); ``-o`` wins.

    Returns
    -------
    dict
        The options, for fsspec.

    Raises
    ------
    UsageError
        Malformed JSON or a ``-o`` without ``=``.
    """
    opts: dict[str, Any] = {}
    if args.storage_options:
        try:
            opts = json.loads(args.storage_options)
        except ValueError as e:
            raise UsageError(f"--storage-options is not valid JSON ({e})") from None
        if not isinstance(opts, dict):
            raise UsageError("--storage-options must be a JSON object, e.g. '{\"endpoint_url\": \"http://...\"}'")
    for item in args.option or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise UsageError(f"-o expects key=value, got {item!r}")
        opts[key.strip()] = _parse_option_value(value)
    return opts


def tiers_from_config(path: str | Path) -> list[Tier]:
    """The tiers of a config file (:mod:`tierfs.config`) that hold files, not opened: what the commands work
    on (a peer tier in the file keeps copies only while its job runs; the commands leave it out)."""
    return [t for t in config.tiers_from_config(path) if isinstance(t, Tier)]


def tiers_from_target(target: str, storage_options: dict[str, Any]) -> list[Tier]:
    """A URL -> an ObjectTier; a ``*.json`` file -> the tiers it describes; a directory -> a MemoryTier.

    Parameters
    ----------
    target : str
        The TARGET argument.
    storage_options : dict
        fsspec options; only a URL target takes them.

    Returns
    -------
    list of Tier
        Not opened.

    Raises
    ------
    UsageError
        Storage options given for a target that is not a URL.
    ArgumentError
        A URL with a typo (``s3:/bucket``), an unknown protocol or no bucket.
    TierUnavailableError
        The target does not exist or is neither a directory, a URL nor a config.
    """
    _args.object_url(target, "TARGET", relative=True)  # s3:/bucket is a typo, not a directory
    if is_url(target):
        check_local_url(target, "TARGET")
    if not is_url(target) and storage_options:
        raise UsageError("--storage-options/-o only apply to a URL target (put them in the config file "
                         "for config targets)")
    p = Path(target).expanduser()
    if not is_url(target) and p.is_file():
        if p.suffix.lower() != ".json":
            raise TierUnavailableError(f"{target} is a file but not a *.json tier config; give a tier "
                                       "directory, an fsspec URL or a config file")
        return tiers_from_config(p)
    tier = registry.from_target(target, storage_options)  # a tier directory, an fsspec URL
    if isinstance(tier, Tier):
        return [tier]
    if p.suffix.lower() == ".json":
        raise TierUnavailableError(f"config file {target} does not exist")
    raise TierUnavailableError(f"{target}: no such directory (expected a tier directory, an fsspec URL "
                               "such as s3://bucket/run, or a *.json config)")


def select(tiers: list[Tier], name: str | None) -> list[Tier]:
    """The tier named ``name`` (all of them for None); a UsageError naming the choices if there is none."""
    if name is None:
        return tiers
    chosen = [t for t in tiers if t.name == name]
    if not chosen:
        raise UsageError(f"no tier named {name!r}; this target has {[t.name for t in tiers]}")
    return chosen


def describe(tier: Tier) -> str:
    """``NAME (KIND, LOCATION)``, how the commands name a tier."""
    return f"{tier.name} ({tier.kind}, {tier.location})"


def close_all(tiers: list[Tier]) -> None:
    """Close every tier once (a list may name one tier twice)."""
    for t in {id(t): t for t in tiers}.values():
        t.close()


def add_target_args(p: argparse.ArgumentParser, optional: bool = False) -> None:
    """TARGET (``optional``: it may be left out), its storage options and ``--tier``."""
    p.add_argument("target", metavar="TARGET", nargs="?" if optional else None,
                   help="a tier directory (e.g. /dev/shm/tierfs/JOB), an fsspec URL (s3://bucket/run, "
                        "gs://..., file:///...) or a *.json config listing tiers")
    p.add_argument("--storage-options", metavar="JSON",
                   help="fsspec storage options for a URL target, as a JSON object")
    p.add_argument("-o", dest="option", action="append", metavar="KEY=VALUE",
                   help="one storage option for a URL target, e.g. -o endpoint_url=http://host:9000 "
                        "(repeatable; values are strings except true/false/null and JSON objects)")
    p.add_argument("--tier", metavar="NAME", help="only the tier of this name (default: every tier)")
