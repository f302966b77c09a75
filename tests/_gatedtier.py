"""An object tier whose uploads wait at a gate the test opens: a real ``file://`` ObjectTier otherwise (the
tests of what waits, or not, while an upload runs: test_manager, test_store)."""

from __future__ import annotations

import threading
from typing import Any

from tierfs.tiers import ObjectTier


class GatedTier(ObjectTier):
    """A real file:// object tier whose uploads wait until the test opens the gate."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.gate = threading.Event()

    def write_files(self, step: int, files: Any, **kw: Any) -> None:
        assert self.gate.wait(60), "test never opened the gate"
        super().write_files(step, files, **kw)
