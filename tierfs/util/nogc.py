"""No garbage collection while a save or restore makes its many short-lived objects.

A state of thousands of tensors means thousands of small objects per save (views, entries, copy jobs),
nearly all freed by reference counting when the call ends. Made with the collector on, they trigger
collections of every generation, and a full collection walks every object of the process (the model's
tensors included): 100 ms here, for a save whose work takes 10 ms. Within :func:`paused` the collector
does not run; what the call leaves behind is collected later as usual.
"""

from __future__ import annotations

import gc
import threading
from contextlib import contextmanager
from typing import Iterator

_lock = threading.Lock()
_depth = 0
_was_enabled = False


@contextmanager
def paused() -> Iterator[None]:
    """Pause the collector for the ``with`` block (nested and concurrent blocks share one pause)."""
    global _depth, _was_enabled
    with _lock:
        if _depth == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _was_enabled:
                gc.enable()
