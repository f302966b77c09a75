"""tierfs's torchtitan checkpoint manager (tierfs.adapters.torchtitan) in a 2-process gloo job.

Skipped when torchtitan is not installed; it is installed with ``pip install --no-deps torchtitan==0.3.0
tyro`` (torchtitan's own requirements pin fsspec below s3fs's, see docs/torchtitan.md)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("torchtitan.components.checkpoint")

HERE = Path(__file__).parent
CHILDREN = HERE / "children"
sys.path.insert(0, str(HERE))
import gloo_job  # noqa: E402
from _steps import committed  # noqa: E402

from tierfs.adapters.torchtitan import TieredCheckpointManager  # noqa: E402


def job(shm: str, obj: Path, dump: Path, async_mode: str = "disabled", total: int = 6, sleep: float = 0.0,
        start: bool = False):
    args = (shm, str(obj), str(dump), async_mode, str(total), str(sleep))
    if start:
        return gloo_job.start_job(2, CHILDREN / "torchtitan_child.py", *args)
    return gloo_job.run_job(2, CHILDREN / "torchtitan_child.py", *args, timeout=180)


def _same(a: Path, b: Path) -> None:
    import torch

    for rank in (0, 1):
        x, y = (torch.load(d / f"final{rank}.pt", weights_only=True) for d in (a, b))
        for part in ("model", "optim"):
            assert x[part].keys() == y[part].keys()
            for k in x[part]:
                u, v = x[part][k], y[part][k]
                assert (torch.equal(u, v) if isinstance(u, torch.Tensor) else u == v), (part, k)


@pytest.mark.slow
def test_killed_mid_run_resumes_where_an_uninterrupted_run_ends(shm_dir, tmp_path):
    """RAM takes every step, the object tier every 2nd; the job is SIGKILLed mid-run (asynchronous saves);
    resumed from RAM, and with RAM gone from the object tier, it ends bit-exact where an uninterrupted run
    ends, weights and optimizer state."""
    import shutil
    import signal
    import time

    ref, obj = tmp_path / "ref", tmp_path / "obj"
    for r in job(shm_dir + "-ref", tmp_path / "obj-ref", ref):
        assert r["loaded"] is False and "checkpoint" not in r["folder_listing"]  # nothing under torchtitan's folder
    procs = job(shm_dir, obj, tmp_path / "killed", "async", sleep=0.5, start=True)
    deadline = time.time() + 90
    try:
        while True:  # until both nodes' RAM holds step 3 and the object tier step 2
            assert all(p.poll() is None for p in procs), [p.stderr.read()[-2000:] for p in procs]
            assert time.time() < deadline, "no step committed in time"
            views = [committed(os.path.join(shm_dir, f"node{r}"), obj.as_uri()) for r in (0, 1)]
            if all(3 in v and 2 in v and "file" in v[2] for v in views):
                break
            time.sleep(0.05)
    finally:
        for p in procs:
            p.send_signal(signal.SIGKILL)
            p.wait()
    ram_step = min(max(committed(os.path.join(shm_dir, f"node{r}"), obj.as_uri())) for r in (0, 1))
    obj_step = max(s for s, tiers in committed(os.path.join(shm_dir, "node0"), obj.as_uri()).items() if "file" in tiers)
    assert ram_step < 6
    shutil.copytree(obj, tmp_path / "obj-then")  # the object tier as the kill left it
    for r in job(shm_dir, obj, tmp_path / "resumed"):
        assert r["loaded"] == ram_step and set(r["sources"].values()) == {"ram"}, r
    _same(tmp_path / "resumed", ref)
    for node in Path(shm_dir).iterdir():  # another machine: RAM is empty, the object tier serves
        shutil.rmtree(node)
    for r in job(shm_dir, tmp_path / "obj-then", tmp_path / "resumed2"):
        assert r["loaded"] == obj_step and set(r["sources"].values()) == {"file"}, r
    _same(tmp_path / "resumed2", ref)


def test_config_is_torchtitans_plus_tiers():
    from torchtitan.components.checkpoint import CheckpointManager

    cfg = TieredCheckpointManager.Config(enable=True, tiers_config="tiers.json")
    assert isinstance(cfg, CheckpointManager.Config)
    assert cfg._owner is TieredCheckpointManager
    with pytest.raises(ValueError, match="async_with_pinned_mem"):
        TieredCheckpointManager.Config(async_mode="async_with_pinned_mem")
    with pytest.raises(ValueError, match="2 checkpoint"):
        TieredCheckpointManager.Config(keep_latest_k=1)  # torchtitan's own checks still run
