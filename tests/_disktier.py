"""A tier of plain files in a directory on local disk: a whole new kind of tier in one module, one
registration and one test class (tests/test_tiers.py), with nothing else in tierfs changed.

    {"tiers": [{"kind": "memory", "path": "/dev/shm/job"}, {"kind": "disk", "path": "/scratch/job"}]}
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from tierfs.util.fileio import atomic_write, make_private_dir
from tierfs.format import MARKER, parse_step_dirname, step_dirname, validate_filename
from tierfs.policies import PreserveAll
from tierfs.tiers import Capacity, Tier, register
from tierfs.tiers.registry import Entry, Kind


class DiskTier(Tier):
    """Steps as plain files under ``path`` (every file written whole: a temporary name, then a rename)."""

    kind = "disk"

    def __init__(self, path: str | os.PathLike[str], *, name: str = "disk", save: Any = None, keep: Any = None) -> None:
        super().__init__(name, save, keep if keep is not None else PreserveAll())
        self.path = Path(path)

    @property
    def location(self) -> str:
        return str(self.path)

    def local_dirs(self) -> list[Path]:
        return [self.path]

    def live_users(self) -> list[int]:
        return []

    def capacity(self) -> Capacity:
        st = os.statvfs(self.path) if self.path.exists() else None
        return Capacity(used=0, budget=None, free=st.f_bavail * st.f_frsize if st else None)

    def open(self) -> None:
        make_private_dir(self.path)

    def _file(self, step: int, name: str) -> Path:
        return self.path / step_dirname(step) / validate_filename(name)

    def list_steps(self) -> dict[int, bool]:
        steps = {parse_step_dirname(p.name): p for p in self.path.iterdir()} if self.path.exists() else {}
        return {s: (p / MARKER).exists() for s, p in steps.items() if s is not None}

    def file_sizes(self, step: int) -> dict[str, int]:
        return {p.name: p.stat().st_size for p in (self.path / step_dirname(step)).iterdir()
                if not p.name.startswith(".")}

    def write_file(self, step: int, name: str, data: Any) -> None:
        path = self._file(step, name)
        make_private_dir(path.parent)
        atomic_write(path, data)

    def read_file(self, step: int, name: str) -> bytes:
        return self._file(step, name).read_bytes()

    def write_marker(self, step: int, data: bytes) -> None:
        self.write_file(step, MARKER, data)

    def delete_step(self, step: int) -> None:
        (self.path / step_dirname(step) / MARKER).unlink(missing_ok=True)
        shutil.rmtree(self.path / step_dirname(step), ignore_errors=True)


register(Kind("disk", DiskTier, frozenset({"path"}), lambda entry, common: DiskTier(entry.path("path"), **common),
              '"path" (a directory)'))
