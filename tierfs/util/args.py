"""Checks of the arguments tierfs's public functions take, each failure one :class:`ArgumentError` line.

Every message names the argument as the caller wrote it (``step``, ``tiers=``, ``--step``) and says
what is expected, then what was given: ``step must be a whole number from 0 to 999999999999, got '7'
(a str)``. Public entry points call these first, before anything is read, written or waited for.
Imports nothing of tierfs but its errors, so policies stay pure (fsspec only inside the URL checks).
"""

from __future__ import annotations

import datetime
import difflib
import json
import math
import operator
import os
import re
from typing import Any, Iterable, Mapping, Sequence

from ..errors import ArgumentError, TierUnavailableError, URLArgumentError
from ..state import Trusted

#: the largest step number: a step directory is ``step_`` and 12 digits
MAX_STEP = 10**12 - 1
#: seconds the work pending at exit may take, when neither the object's ``exit_timeout`` nor the
#: environment variable :data:`EXIT_TIMEOUT_ENV` says otherwise
DEFAULT_EXIT_TIMEOUT = 600.0
#: the environment variable giving the default ``exit_timeout`` in seconds (``0``: finish nothing at exit)
EXIT_TIMEOUT_ENV = "TIERFS_EXIT_TIMEOUT"


def shown(value: Any, limit: int = 60) -> str:
    """``value`` as a message shows it: its repr (cut at ``limit`` characters) and, unless that says it,
    its type: ``'7' (a str)``, ``1.0 (a float)``, ``None``."""
    text = repr(value)
    if len(text) > limit:
        text = text[:limit - 3] + "..."
    if value is None or type(value) is int:
        return text
    kind = type(value).__name__
    return f"{text} ({'an' if kind[:1] in 'aeiou' else 'a'} {kind})"


def step(value: Any, what: str = "step") -> int:
    """A step number: an int (numpy and torch integers too, not a bool) from 0 to :data:`MAX_STEP`.

    Parameters
    ----------
    value : Any
        What the caller gave.
    what : str
        The argument's name in the caller's terms (``"step"``, ``"--step"``, ``"checkpoint_id"``).

    Returns
    -------
    int
        The step.

    Raises
    ------
    ArgumentError
        ``value`` is not such a number.
    """
    expected = f"a whole number from 0 to {MAX_STEP}"
    if value is None:
        raise ArgumentError(f"{what} is required: {expected}, got None")
    try:
        n = operator.index(value) if not isinstance(value, bool) else None
    except TypeError:
        n = None
    if n is None:
        raise ArgumentError(f"{what} must be {expected}, got {shown(value)}")
    if not 0 <= n <= MAX_STEP:
        raise ArgumentError(f"{what} must be {expected}, got {n}")
    return int(n)


def optional_step(value: Any, what: str = "step") -> int | None:
    """None, or a step as :func:`step` checks it."""
    return None if value is None else step(value, what)


def step_numbers(values: Any, what: str) -> list[int]:
    """Several step numbers (a list, set, range, ...), each as :func:`step` checks it."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise ArgumentError(f"{what} must be a list of step numbers, got {shown(values)}")
    out = []
    for v in values:
        try:
            out.append(step(v, what))
        except ArgumentError:
            raise ArgumentError(f"{what} must be step numbers (whole numbers from 0 to {MAX_STEP}), got "
                                f"{shown(v)}") from None
    return out


def integer(value: Any, what: str, minimum: int = 1) -> int:
    """An int (not a bool) of at least ``minimum``."""
    try:
        n = operator.index(value) if not isinstance(value, bool) else None
    except TypeError:
        n = None
    if n is None or n < minimum:
        raise ArgumentError(f"{what} must be an int >= {minimum}, got {shown(value)}")
    return int(n)


def optional_integer(value: Any, what: str, minimum: int = 1) -> int | None:
    """None, or an int as :func:`integer` checks it."""
    return None if value is None else integer(value, what, minimum)


def number(value: Any, what: str, *, positive: bool = True) -> float:
    """A finite real number (not a bool), > 0 (``positive``) or >= 0."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok and hasattr(value, "__float__") and not isinstance(value, (bool, str, bytes)):
        try:  # numpy scalars
            value = float(value)
            ok = math.isfinite(value)
        except (TypeError, ValueError):
            ok = False
    if not ok or (value <= 0 if positive else value < 0):
        raise ArgumentError(f"{what} must be a number {'> 0' if positive else '>= 0'}, got {shown(value)}")
    return float(value)


def flag(value: Any, what: str) -> bool:
    """True or False (numpy's bools too); anything else is refused, so ``"false"`` never means True."""
    if type(value).__name__ in ("bool", "bool_"):
        return bool(value)
    raise ArgumentError(f"{what} must be True or False, got {shown(value)}")


def choice(value: Any, what: str, choices: Sequence[str]) -> str:
    """One of ``choices``."""
    if not isinstance(value, str) or value not in choices:
        options = " or ".join(repr(c) for c in choices)
        raise ArgumentError(f"{what} must be {options}, got {shown(value)}")
    return value


def mapping(value: Any, what: str) -> Mapping[Any, Any]:
    """A mapping (dict-like)."""
    if not isinstance(value, Mapping):
        raise ArgumentError(f"{what} must be a mapping of names to values (a dict), got {shown(value)}")
    return value


def jsonable(value: Any, what: str) -> dict[str, Any]:
    """None or a mapping of str to JSON values (``metadata``, ``metrics``), as a new dict (a
    :class:`~tierfs.state.Trusted` one as it is, unchecked)."""
    if value is None:
        return {}
    if type(value) is Trusted and isinstance(value.value, dict):
        return value.value
    out = dict(mapping(value, what))
    bad = [k for k in out if not isinstance(k, str)]
    if bad:
        raise ArgumentError(f"{what} keys must be strings, got {shown(bad[0])}")
    try:
        json.dumps(out, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ArgumentError(f"{what} must be JSON-serialisable ({e}); convert values to numbers or "
                            "strings") from None
    return out


def names(value: Any, what: str, known: Iterable[str] | None = None) -> list[str] | None:
    """None, or a list of names (``tiers=["ram"]``), each one of ``known`` when given."""
    if value is None:
        return None
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        hint = f", e.g. [{value!r}]" if isinstance(value, str) else ""
        raise ArgumentError(f"{what} must be a list of tier names{hint}, got {shown(value)}")
    out = list(value)
    bad = [n for n in out if not isinstance(n, str)]
    if bad:
        raise ArgumentError(f"{what} must hold tier names (strings), got {shown(bad[0])}")
    if known is not None:
        known = list(known)
        unknown = [n for n in out if n not in known]
        if unknown:
            raise ArgumentError(f"{what}: no tier named {', '.join(repr(n) for n in unknown)}; the tiers are "
                                f"{known}")
    return out


def name(value: Any, what: str) -> str:
    """A non-empty label without control characters (a tier's name)."""
    if not isinstance(value, str) or not value or any(ord(c) < 32 for c in value):
        raise ArgumentError(f"{what} must be a non-empty string without control characters, got {shown(value)}")
    return value


def instance(value: Any, what: str, cls: type | tuple[type, ...], expected: str) -> Any:
    """``value`` when it is an instance of ``cls``; else an error saying ``expected``."""
    if not isinstance(value, cls):
        raise ArgumentError(f"{what} must be {expected}, got {shown(value)}")
    return value


# -- object-store URLs ------------------------------------------------------------------------------
#: protocols whose path starts with a bucket (or container)
BUCKET_PROTOCOLS = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oss", "tos", "tosfs"})
#: local protocols: their path is a directory on this machine
LOCAL_PROTOCOLS = frozenset({"file", "local"})
#: the install extra that brings a protocol's package
EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs"}
_COMMON = ("s3", "gs", "az", "file", "memory", "http")
#: ``s3:/x``, ``s3:x``, ``s3//x``: a protocol name, then a separator that is not ``://``
_MANGLED = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)(:/*|/{2,})(.*)$", re.S)
_EXAMPLE = "a URL such as 's3://bucket/run'"


def _protocols() -> list[str]:
    import fsspec  # lazily: policies import this module and stay free of I/O libraries

    return sorted(set(fsspec.available_protocols()))


def url_protocol(name: str, what: str, value: str) -> str:
    """``name``, when fsspec has a filesystem for it whose package is installed.

    Raises
    ------
    URLArgumentError
        fsspec knows no such protocol (the message names near matches and common protocols).
    TierUnavailableError
        The protocol's package is not installed (the message says what to install).
    """
    import fsspec

    known = _protocols()
    if name not in known:
        low = name.lower()
        near = [low] if low in known else difflib.get_close_matches(low, known, n=2, cutoff=0.5)
        hint = f"did you mean {' or '.join(repr(n) for n in near)}? " if near else ""
        raise URLArgumentError(f"{what} {value!r}: unknown protocol {name!r}; {hint}protocols fsspec knows include "
                               f"{', '.join(_COMMON)} (fsspec.available_protocols() lists all {len(known)})")
    try:
        fsspec.get_filesystem_class(name)
    except ImportError as e:
        extra = EXTRAS.get(name)
        how = f"pip install 'tierfs[{extra}]'" if extra else str(e).strip() or f"install fsspec's {name} package"
        raise TierUnavailableError(f"{what} {value!r}: the {name}:// protocol needs a package that is not "
                                   f"installed: {how}") from None
    return name


def mangled(text: str) -> str | None:
    """The URL ``text`` probably meant (``s3:/b/x``, ``s3:b/x``, ``s3//b/x`` -> ``s3://b/x``), or None."""
    m = _MANGLED.match(text)
    if m is None or m.group(1).lower() not in _protocols():
        return None
    return f"{m.group(1).lower()}://{m.group(3).lstrip('/')}"


def object_url(value: Any, what: str, *, relative: bool = False) -> str:
    """An object tier's URL (or a local directory given as a URL or a path), checked for typos.

    Accepted: ``proto://...`` with a protocol fsspec knows (its package installed; a bucket after
    ``://`` for object stores), chained URLs (``simplecache::s3://...``), ``file://`` URLs and absolute
    paths; relative paths only with ``relative``. Refused, before anything is created: a protocol
    written with a wrong separator (``s3:/b/x``, ``s3:b/x``, ``s3//b/x``, also after ``file://``), an
    unknown protocol (``s4://``), a URL without a bucket (``s3:///``), an empty string and, unless
    ``relative``, a relative path (``bucket/run``), which would otherwise become a directory below the
    current one.

    Parameters
    ----------
    value : Any
        What the caller gave.
    what : str
        The argument's name in the caller's terms (``"ObjectTier url"``, ``"TARGET"``).
    relative : bool
        Whether a relative local path is accepted (a command line's directory argument).

    Returns
    -------
    str
        ``value``, unchanged.

    Raises
    ------
    URLArgumentError
        ``value`` is not such a URL or path (one line naming it, with the URL it probably meant).
    TierUnavailableError
        The protocol's package is not installed.
    """
    if not isinstance(value, str) or not value.strip():
        raise URLArgumentError(f"{what} must be {_EXAMPLE} (or file:///abs/dir, or an absolute path), got "
                               f"{shown(value)}")
    if value != value.strip() or any(ord(c) < 32 for c in value):
        raise URLArgumentError(f"{what} {value!r} has spaces around it or control characters in it; give "
                               f"{_EXAMPLE}")
    *outer, url = value.split("::")
    for part in outer:  # a chain: protocol names (with options in the URL, if any) before the target
        url_protocol(part.split("://", 1)[0], what, value)
    if "://" in url:
        name, rest = url.split("://", 1)
        meant = mangled(name)
        if meant is not None:  # s3:/b://x and the like
            raise URLArgumentError(f"{what} {value!r} is not a URL: did you mean {meant + '://' + rest!r}?")
        url_protocol(name, what, value)
        if name in BUCKET_PROTOCOLS and (not rest.strip("/") or rest.startswith("/")):
            raise URLArgumentError(f"{what} {value!r} names no bucket: write {name}://BUCKET/PREFIX, e.g. "
                                   f"'{name}://bucket/run'")
        if name in LOCAL_PROTOCOLS and not rest.startswith("/"):
            meant = mangled(rest)
            if meant is not None:
                raise URLArgumentError(f"{what} {value!r} is a local path that looks like a URL: did you mean "
                                       f"{meant!r}?")
        return value
    meant = mangled(url)
    if meant is not None and not url.startswith("/"):
        raise URLArgumentError(f"{what} {value!r} is not a URL: did you mean {meant!r}?")
    if url.startswith("/") or relative:
        return value
    where = url[2:] if url.startswith("./") else url
    raise URLArgumentError(
        f"{what} {value!r} is neither a URL nor an absolute path: write the store's URL, e.g. "
        f"'s3://{where.lstrip('~/')}', or a local directory as an absolute path or file:// URL, e.g. "
        f"'file://{os.path.abspath(os.path.expanduser(url))}'")


# -- exit_timeout (tierfs.util.exitwork) ---------------------------------------------------------------------
def exit_seconds(value: Any, what: str = "exit_timeout") -> float:
    """An ``exit_timeout`` in seconds, checked.

    Parameters
    ----------
    value : float, datetime.timedelta, str or None
        Seconds (``>= 0``; ``0``: finish nothing at exit), a ``timedelta``, a number as a string (fsspec's
        configuration), or None (or ``""``/``"none"``): ``TIERFS_EXIT_TIMEOUT`` from the environment,
        else :data:`DEFAULT_EXIT_TIMEOUT`.
    what : str
        How messages name the option.

    Returns
    -------
    float
        The bound in seconds.

    Raises
    ------
    ArgumentError
        ``value`` (or the environment variable) is not a finite number of seconds ``>= 0``.
    """
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "none")):
        env = os.environ.get(EXIT_TIMEOUT_ENV, "").strip()
        if not env:
            return DEFAULT_EXIT_TIMEOUT
        value, what = env, f"{EXIT_TIMEOUT_ENV} (environment)"
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise ArgumentError(f"{what} must be seconds >= 0 (0: finish nothing at exit), got {value!r}") from None
    if isinstance(value, datetime.timedelta):
        value = value.total_seconds()
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
        raise ArgumentError(f"{what} must be seconds >= 0 or a timedelta (0: finish nothing at exit), got "
                            f"{shown(value)}")
    return float(value)


def shown_seconds(t: float) -> str:
    """``t`` seconds for messages: ``"2 s"``, ``"0.5 s"``."""
    return f"{t:g} s"
