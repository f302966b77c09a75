"""Landing: a restore's arrays as the place a peer's bytes are received into.

A restore that fetches its shard from a peer (or the entries it shares from the ranks holding them) offers
the arrays it restores into as landing places for the large entries (see :func:`~tierfs.tiers._wire.lands`):
their bytes go from the wire straight into the target, checked block by block as they land, with no
receive buffer to fault in and no copy after. The shard then records them as ``landed`` and
:func:`~tierfs.core.reading.fill` leaves them be.
"""

from __future__ import annotations

import numpy as np

from ..errors import TierfsError
from ..format import Manifest
from ..tiers._wire import lands
from .reading import Shard
from .sinks import Sink


class Landing:
    """The landing places of one restore (the ``landing`` of a fetch or a completion): the sink's own
    arrays, for the entries a transfer moves apart that the sink takes in place. One manifest (a fetch and
    the completion after it) gets the same arrays; a target that does not match takes none (the mismatch
    is raised once the copy is in)."""

    def __init__(self, sink: Sink | None) -> None:
        self.sink = sink
        self._views: tuple[Manifest, dict[str, np.ndarray]] | None = None

    def __call__(self, m: Manifest) -> dict[str, np.ndarray]:
        if self._views is not None and self._views[0] is m:
            return self._views[1]
        views: dict[str, np.ndarray] = {}
        if self.sink is not None:
            try:
                self.sink.check(m)
                for e in m.entries:
                    if lands(e):
                        v = self.sink.land(e)
                        if v is not None:
                            views[e.name] = v
            except (TierfsError, ValueError):
                views = {}
        self._views = (m, views)
        return views

    def landed(self, shard: Shard, files: set[str]) -> dict[str, np.ndarray]:
        """The entries of ``files`` that landed in the sink's arrays, with those of ``shard`` already landed."""
        views = self._views[1] if self._views is not None and self._views[0] is shard.manifest else {}
        out = dict(shard.landed)
        if views:
            out.update((e.name, views[e.name]) for e in shard.manifest.entries if e.name in views and e.file in files)
        return out
