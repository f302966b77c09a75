"""Where the object tier keeps a step's files: from format version 3 each rank's under a key prefix of its
own before the step (``ranks/<bucket>/step_…/``), the marker at the step (``step_…/COMMITTED``); steps an
older tierfs wrote with every file under the step (version 2, ``tests/data/format2``) stay readable by
restores and by ``tierfs ls``/``verify``/``cp``, and retention removes them whole."""

from __future__ import annotations

import json
import shutil
import zlib
from collections import Counter
from pathlib import Path

import pytest

from tierfs import TieredStore
from tierfs.cli import main
from tierfs.format import MARKER, Marker, spread_bucket, step_dirname
from tierfs.format.keys import key
from tierfs.policies import LatestN
from tierfs.tiers import MemoryTier, ObjectTier

torch = pytest.importorskip("torch")
from torch.distributed.checkpoint.state_dict import get_state_dict  # noqa: E402

from tierfs import CheckpointManager  # noqa: E402

FORMAT2 = Path(__file__).resolve().parent / "data" / "format2"


def files_under(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


# -- the layout -------------------------------------------------------------------------------------------
def test_every_rank_of_a_small_job_has_a_bucket_of_its_own_and_a_large_job_fills_them_evenly():
    assert len({spread_bucket(r)[0] for r in range(16)}) == 16  # 16 ranks: 16 different first characters
    assert len({spread_bucket(r) for r in range(256)}) == 256
    assert set(Counter(spread_bucket(r) for r in range(8192)).values()) == {32}
    assert key(7, "rank_00003.0001.bin") == f"ranks/{spread_bucket(3)}/{step_dirname(7)}/rank_00003.0001.bin"
    assert key(7, MARKER) == f"{step_dirname(7)}/{MARKER}"


def test_each_ranks_files_go_under_its_bucket_and_the_marker_under_the_step(tmp_path):
    tier = ObjectTier(f"file://{tmp_path}/run")
    tier.open()
    files = {f"rank_{r:05d}.{n}": bytes([r]) * (r + 1) for r in range(20) for n in ("0000.bin", "manifest.json")}
    tier.write_files(4, files)
    assert tier.list_steps() == {4: False}  # no marker yet: the step is found in the buckets
    tier.write_marker(4, b"not a marker")
    assert files_under(tmp_path / "run") == {key(4, n) for n in [*files, MARKER]}
    assert tier.list_steps() == {4: True}
    assert tier.file_sizes(4) == {**{n: len(b) for n, b in files.items()}, MARKER: 12}
    assert tier.sizes_of(4, ["rank_00019.0000.bin", "rank_00002.0000.bin"]) == \
        {"rank_00019.0000.bin": 20, "rank_00002.0000.bin": 3}

    fresh = ObjectTier(f"file://{tmp_path}/run")  # knows nothing of step 4: its marker is no tierfs marker
    assert bytes(fresh.read_file(4, "rank_00017.manifest.json")) == bytes([17]) * 18
    fresh.delete_files(4, [MARKER, "rank_00017.0000.bin", "rank_00017.manifest.json"])
    fresh.remove_if_empty(4)  # rank 17's bucket emptied: its folder of the step goes
    assert not (tmp_path / "run" / key(4, "rank_00017.0000.bin")).parent.exists()
    assert tier.list_steps() == {4: False}  # the other ranks' files: still found without the marker
    tier.delete_step(4)
    assert tier.list_steps() == {} and files_under(tmp_path / "run") == set()


# -- steps of format version 2 ----------------------------------------------------------------------------
def model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The shapes tests/data/make_format2.py saved."""
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def crcs(state: dict) -> dict[str, str]:
    """crc32 of every tensor of a restored state, named as tests/data/format2/crc32.json names them."""
    flat = {f"model.{k}": v for k, v in state["model"].items()}
    flat.update({f"optim.state.{p}.{k}": v for p, s in state["optim"]["state"].items() for k, v in s.items()})
    return {k: f"{zlib.crc32(v.detach().reshape(-1).contiguous().view(torch.uint8).numpy()):08x}"
            for k, v in flat.items()}


def restore_format2(url: str, opts: dict | None, ram: str, step: int) -> dict[str, str]:
    model, opt = model_and_optimizer()
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    with CheckpointManager([MemoryTier(ram), ObjectTier(url, opts, keep=LatestN(2))]) as mgr:
        assert mgr.restore(state, step=step) == step
        assert mgr.last_restore_info.tier == ObjectTier(url, opts).name
    return crcs(state)


@pytest.fixture
def format2(tmp_path) -> Path:
    """A copy of the version-2 steps, in a directory of the test's own (private, as tiers want it)."""
    root = tmp_path / "format2"
    shutil.copytree(FORMAT2 / "run", root)
    for p in [root, *root.rglob("*")]:
        p.chmod(0o700 if p.is_dir() else 0o600)
    return root


def test_a_step_written_in_the_flat_layout_restores_bit_exact_and_the_cli_reads_it(format2, shm_dir, capsys):
    want = json.loads((FORMAT2 / "crc32.json").read_text())
    assert Marker.from_bytes((format2 / step_dirname(2) / MARKER).read_bytes()).version == 2
    assert restore_format2(f"file://{format2}", None, shm_dir, 2) == want["2"]
    assert main(["ls", f"file://{format2}"]) == 0
    table = [line.split() for line in capsys.readouterr().out.splitlines()[2:]]
    assert [row[:4] for row in table] == [["1", "committed", "3", "41.7"], ["2", "committed", "3", "41.7"]]
    assert main(["verify", f"file://{format2}", "--step", "1"]) == 0
    assert "file (object): step 1: OK" in capsys.readouterr().out


def test_new_steps_beside_old_ones_use_the_spread_layout_and_retention_removes_old_ones_whole(format2, shm_dir):
    model, opt = model_and_optimizer()
    msd, osd = get_state_dict(model, opt)
    obj = ObjectTier(f"file://{format2}", keep=LatestN(2))
    with CheckpointManager([MemoryTier(shm_dir), obj]) as mgr:
        mgr.save(3, {"model": msd, "optim": osd})
        mgr.wait_until_finished()
        assert mgr.store.steps()[3] == ["ram", "file"]
    # step 1 (version 2) dropped by retention: none of its files is left; step 2 (version 2) and 3 (version 3)
    assert obj.list_steps() == {2: True, 3: True}
    left = files_under(format2)
    assert not any(step_dirname(1) in f for f in left), left
    assert {f for f in left if step_dirname(3) in f} == {key(3, MARKER), key(3, "rank_00000.0000.bin"),
                                                          key(3, "rank_00000.manifest.json")}
    assert Marker.from_bytes((format2 / key(3, MARKER)).read_bytes()).version == 3


def test_cp_of_a_flat_step_writes_it_in_the_spread_layout(format2, tmp_path, shm_dir, capsys):
    dst = tmp_path / "copy"
    assert main(["cp", f"file://{format2}", f"file://{dst}", "--step", "2"]) == 0, capsys.readouterr().err
    assert Marker.from_bytes((dst / key(2, MARKER)).read_bytes()).version == 3  # the layout it is in now
    assert (dst / key(2, "rank_00000.0000.bin")).exists()
    want = json.loads((FORMAT2 / "crc32.json").read_text())
    assert restore_format2(f"file://{dst}", None, shm_dir, 2) == want["2"]


def test_a_flat_step_on_s3_restores_bit_exact_and_verifies(format2, s3_url, shm_dir, capsys):
    s3fs = pytest.importorskip("s3fs")
    url, opts = s3_url
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **opts)
    root = url.removeprefix("s3://")
    for f in files_under(format2):
        fs.pipe_file(f"{root}/{f}", (format2 / f).read_bytes())
    want = json.loads((FORMAT2 / "crc32.json").read_text())
    assert restore_format2(url, opts, shm_dir, 1) == want["1"]
    so = json.dumps(opts)
    assert main(["verify", url, "--storage-options", so]) == 0
    assert "step 2: OK" in capsys.readouterr().out
