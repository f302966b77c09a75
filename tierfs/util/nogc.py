"""No garbage collection while a save, a restore or a step's background work makes its many short-lived
objects.

A state of thousands of tensors means thousands of small objects per save (views, entries, copy jobs),
nearly all freed by reference counting when the call ends. Made with the collector on, they trigger
collections of every generation, and a full collection walks every object of the process (the model's
tensors included): 100-200 ms here, for a save whose work takes 10 ms, and it holds the GIL throughout,
so a collection that a background thread sets off stalls the training thread as long. Within
:func:`paused` the collector does not run; what the block leaves behind is collected later as usual.

The blocks of several threads share one pause. A pause that has lasted :data:`LONGEST` seconds ends
when the next block starts (a save every step starts one), so a long background copy never keeps the
collector off for the training loop's own garbage.
"""

from __future__ import annotations

import gc
import threading
import time
from contextlib import contextmanager
from typing import Iterator

#: seconds one pause lasts at most, as the next block to start sees it
LONGEST = 2.0

_lock = threading.Lock()
_depth = 0
_was_enabled = False
_started = 0.0
_expired = False


@contextmanager
def paused() -> Iterator[None]:
    """Pause the collector for the ``with`` block (nested and concurrent blocks share one pause)."""
    global _depth, _was_enabled, _started, _expired
    with _lock:
        now = time.monotonic()
        if _depth == 0:
            _was_enabled, _started, _expired = gc.isenabled(), now, False
            gc.disable()
        elif not _expired and now - _started > LONGEST:
            _expired = True  # the collector runs again until every block has ended
            if _was_enabled:
                gc.enable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _was_enabled and not _expired:
                gc.enable()
