"""Run by test_crash.py in a subprocess: save steps, then SIGKILL itself at a chosen point of a save."""

from __future__ import annotations

import os
import signal
import sys

import numpy as np

from tierfs import TieredStore
from tierfs.format import MARKER, step_dirname
from tierfs.policies import FixedIntervalPolicy, LatestN
from tierfs.testing import hooks
from tierfs.tiers import MemoryTier, ObjectTier


def state_for(step: int) -> dict:
    rng = np.random.default_rng(step)
    return {f"w{i}": rng.standard_normal(40_000 + i).astype(np.float32) for i in range(6)} | {"step": step}


def store(shm: str, obj: str) -> TieredStore:
    return TieredStore([MemoryTier(shm, keep=LatestN(2)),
                        ObjectTier(f"file://{obj}", save=FixedIntervalPolicy(2), keep=LatestN(2))],
                       file_size=200_000, block_size=32 << 10)


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def arm(point: str) -> None:
    """Make the next save die at ``point``."""
    if point == "copy":  # halfway through copying the state into the RAM buffers
        calls = [0]

        def block(name, nbytes):
            calls[0] += 1
            if calls[0] == 4:
                die()
        hooks.add("block", block)
    elif point == "manifest":  # shards written, manifest not yet
        real_wf = MemoryTier.write_file

        def wf(self, step, name, data):
            if name.endswith("manifest.json"):
                die()
            return real_wf(self, step, name, data)
        MemoryTier.write_file = wf
    elif point == "marker":  # manifest written, marker not yet
        MemoryTier.write_marker = lambda self, step, data: die()
    elif point == "marker-rename":  # marker's temporary file written, not yet renamed
        hooks.add("rename", lambda path: die() if str(path).endswith(MARKER) else None)
    elif point == "before-copy":  # RAM committed; the background copy to the object tier not yet started
        hooks.add("stage", lambda stage, step, tier: die() if stage == "copy" else None)
    elif point == "upload":  # RAM committed; the background upload has sent one shard file
        real_owf, sent = ObjectTier.write_file, [0]

        def owf(self, step, name, data):
            real_owf(self, step, name, data)
            sent[0] += 1
            if sent[0] == 1:
                die()
        ObjectTier.write_file = owf
    elif point == "object-marker":  # every file uploaded, the object marker not yet
        ObjectTier.write_marker = lambda self, step, data: die()
    elif point == "retention":  # deleting an old RAM step: marker gone, files not yet

        def delete(self, step):
            (self.path / step_dirname(step) / MARKER).unlink()
            die()
        MemoryTier.delete_step = delete
    else:
        raise SystemExit(f"unknown kill point {point}")


def main() -> None:
    shm, obj, point, last = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    s = store(shm, obj)
    for step in range(last):
        s.save(step, state_for(step))
    s.wait_until_finished()
    arm(point)
    s.save(last, state_for(last))
    s.wait_until_finished()
    print("survived")  # the test fails if we get here


if __name__ == "__main__":
    main()
