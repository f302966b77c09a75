"""The layouts of the structures a store saved most recently, so that a save of a known structure plans
nothing (see :class:`.layout.ShardLayout`)."""

from __future__ import annotations

from typing import Any

from .. import state as st
from .context import Context
from .dataparallel import Sharing, comparable, declared
from .layout import ShardLayout

#: a job saving a few structures in turn (e.g. a model-only and a full state) reuses each
MAX_LAYOUTS = 4


class RecentLayouts:
    """The :data:`MAX_LAYOUTS` structures saved most recently, newest first, with the ``replicated=``
    declaration of each."""

    def __init__(self, ctx: Context) -> None:
        self._ctx = ctx
        self._layouts: list[tuple[ShardLayout, Any]] = []

    def get(self, names: list[str], values: list[Any], structure: list[Any], replicated: Any) -> ShardLayout:
        """The layout of a state of this structure: a recent one that matches, or a new one (which checks
        every leaf). JSON leaves are checked on every save; arrays of a known structure need no check.
        ``replicated``: a :class:`~.dataparallel.Sharing` (adapters), the user's declaration, or None; a
        declaration is worked out once per structure."""
        given = replicated if isinstance(replicated, Sharing) or replicated is None else None
        declaration = None if given is not None or replicated is None else comparable(replicated)
        for lay, decl in self._layouts:
            if lay.signature == structure and lay.names == names and (
                    (lay.sharing is given or lay.sharing == given) if declaration is None else decl == declaration):
                for i in lay.json:
                    st.check_leaf(names[i], values[i])
                return lay
        g = self._ctx.group
        sharing: Any = given
        if declaration is not None:
            def sharing(names: list[str], sizes: dict[int, int]) -> Sharing:
                return declared(names, sizes, replicated, g.rank, g.world_size)
        lay = ShardLayout.plan(names, values, structure, g.rank, self._ctx.file_size, sharing)
        self._layouts = [(lay, declaration), *self._layouts[:MAX_LAYOUTS - 1]]
        return lay
