"""tierfs's Megatron-Core strategies (tierfs.adapters.megatron) with ``megatron.core.dist_checkpointing``.

The job tests run ``children/megatron_child.py`` in 2-process gloo jobs (each process its own node, with
its own RAM tier and its own checkpoint directories, no shared file system; see the child's docstring for
the state and the training). Skipped where megatron-core is not installed (Linux: the dev extra installs it).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import signal
import sys
from pathlib import Path

import pytest

if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
    pytest.skip("megatron-core is not installed", allow_module_level=True)

# megatron-core warns at import that Transformer Engine and Apex (GPU kernels) are not installed
pytestmark = pytest.mark.filterwarnings("ignore:Transformer Engine and Apex:UserWarning")

HERE = Path(__file__).parent
CHILD = HERE / "children" / "megatron_child.py"
sys.path.insert(0, str(HERE))
import gloo_job  # noqa: E402
from _steps import committed  # noqa: E402

from tierfs import TieredStore  # noqa: E402
from tierfs.errors import ArgumentError, FormatError, TierfsError  # noqa: E402
from tierfs.tiers import MemoryTier  # noqa: E402


def job(shm: str, obj: Path, root: Path, layout: str, total: int, kill_at: int = 0, start: bool = False):
    args = (shm, str(obj), str(root), layout, str(total), str(kill_at))
    if start:
        return gloo_job.start_job(2, CHILD, *args)
    return gloo_job.run_job(2, CHILD, *args, timeout=180)


@pytest.mark.slow
def test_killed_mid_save_resumes_from_ram_then_from_object_storage_at_another_layout(shm_dir, tmp_path):
    """Saved at TP=2 with asynchronous saves (Megatron's AsyncRequest), RAM every step and the object tier
    every 3rd (the tiers' own policies). SIGKILLed while step 5 commits: RAM holds 2-4, the object tier 3.
    Resumed: step 4 from RAM, bit-exact; trains on to 7. On new machines (RAM and checkpoint directories
    gone), loaded at TP=1 x DP=2 from the object tier: step 6, which the resumed run saved, bit-exact."""
    obj, root = tmp_path / "obj", tmp_path / "root"
    procs = job(shm_dir, obj, root, "tp", 7, kill_at=5, start=True)
    for p in procs:
        out, err = p.communicate(timeout=180)
        assert p.returncode == -signal.SIGKILL, (p.returncode, out[-500:], err[-3000:])
    for node in ("node0", "node1"):  # step 5 never committed anywhere
        assert committed(f"{shm_dir}/{node}", obj.as_uri()) == {2: ["ram"], 3: ["ram", "file"], 4: ["ram"]}

    resumed = job(shm_dir, obj, root, "tp", 7)
    for r in resumed:  # every rank read its own node's RAM
        assert (r["loaded"], r["dir"], r["sources"], r["load_diff"]) == (4, "iter_0000004", ["ram"], []), r
        assert r["steps"] == {"3": ["file"], "5": ["ram"], "6": ["ram", "file"], "7": ["ram"]}, r

    shutil.rmtree(root)
    for node in Path(shm_dir).iterdir():
        shutil.rmtree(node)
    for r in job(shm_dir, obj, root, "dp", 6):  # Megatron picks the strategy from the directory's metadata.json
        assert (r["loaded"], r["dir"], r["sources"], r["load_diff"]) == (6, "iter_0000006", ["file"], []), r
    written = json.loads((root / "node1" / "iter_0000006" / "metadata.json").read_text())
    assert written["sharded_backend"] == "tierfs", written
    assert (root / "node1" / "latest_checkpointed_iteration.txt").read_text() == "6"


def test_errors_are_one_line_tierfs_errors(shm_dir, tmp_path):
    """Arguments are checked when a strategy is made or called; a directory saved by Megatron's own strategy
    is refused by Megatron's load itself, naming the backend."""
    from megatron.core import dist_checkpointing

    from tierfs.adapters.megatron import TieredLoadStrategy, TieredSaveStrategy

    store = TieredStore([MemoryTier(shm_dir)])
    try:
        errors = []
        with pytest.raises(ArgumentError, match="names no step") as e:
            TieredSaveStrategy(store).save({}, tmp_path / "latest")
        errors.append(e.value)
        with pytest.raises(ArgumentError, match="TieredSaveStrategy store") as e:
            TieredSaveStrategy("/dev/shm/ckpt")  # type: ignore[arg-type]
        errors.append(e.value)
        with pytest.raises(ArgumentError, match="replicated") as e:
            TieredSaveStrategy(store, replicated="all")
        errors.append(e.value)
        with pytest.raises(ArgumentError, match="tiers") as e:
            TieredLoadStrategy(store, tiers=["s3"])
        errors.append(e.value)
        ckpt = tmp_path / "iter_0000001"
        ckpt.mkdir()
        (ckpt / "metadata.json").write_text(json.dumps({
            "sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
            "common_backend_version": 1}))
        with pytest.raises(FormatError, match="'torch_dist' strategy") as e:
            dist_checkpointing.load({}, str(ckpt), sharded_strategy=TieredLoadStrategy(store))
        errors.append(e.value)
        with pytest.raises(TierfsError, match="never changed") as e:
            TieredLoadStrategy(store).remove_sharded_tensors(str(ckpt), "model.")
        errors.append(e.value)
        assert all("\n" not in str(x) for x in errors), errors
    finally:
        store.close()
