"""TieredModelParallelStrategy: real Lightning, CPU, 2 processes (gloo), FSDP2 ``fully_shard``."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("lightning")

CHILD = str(Path(__file__).with_name("lightning_sharded_child.py"))
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


def test_sharded_save_resume_bit_exact(tmp_path, shm_dir):
    t = tmp_path
    tiered = {"ram": str(shm_dir), "obj": (t / "obj").as_uri(), "ckpt_dir": str(t / "ck")}
    first = _run({**tiered, "max_steps": 3, "out": str(t / "a.pt")}, t)
    assert first["last"] == str(t / "ck" / "last.ckpt")
    assert not (t / "ck").exists()  # nothing written at Lightning's paths
    second = _run({**tiered, "max_steps": 5, "out": str(t / "b.pt"), "resume": first["last"]}, t)
    assert second["restored"] == {"step": 3, "sources": {"0": "ram"}}  # rank 0 read its shard from RAM
    _assert_equal(t / "b.pt.start", t / "a.pt")  # the restored states are the saved ones, bit for bit
    # Lightning's own ModelParallelStrategy (DCP directories + meta.pt) on the same schedule ends identical
    plain = {"plain": 1, "ram": "", "obj": "", "ckpt_dir": str(t / "pck")}
    _run({**plain, "max_steps": 3, "out": str(t / "pa.pt")}, t)
    _run({**plain, "max_steps": 5, "out": str(t / "pb.pt"), "resume": str(t / "pck" / "last.ckpt")}, t)
    _assert_equal(t / "b.pt", t / "pb.pt")
