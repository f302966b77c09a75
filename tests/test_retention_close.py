"""Retention on a shared object tier, spread over the ranks, at the end of a job: a clean close leaves
exactly the kept steps' objects on S3; a job that ends without closing leaves the remaining objects of
the last step retention dropped, and the next store's open removes them, naming retention as the cause
(not an interrupted save).

Three ranks (gloo, each its own node and RAM directory) save steps 1-5 to RAM and to S3 (moto), each
keeping the latest 2 (tests/children/s3_retention_close_child.py)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("moto")
s3fs = pytest.importorskip("s3fs")

import gloo_job  # noqa: E402
from tierfs import TieredStore  # noqa: E402
from tierfs.format import MARKER  # noqa: E402
from tierfs.format.keys import key  # noqa: E402
from tierfs.policies import LatestN  # noqa: E402
from tierfs.tiers import MemoryTier, ObjectTier  # noqa: E402

CHILD = Path(__file__).parent / "children" / "s3_retention_close_child.py"
WORLD = 3


def keys(url: str, opts: dict) -> set[str]:
    """Every object under ``url``, relative to it."""
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **opts)
    root = url.removeprefix("s3://").rstrip("/")
    return {k[len(root) + 1:] for k in fs.find(root)}


def step_keys(*steps: int, ranks: range = range(WORLD), marker: bool = True) -> set[str]:
    """The objects of ``steps``: each rank's one shard file and manifest, and the marker."""
    out = set()
    for s in steps:
        out |= {key(s, MARKER)} if marker else set()
        out |= {key(s, f"rank_{r:05d}.{n}") for r in ranks for n in ("0000.bin", "manifest.json")}
    return out


def reopen(url: str, opts: dict, ram: str, caplog: pytest.LogCaptureFixture) -> list[str]:
    """Open a store on the tier again (one process, the tier's owner), and return the lines of its log
    that remove something or name an interrupted save."""
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="tierfs"):
        store = TieredStore([MemoryTier(ram), ObjectTier(url, storage_options=opts, keep=LatestN(2))])
        try:
            assert sorted(store.steps()) == [4, 5]
        finally:
            store.close()
    return [m for m in (r.getMessage() for r in caplog.records) if "removing" in m or "interrupted" in m]


def test_the_s3_objects_left_after_a_clean_close(s3_url, shm_dir, caplog):
    url, opts = s3_url
    closed, ended = f"{url}/closed", f"{url}/ended"
    gloo_job.run_job(WORLD, CHILD, shm_dir, closed, ended, env={"TIERFS_TEST_STORAGE_OPTIONS": json.dumps(opts)})

    # a clean close: exactly the kept steps, nothing of steps 1-3 whichever rank wrote it; the next open
    # finds nothing to remove
    assert keys(closed, opts) == step_keys(4, 5)
    assert reopen(closed, opts, os.path.join(shm_dir, "next-closed"), caplog) == []
    assert keys(closed, opts) == step_keys(4, 5)

    # a job that ended without closing: the marker of step 3 and rank 0's files went at the last save's
    # retention; ranks 1 and 2 were to delete their own at a later save or at close. The next open
    # removes them, naming retention as the cause
    assert keys(ended, opts) == step_keys(4, 5) | step_keys(3, ranks=range(1, WORLD), marker=False)
    assert reopen(ended, opts, os.path.join(shm_dir, "next-ended"), caplog) == [
        "tier s3: removing the remaining objects of step 3, dropped by retention (its marker was deleted; the job "
        "ended before every rank had deleted its own objects)"]
    assert keys(ended, opts) == step_keys(4, 5)


def test_the_open_names_why_a_step_has_no_marker():
    """Saves commit in order, so a step above every committed one is a save cut short; below one, a step
    the tier's keep policy drops was dropped by retention, and one it keeps is a save or copy that did
    not finish."""
    from tierfs.core.lifecycle import uncommitted_cause
    from tierfs.policies import EveryNSteps

    latest = ObjectTier("memory://tierfs-why", keep=LatestN(2))
    assert uncommitted_cause(latest, 6, {4: True, 5: True, 6: False}) == \
        "removing uncommitted step 6 left by an interrupted save"
    assert uncommitted_cause(latest, 1, {1: False}) == "removing uncommitted step 1 left by an interrupted save"
    assert uncommitted_cause(latest, 3, {3: False, 4: True, 5: True}) == (
        "removing the remaining objects of step 3, dropped by retention (its marker was deleted; the job ended "
        "before every rank had deleted its own objects)")
    assert uncommitted_cause(ObjectTier("memory://tierfs-why", keep=EveryNSteps(2)), 4, {4: False, 5: True}) == \
        "removing step 4, which has no marker although step 5 is committed: a save or copy of it did not finish"
