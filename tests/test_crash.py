"""SIGKILL in the middle of a save, at many points: the newest committed step stays restorable, bit-exact,
and the half-written step is never offered and is cleaned up."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from crash_child import state_for, store

HERE = Path(__file__).parent
CHILDREN = HERE / "children"

# kill point -> (step being saved when killed, newest step restorable afterwards, newest on the object tier
# once the reopened store's background work is done). Steps before it were saved whole; the object tier
# takes even steps and keeps 2. A step committed in RAM whose copy the killed process did not finish is
# copied on by the next store (catch-up).
POINTS = {
    "copy": (5, 4, 4),
    "manifest": (5, 4, 4),
    "marker": (5, 4, 4),
    "marker-rename": (5, 4, 4),
    "retention": (5, 5, 4),  # step 5 committed, then killed while deleting step 3
    "before-copy": (6, 6, 6),  # RAM commit of step 6 done, its upload not begun
    "upload": (6, 6, 6),  # RAM commit of step 6 done, its upload cut short
    "object-marker": (6, 6, 6),
}


@pytest.mark.parametrize("point", list(POINTS))
def test_sigkill_during_save_leaves_previous_step_restorable(point, shm_dir, tmp_path):
    last, expect_any, expect_obj = POINTS[point]
    obj = tmp_path / "obj"
    proc = subprocess.run([sys.executable, str(CHILDREN / "crash_child.py"), shm_dir, str(obj), point, str(last)],
                          capture_output=True, text=True, timeout=120, env=os.environ | {"PYTHONPATH": str(CHILDREN)})
    assert proc.returncode == -9, proc.stdout + proc.stderr
    s = store(shm_dir, str(obj))
    try:
        s.wait_until_finished()  # the copies the killed process did not make
        steps = s.steps()
        assert max(steps) == expect_any
        assert max(st for st, tiers in steps.items() if "file" in tiers) == expect_obj
        for tier in (t.name for t in s.tiers):  # nothing half-written survives reopening
            assert all(s.tier(tier).list_steps().values()), s.tier(tier).list_steps()
        out, info = s.restore()
        assert info.step == expect_any and info.tier == "ram"
        want = state_for(expect_any)
        assert all(out[k].tobytes() == want[k].tobytes() for k in want if k != "step") and out["step"] == expect_any
        out, info = s.restore(tiers=["file"])
        assert info.step == expect_obj
        want = state_for(expect_obj)
        assert all(out[k].tobytes() == want[k].tobytes() for k in want if k != "step")
        # the job resumes: the next save after the restored step works
        s.save(expect_any + 1, state_for(expect_any + 1))
        s.wait_until_finished()
    finally:
        s.close()
