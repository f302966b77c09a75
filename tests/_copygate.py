"""A ``copy`` test hook (tierfs.testing.hooks) that holds back the copies an overlapped save may leave
running, until the test opens it: the tests of what waits for those copies (test_device, test_gpu)."""

from __future__ import annotations

import threading


class Gate:
    """Holds each chunk of copies that may run on after ``save`` returns (``later``) until :attr:`open`."""

    def __init__(self) -> None:
        self.open = threading.Event()
        self.held = 0

    def __call__(self, step: int, nbytes: int, later: bool) -> None:
        if later:
            self.held += 1
            assert self.open.wait(120), "the gate was never opened"
