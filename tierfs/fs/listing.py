"""Listings of ``tiered::``: the union of what RAM holds and what the target holds, complete files only.

A listing never shows the temporary name of a write in flight (``tierfs.util.fileio.is_tmp_name``): not
the RAM side's, not the one a drain's upload to a local target uses, not another tierfs writer's. Where
both hold a file, RAM's entry (the newest bytes) wins; ``"tier"`` says which answered.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Iterable

from ..util.fileio import is_tmp_name
from .ramdir import RamDir

if TYPE_CHECKING:
    import fsspec

    from .writeback import Drain

Info = dict[str, Any]


class TieredListing:
    """``_info``, ``_ls`` and ``_find`` of :class:`tierfs.fs.TieredFileSystem`."""

    if TYPE_CHECKING:
        target: fsspec.AbstractFileSystem
        _drain: Drain

        def _norm(self, path: Any) -> tuple[str, str]: ...

    @property
    def _ram(self) -> RamDir:
        return self._drain.ramdir

    def _from_ram(self, infos: Iterable[Info], rel: str, tp: str) -> dict[str, Info]:
        """RAM listing entries by target path (``tp`` for ``rel`` itself)."""
        out = {}
        for i in infos:
            name = tp if i["name"] == rel else self._drain.tpath(i["name"])
            out[name] = {**i, "name": name, "tier": "ram"}
        return out

    async def _info(self, path: str, **kwargs) -> Info:
        tp, rel = self._norm(path)
        info = self._ram.info(rel) if rel else None
        if info is not None:
            return {**info, "name": tp, "tier": "ram"}
        out = await asyncio.to_thread(self.target.info, tp, **kwargs)
        return {**out, "name": out["name"].rstrip("/") or out["name"], "tier": "target"}

    async def _ls(self, path: str, detail: bool = True, **kwargs) -> list:
        tp, rel = self._norm(path)
        ram = await asyncio.to_thread(self._ram.ls, rel)
        try:
            remote = await asyncio.to_thread(self.target.ls, tp, detail=True, **kwargs)
        except FileNotFoundError:
            remote = None
        if ram is None and remote is None:
            raise FileNotFoundError(tp)
        merged = _from_target(((i["name"], i) for i in remote or []), withdirs=True)
        merged.update(self._from_ram(ram or [], rel, tp))
        infos = [merged[k] for k in sorted(merged)]
        return infos if detail else [i["name"] for i in infos]

    async def _find(self, path: str, maxdepth: int | None = None, withdirs: bool = False, **kwargs):
        detail = kwargs.pop("detail", False)
        tp, rel = self._norm(path)
        ram = await asyncio.to_thread(self._ram.find, rel, maxdepth, withdirs)
        try:
            remote = await asyncio.to_thread(self.target.find, tp, maxdepth=maxdepth, withdirs=withdirs,
                                             detail=True, **kwargs)
        except FileNotFoundError:
            remote = {}
        merged = _from_target(remote.items(), withdirs)
        merged.update(self._from_ram(ram.values(), rel, tp))
        names = sorted(merged)
        return {n: merged[n] for n in names} if detail else names


def _from_target(entries: Iterable[tuple[str, Info]], withdirs: bool) -> dict[str, Info]:
    """Target listing entries by name, without the temporary names of writes in flight (a drain's
    upload to a local target, another tierfs writer) and, unless ``withdirs``, without directories (s3fs
    lists the directory itself when its first listing raced with uploads)."""
    out = {}
    for name, i in entries:
        name = name.rstrip("/")
        if any(is_tmp_name(part) for part in name.split("/")):
            continue
        if withdirs or i.get("type") != "directory":
            out[name] = {**i, "name": name, "tier": "target"}
    return out
