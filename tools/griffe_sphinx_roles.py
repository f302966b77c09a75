"""A griffe extension for the docs site: Sphinx cross-reference roles in docstrings become links.

tierfs's docstrings use Sphinx's roles (``:class:`~tierfs.tiers.base.Replicator```, ``:meth:`restore```,
``:func:``, ``:mod:``, ``:attr:``, ``:data:``, ``:exc:``, ``:obj:``, ``:const:``, with or without a
``py:`` domain). mkdocstrings renders docstrings as Markdown, where such a role would show as raw text.
This extension rewrites every role in every docstring of the package, once griffe has loaded it, into an
mkdocs-autorefs cross-reference:

- the target is resolved the way Sphinx reads it: a dotted path as written (``tierfs.errors.ArgumentError``),
  a bare or dotted name from the scope of the documented object (``restore`` in a method of
  ``TieredStore`` is ``TieredStore.restore``; ``Manifest.key`` goes through the module's import of
  ``Manifest``), and a name with leading dots relative to the object's package (``.timeline`` in
  ``tierfs.core.saving`` is ``tierfs.core.timeline``);
- the text shown is the target as written, or only its last component with ``~``; ``Title <target>``
  sets it explicitly; ``!target`` is never a link;
- the reference is autorefs' *optional* kind, the one mkdocstrings itself emits for type annotations: a
  link when the target is rendered anywhere on the site (under its own path or any alias, e.g.
  ``tierfs.TieredStore`` for ``tierfs.store.TieredStore``), and plain code text when it is not (a private
  module, a helper the API reference leaves out), so ``mkdocs build --strict`` stays clean.

Configured in ``mkdocs.yml`` under the python handler's ``options: extensions:``. Only the docs build
loads it; nothing in tierfs imports it.
"""

from __future__ import annotations

import html
import re
from typing import Any

import griffe

ROLE_RE = re.compile(
    r":(?:py:)?(?P<role>class|meth|func|mod|attr|data|exc|obj|const):`(?P<body>[^`]+)`")
TITLED_RE = re.compile(r"^(?P<title>.+?)\s*<(?P<target>[^<>]+)>$")


def _exists(collection: Any, path: str) -> bool:
    try:
        collection[path]
    except Exception:  # KeyError, or an alias that does not resolve
        return False
    return True


def _package_of(obj: griffe.Object | griffe.Alias) -> griffe.Module:
    """The package a relative name (``.timeline``) starts from: the object's module's package."""
    mod = obj.module
    if mod.is_package or mod.is_init_module or mod.parent is None:
        return mod
    return mod.parent  # type: ignore[return-value]


def resolve(obj: griffe.Object | griffe.Alias, target: str, collection: Any) -> str:
    """The full dotted path ``target`` names in the docstring of ``obj`` (as written when unknown)."""
    target = target.strip().removesuffix("()")
    if target.startswith("."):
        base: griffe.Object | griffe.Alias | None = _package_of(obj)
        rest = target[1:]
        while rest.startswith(".") and base is not None and base.parent is not None:
            base, rest = base.parent, rest[1:]
        candidates = [f"{base.path}.{rest}" if base is not None else rest, f"{obj.module.path}{target}"]
        return next((c for c in candidates if _exists(collection, c)), candidates[0])
    if _exists(collection, target) and "." in target:
        return target
    first, _, rest = target.partition(".")
    scope: griffe.Object | griffe.Alias | None = obj
    while scope is not None:  # the object's own scope, then its parents' (griffe's resolve stops at members)
        try:
            path = scope.resolve(first)
        except Exception:  # NameResolutionError, or an alias that does not resolve
            scope = scope.parent
            continue
        return f"{path}.{rest}" if rest else path
    return target


def _render(match: re.Match[str], obj: griffe.Object | griffe.Alias, collection: Any) -> str:
    body = match["body"].strip()
    titled = TITLED_RE.match(body)
    if titled:
        title, target = titled["title"], titled["target"].strip()
    else:
        title, target = None, body
    if target.startswith("!"):
        return f"`{title or target[1:]}`"
    short = target.startswith("~")
    target = target.lstrip("~")
    if title is None:
        title = target.removesuffix("()").rsplit(".", 1)[-1] if short else target.removesuffix("()")
        title = title.lstrip(".")
    identifier = resolve(obj, target, collection)
    # raw HTML: Markdown leaves the tag alone and renders the backticks inside it as code
    return f'<autoref identifier="{html.escape(identifier)}" optional>`{title}`</autoref>'


def convert(text: str, obj: griffe.Object | griffe.Alias, collection: Any) -> str:
    """``text`` with every Sphinx role replaced by an optional autorefs cross-reference."""
    return ROLE_RE.sub(lambda m: _render(m, obj, collection), text)


def _walk(obj: griffe.Object, seen: set[int]):
    if id(obj) in seen:
        return
    seen.add(id(obj))
    yield obj
    for member in obj.members.values():
        if not member.is_alias:
            yield from _walk(member, seen)  # type: ignore[arg-type]


class SphinxRoles(griffe.Extension):
    """Rewrite Sphinx roles into optional autorefs cross-references in every docstring of a package."""

    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        for obj in _walk(pkg, set()):
            doc = obj.docstring
            if doc is not None and ":" in doc.value and "`" in doc.value:
                doc.value = convert(doc.value, obj, loader.modules_collection)
