"""Checks of the arguments tierfs's public functions take, each failure one :class:`ArgumentError` line.

Every message names the argument as the caller wrote it (``step``, ``tiers=``, ``--step``) and says
what is expected, then what was given: ``step must be a whole number from 0 to 999999999999, got '7'
(a str)``. Public entry points call these first, before anything is read, written or waited for.
Imports nothing of tierfs but its errors, so policies stay pure.
"""

from __future__ import annotations

import json
import math
import operator
from typing import Any, Iterable, Mapping, Sequence

from .errors import ArgumentError
from .state import Trusted

#: the largest step number: a step directory is ``step_`` and 12 digits
MAX_STEP = 10**12 - 1


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
