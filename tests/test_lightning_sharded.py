"""TieredModelParallelStrategy: real Lightning, CPU, 2 processes (gloo), FSDP2 ``fully_shard``."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("lightning")

from _steps import committed  # noqa: E402

CHILD = str(Path(__file__).parent / "children" / "lightning_sharded_child.py")
ROOT = str(Path(__file__).resolve().parents[1])


def _run(cfg, cwd, timeout=120):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, CHILD, json.dumps(cfg)], env=env, capture_output=True, text=True,
                       timeout=timeout, cwd=str(cwd))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    with open(cfg["out"] + ".json") as f:
        return json.load(f)


def _flat(d, p=""):
    if isinstance(d, dict):
        return {k: v for key, val in d.items() for k, v in _flat(val, f"{p}/{key}").items()}
    if isinstance(d, list):
        return {k: v for i, val in enumerate(d) for k, v in _flat(val, f"{p}/{i}").items()}
    return {p: d}


def _assert_equal(a_path, b_path):
    a, b = (_flat(torch.load(x, weights_only=True)) for x in (a_path, b_path))
    assert a.keys() == b.keys()
    bad = [k for k in a if not (torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k])]
    assert not bad, bad


def test_sharded_kill_and_resume_end_where_an_uninterrupted_run_ends(tmp_path, shm_dir):
    """RAM saves every step, the object tier every 2nd; the job (both ranks) is SIGKILLed mid-run; resumed
    from RAM and then, RAM wiped, from the object tier, it ends bit-exact where an uninterrupted run ends."""
    t, total = tmp_path, 6
    _run({"ram": str(shm_dir) + "-ref", "obj": (t / "objref").as_uri(), "ckpt_dir": str(t / "ckref"),
          "max_steps": total, "out": str(t / "ref.pt")}, t)
    tiered = {"ram": str(shm_dir), "obj": (t / "obj").as_uri(), "ckpt_dir": str(t / "ck"), "max_steps": total}
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.Popen([sys.executable, CHILD, json.dumps({**tiered, "sleep": 0.5, "out": str(t / "killed.pt")})],
                         env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=str(t), start_new_session=True)
    deadline = time.time() + 90
    try:
        while True:  # until RAM holds step 3 and the object tier step 2 (committed, by listing)
            assert p.poll() is None, p.stderr.read().decode()[-3000:]
            assert time.time() < deadline, "no step committed in time"
            steps = committed(str(shm_dir), tiered["obj"])
            if 3 in steps and any(s >= 2 and "file" in tiers for s, tiers in steps.items()):
                break
            time.sleep(0.05)
    finally:
        os.killpg(p.pid, signal.SIGKILL)  # both ranks (Lightning started rank 1 from this process)
        p.wait()
    assert not (t / "killed.pt").exists()
    steps = committed(str(shm_dir), tiered["obj"])
    newest = max(steps)
    step = max(s for s, tiers in steps.items() if "file" in tiers)  # the object tier's newest, before resuming
    assert newest < total
    got = _run({**tiered, "out": str(t / "resumed.pt"), "resume": str(t / "ck" / "last.ckpt")}, t)
    assert got["restored"] == {"step": newest, "sources": {"0": "ram"}}
    _assert_equal(t / "resumed.pt", t / "ref.pt")
    for f in Path(shm_dir).iterdir():  # another machine: RAM is empty, the object tier serves
        subprocess.run(["rm", "-rf", str(f)], check=True)
    got = _run({**tiered, "out": str(t / "resumed2.pt"), "resume": str(t / "ck" / f"epoch={step - 1}-step={step}.ckpt")},
               t)
    assert got["restored"]["step"] == step and got["restored"]["sources"]["0"] == "file"
    _assert_equal(t / "resumed2.pt", t / "ref.pt")
