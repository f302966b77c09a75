"""tierfs's torchtitan checkpoint manager (tierfs.adapters.torchtitan) in a 2-process gloo job.

Skipped when torchtitan is not installed; it is installed with ``pip install --no-deps torchtitan==0.3.0
tyro`` (torchtitan's own requirements pin fsspec below s3fs's, see docs/torchtitan.md)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("torchtitan.components.checkpoint")

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
import gloo_job  # noqa: E402

from tierfs.adapters.torchtitan import TieredCheckpointManager  # noqa: E402


def job(mode: str, shm: str, obj: Path, dump: Path, async_mode: str) -> list[dict]:
    return gloo_job.run_job(2, HERE / "torchtitan_child.py", shm, str(obj), str(dump), mode, async_mode,
                            timeout=180)


@pytest.mark.slow
@pytest.mark.parametrize("async_mode", ["disabled", "async"])
def test_two_ranks_save_then_resume_from_ram(shm_dir, tmp_path, async_mode):
    obj, dump = tmp_path / "obj", tmp_path / "dump"
    saved = job("save", shm_dir, obj, dump, async_mode)
    for r in saved:
        assert r["steps"] == [2, 4]
        assert "checkpoint" not in r["folder_listing"]  # nothing written under torchtitan's folder
    loaded = job("load", shm_dir, obj, dump, async_mode)
    for r in loaded:
        assert r["same_model"] and r["same_optim"], r
        assert r["train_step"] == 4
        assert set(r["sources"].values()) == {"ram"}, r


@pytest.mark.slow
def test_resume_from_the_object_tier_when_ram_is_gone(shm_dir, tmp_path):
    import shutil

    obj, dump = tmp_path / "obj", tmp_path / "dump"
    job("save", shm_dir, obj, dump, "disabled")
    for node in Path(shm_dir).iterdir():
        shutil.rmtree(node)
    for r in job("load", shm_dir, obj, dump, "disabled"):
        assert r["same_model"] and r["same_optim"] and r["train_step"] == 4, r
        assert set(r["sources"].values()) == {"file"}, r


def test_config_is_torchtitans_plus_tiers():
    from torchtitan.components.checkpoint import CheckpointManager

    cfg = TieredCheckpointManager.Config(enable=True, tiers_config="tiers.json")
    assert isinstance(cfg, CheckpointManager.Config)
    assert cfg._owner is TieredCheckpointManager
    with pytest.raises(ValueError, match="async_with_pinned_mem"):
        TieredCheckpointManager.Config(async_mode="async_with_pinned_mem")
    with pytest.raises(ValueError, match="2 checkpoint"):
        TieredCheckpointManager.Config(keep_latest_k=1)  # torchtitan's own checks still run
