"""Bad input that only shows across ranks, in a real 2-rank gloo job: every rank raises the same clear error
and nothing is written, then the store goes on working."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from gloo_job import run_job  # noqa: E402

CHILD = Path(__file__).parent / "children" / "save_steps_child.py"


def test_ranks_saving_different_steps_or_nothing_raise_together_and_the_store_goes_on(shm_dir):
    results = run_job(2, CHILD, shm_dir)
    for r in results:
        calls = r["calls"]
        kind, msg = calls["different-steps"]
        assert kind == "ArgumentError" and "different steps" in msg and "from 3 to 4" in msg, calls
        assert calls["empty-on-one-rank"] == ["ok", True]  # a rank holding nothing of the state saves {}
        kind, msg = calls["empty-on-every-rank"]
        assert kind == "ArgumentError" and "step 6" in msg and "empty on every rank" in msg, calls
        assert calls["then"] == ["ok", True]
        assert r["restored"] and r["steps"] == [5, 7], r
        # (each rank stages while the ranks agree: what they refused left no files behind)
        assert r["dirs"] == ["step_000000000005", "step_000000000007"], r
        assert calls["rank-0-declines"] == ["ok", False] and calls["rank-0-takes"] == ["ok", True], calls
        assert r["declined"] == {"steps": [1], "dirs": ["step_000000000001"]}, r
