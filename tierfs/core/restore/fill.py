"""Filling a sink from a shard: every block of the wanted entries verified against the manifest, then
copied into the sink once (to a GPU, each block as soon as it is verified); and the landing places a
transfer from a peer receives entries into (:class:`Landing`)."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from ...format import blockio as _blocks
from ...util import hooks as _hooks
from ...util import nogc as _nogc
from ...device import upload as _upload
from ...errors import TierfsError
from ...format import Entry, Manifest
from ...tiers._wire import lands
from ...tiers.base import Tier
from ...tiers.capabilities import Staging
from ..layout import ReadViews
from .sinks import Shard, Sink


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


def fill(tier: Tier | None, step: int, shard: Shard, sink: Sink | None, threads: int | None,
         verified: bool = False) -> None:
    """Verify every block of the shard's wanted entries and copy them into the sink (no sink: verify the
    whole shard, copy nothing). ``tier`` is where the shard was read (None: received from a peer).
    ``verified``: every block was checked already (as it landed from a peer): only copy."""
    with _nogc.paused():
        _fill(tier, step, shard, sink, threads, verified)


def _fill(tier: Tier | None, step: int, shard: Shard, sink: Sink | None, threads: int | None,
          verified: bool = False) -> None:
    manifest = shard.manifest
    if sink is None:
        if not verified:
            _blocks.verify(manifest, shard.files, threads)
        return
    sink.reset()  # what an earlier source delivered before it failed, or an older attempt's values
    sink.check(manifest)
    raw = _blocks.shard_views(manifest, shard.files)
    landed = shard.landed
    jobs: list[_blocks.Job] = []
    views = ReadViews.of(manifest)
    targets: list[Any] = []
    sources: list[Any] = []
    small: list[tuple[Entry, np.ndarray]] = []
    memos: dict[str, dict[Any, Any] | None] = {}
    upload: _upload.Upload | None = None
    wanted = sink.wanted
    entries = manifest.entries
    if wanted is not None and len(wanted) * 4 < len(entries):  # a few entries of many: look them up
        entries = [views.by_name[n] for n in wanted if n in views.by_name]
    for e in entries:
        if wanted is not None and e.name not in wanted:
            continue
        if e.kind == "json":
            sink.json(e)
            continue
        if e.name in landed:  # received straight into its array, every block checked as it landed
            sink.took(e)
            continue
        on_device = sink.device_target(e)
        if on_device is not None:  # each block copied to the device as soon as it is verified
            if e.length:
                if upload is None:
                    upload = _upload.Upload()
                jobs.append(upload.job(e, raw[e.file], on_device, manifest, verified, _memo(tier, step, e.file)))
            continue
        target = sink.direct(e)
        if target is not None:  # verified first, copied with the others after
            targets.append(target)
            if e.file not in memos:
                memos[e.file] = tier.buffer_memo(step, e.file) if isinstance(tier, Staging) else None
            typed, src = views.typed(e, raw[e.file], memos[e.file])
            sources.append(typed)
            if len(e.crc32c) == 1:
                small.append((e, src))
                continue
        else:
            src = raw[e.file][e.offset:e.offset + e.length]
        dst = None if target is not None else sink.array(e, src, tier, step)
        if verified and dst is None:
            continue  # nothing to check, nothing to copy here (a direct target's copy comes below)
        jobs.append(_blocks.Job(e.name, src, dst, manifest.block_size, None if verified else e.crc32c,
                              functools.partial(manifest.key, e.name)))
    if not verified:
        _blocks.verify_small([_blocks.Job(e.name, src, None, manifest.block_size, e.crc32c,
                                      functools.partial(manifest.key, e.name)) for e, src in small]
                           if _hooks.active("block") else small, manifest)
    try:
        _blocks.run(jobs, threads, checksum=not verified)
    finally:
        if upload is not None:  # before the source's mapping may go, and before the targets are used
            upload.finish()
    if targets:
        sink.copy_direct(targets, sources)
    sink.finish()


def _memo(tier: Tier | None, step: int, name: str) -> Any:
    """The memo of ``tier``'s mapping of file ``name`` (where a page-lock of it is kept), or None."""
    return tier.buffer_memo(step, name) if isinstance(tier, Staging) else None
