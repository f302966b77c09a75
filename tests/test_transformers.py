"""The Hugging Face Trainer adapter: checkpoints become tierfs steps; a killed job resumes bit-exactly."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from _ports import free_port

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tierfs.format import MARKER, step_dirname  # noqa: E402

CHILD = Path(__file__).parent / "children" / "hf_child.py"
ROOT = Path(__file__).resolve().parent.parent
MAX_STEPS = 12


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", TIERFS_EXIT_TIMEOUT="60")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE"):
        env.pop(k, None)
    env.update(extra)
    return env


def _cfg(base: Path, **kw: Any) -> dict[str, Any]:
    cfg = {"ram": str(base / "ram"), "obj": str(base / "obj"), "out": str(base / "out"), "every": 3,
           "max_steps": MAX_STEPS, "tiered": True}
    cfg.update(kw)
    return cfg


def _run(cfg: dict[str, Any], timeout: float = 120, **env: str) -> None:
    p = subprocess.run([sys.executable, str(CHILD), json.dumps(cfg)], env=_env(**env), capture_output=True,
                       text=True, timeout=timeout)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]


def _committed(tier_dir: str, step: int) -> bool:
    return (Path(tier_dir) / step_dirname(step) / MARKER).exists()


def _assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["step"] == b["step"]
    ma, mb = a["model"], b["model"]
    assert ma.keys() == mb.keys()
    for k in ma:
        assert torch.equal(ma[k], mb[k]), k
    oa, ob = a["optimizer"], b["optimizer"]
    assert oa["param_groups"] == ob["param_groups"]
    assert oa["state"].keys() == ob["state"].keys()
    for i in oa["state"]:
        for k, v in oa["state"][i].items():
            w = ob["state"][i][k]
            assert torch.equal(v, w) if isinstance(v, torch.Tensor) else v == w, (i, k)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """An uninterrupted run without tierfs."""
    base = tmp_path_factory.mktemp("hf_ref")
    _run(_cfg(base, tiered=False, result=str(base / "result.pt")))
    return torch.load(base / "result.pt", weights_only=False)


def test_import_is_lazy() -> None:
    code = "import sys, tierfs, tierfs.adapters; assert 'transformers' not in sys.modules, 'imported'"
    subprocess.run([sys.executable, "-c", code], env=_env(), check=True)


def test_kill_then_resume_from_ram_and_from_object(tmp_path: Path, reference: dict[str, Any]) -> None:
    """SIGKILL after step 7 committed (the object tier holds step 6): a new process resumes through the
    helper from RAM (step 7), and another, with RAM and output_dir wiped, from the object tier (step 6);
    both end with the reference's weights and optimizer state, bit for bit."""
    a = tmp_path / "a"
    cfg = _cfg(a, hang_at=7)
    p = subprocess.Popen([sys.executable, str(CHILD), json.dumps(cfg)], env=_env(), stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 90
        while not (_committed(cfg["ram"], 7) and _committed(cfg["obj"], 6)):
            assert p.poll() is None, f"child ended early: {p.stdout.read() if p.stdout else ''}"
            assert time.monotonic() < deadline, "no commit of step 7 to RAM and step 6 to the object tier"
            time.sleep(0.05)  # polling the tiers, not a synchronisation
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    assert not _committed(cfg["ram"], 8) and not _committed(cfg["obj"], 9)
    b = tmp_path / "b"
    shutil.copytree(a, b, symlinks=True)

    # resume on the same node: RAM serves step 7
    _run(_cfg(a, resume=True, result=str(a / "result.pt")))
    got = torch.load(a / "result.pt", weights_only=False)
    assert got["resume"] == str(a / "out" / "checkpoint-7")
    _assert_same(got, reference)

    # a new node: no RAM tier content and no output_dir; the object tier serves step 6
    shutil.rmtree(b / "ram")
    shutil.rmtree(b / "out")
    _run(_cfg(b, resume=True, result=str(b / "result.pt")))
    got = torch.load(b / "result.pt", weights_only=False)
    assert got["resume"] == str(b / "out" / "checkpoint-6")
    _assert_same(got, reference)


def _fake_save(cb: Any, out: Path, step: int, files: dict[str, bytes]) -> None:
    d = out / f"checkpoint-{step}"
    for rel, data in files.items():
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_bytes(data)
    args = SimpleNamespace(output_dir=str(out), should_save=True)
    state = SimpleNamespace(global_step=step, best_model_checkpoint=None)
    cb.on_init_end(args, state, None)
    cb.on_save(args, state, None)


def test_resume_path_repairs_and_fetches(tmp_path: Path) -> None:
    """Files are stored as bytes; resume_path keeps matching local files, rewrites a damaged or missing
    one, and fetches a whole checkpoint from the object tier when RAM and output_dir are gone; the first
    tier's keep policy prunes output_dir."""
    from tierfs.adapters.transformers import TieredTrainerCallback, latest_checkpoint
    from tierfs.policies import FixedIntervalPolicy
    from tierfs.tiers import MemoryTier, ObjectTier

    out = tmp_path / "out"

    def tiers() -> list[Any]:
        return [MemoryTier(tmp_path / "ram"), ObjectTier(f"file://{tmp_path}/obj", save=FixedIntervalPolicy(2))]

    files = {"model.safetensors": os.urandom(5000), "optimizer.pt": os.urandom(3 << 20), "empty.bin": b"",
             "rng_state_0.pth": b"rng", "trainer_state.json": b"{}", "sub/dir/x.json": b"[1]"}
    cb = TieredTrainerCallback(tiers(), background_bandwidth=None, block_size=1 << 20)
    assert cb.resume_path(out) is None
    for step in (1, 2, 3, 4):
        _fake_save(cb, out, step, {**files, "trainer_state.json": str(step).encode()})
    cb.store.wait_until_finished()  # the RAM tier lets step 2 go once its copy to the object tier is done
    _fake_save(cb, out, 5, {**files, "trainer_state.json": b"5"})
    cb.store.wait_until_finished()
    assert sorted(cb.store.steps()) == [2, 4, 5]
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-4", "checkpoint-5"]  # RAM keeps 2
    d4 = out / "checkpoint-5"
    before = {p: p.stat().st_mtime_ns for p in d4.rglob("*") if p.is_file()}
    assert cb.resume_path() == str(d4)
    assert before == {p: p.stat().st_mtime_ns for p in d4.rglob("*") if p.is_file()}  # nothing rewritten
    (d4 / "optimizer.pt").write_bytes(b"x" + files["optimizer.pt"][1:])
    (d4 / "sub/dir/x.json").unlink()
    assert cb.resume_path() == str(d4)
    assert (d4 / "optimizer.pt").read_bytes() == files["optimizer.pt"]
    assert (d4 / "sub/dir/x.json").read_bytes() == b"[1]"
    cb.close()

    shutil.rmtree(tmp_path / "ram")
    shutil.rmtree(out)
    path = latest_checkpoint(tiers(), out, background_bandwidth=None)
    assert path == str(out / "checkpoint-4")  # the object tier's newest
    got = {p.relative_to(path).as_posix(): p.read_bytes() for p in Path(path).rglob("*") if p.is_file()}
    assert got == {**files, "trainer_state.json": b"4"}


def _run2(cfg: dict[str, Any]) -> None:
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, str(CHILD), json.dumps(cfg)],
                              env=_env(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                                       MASTER_ADDR="127.0.0.1", MASTER_PORT=port),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    for p, o in zip(procs, outs):
        assert p.returncode == 0, o[-6000:]


def test_two_processes(tmp_path: Path) -> None:
    """torch.distributed (gloo), 2 ranks sharing output_dir and the RAM tier: each rank's rng_state file
    is in its own shard; a resume with RAM and output_dir wiped gets both from the object tier and ends
    where the uninterrupted 2-rank run ended."""
    full = tmp_path / "full"
    _run2(_cfg(full, max_steps=6, every=4, result=str(full / "result.pt")))
    from tierfs.tiers import ObjectTier
    from tierfs.protocol import checked_manifest

    obj = ObjectTier(f"file://{full}/obj")
    obj.open()
    try:
        names = [sorted(e.name for e in checked_manifest(obj, 4, r)[0].entries) for r in range(2)]
    finally:
        obj.close()
    assert names[1] == ["rng_state_1.pth"]
    assert "rng_state_0.pth" in names[0] and "model.safetensors" in names[0] and "rng_state_1.pth" not in names[0]

    shutil.rmtree(full / "ram")
    shutil.rmtree(full / "out")
    resumed = tmp_path / "resumed"
    shutil.copytree(full, resumed)
    _run2(_cfg(resumed, max_steps=6, every=4, resume=True, result=str(resumed / "result.pt")))
    got = torch.load(resumed / "result.pt", weights_only=False)
    assert got["resume"] == str(resumed / "out" / "checkpoint-4")
    # checkpoint-4 was fetched, then pruned once the RAM tier (keep latest 2) dropped step 4
    assert sorted(p.name for p in (resumed / "out").iterdir()) == ["checkpoint-5", "checkpoint-6"]
    assert sorted(p.name for p in (resumed / "out" / "checkpoint-6").glob("rng_state_*")) == [
        "rng_state_0.pth", "rng_state_1.pth"]
    _assert_same(got, torch.load(full / "result.pt", weights_only=False))
