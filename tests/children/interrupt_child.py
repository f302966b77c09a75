"""A process that saves a step whose copy to the object tier is held back, for tests/test_interrupt.py.

    python interrupt_child.py RAM OBJ_URL MODE

The copy to the object tier waits in the ``transfer`` test hook until the parent writes a line to this
process's stdin. MODE ``close``: the program then closes the store and waits there; ``exit``: it leaves
the store open and ends, so the interpreter's exit waits. A KeyboardInterrupt that reaches the program ends it with status 130
without a traceback, as a command-line tool ends on Ctrl-C.
"""

from __future__ import annotations

import signal
import sys
import threading

import numpy as np

from tierfs import TieredStore
from tierfs.testing import hooks
from tierfs.tiers import MemoryTier, ObjectTier

# Ctrl-C as at a terminal, also when the tests run as a background job (whose processes start with
# SIGINT ignored, and Python then installs no KeyboardInterrupt handler)
signal.signal(signal.SIGINT, signal.default_int_handler)
ram, url, mode = sys.argv[1:4]
go = threading.Event()


def _read_stdin() -> None:
    if sys.stdin.readline():
        go.set()


def _hold(step: int, tier: str, nbytes: int) -> None:
    go.wait()


threading.Thread(target=_read_stdin, daemon=True).start()
hooks.add("transfer", _hold)
store = TieredStore([MemoryTier(ram), ObjectTier(url)])
store.save(1, {"w": np.arange(1 << 16, dtype=np.float32)})  # committed in RAM; its copy waits for stdin
print("saved", flush=True)
if mode == "close":
    try:
        store.close()
    except KeyboardInterrupt:
        print("KeyboardInterrupt", flush=True)
        sys.exit(130)
    print("closed", flush=True)
