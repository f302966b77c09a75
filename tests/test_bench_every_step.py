"""``benchmarks/bench_every_step.py`` at a tiny size: a real training loop on two ranks, each variant in
each round (the verified floor's checksums matching), tierfs saving every step to RAM and peers and every
few steps to S3 (moto), and a report with every figure, py-spy sampling which thread holds the GIL.
tierfs uploads from its helper processes (``--helper``), in a job of two ranks whose copies agree."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_step_run_saves_each_step_and_reports_every_figure(tmp_path) -> None:
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_every_step.py"),
                          "--step-times", "0.02", "--steps", "4", "--rounds", "3", "--upload-every", "2",
                          "--d-model", "64", "--layers", "1", "--vocab", "256", "--seq", "16",
                          "--helper", "--gil-sampling", "--out", str(tmp_path / "result")],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    for variant in ("no checkpoints", "floor", "verified floor", "tierfs"):
        assert f"| {variant} |" in text, variant
    assert "tierfs over the floor:" in text and "the p99 without checkpoints" in text
    assert "tierfs over the verified floor:" in text and "WARNING" not in text
    # py-spy (a dev dependency) sampled which thread held the GIL in every segment
    assert "GIL held, from py-spy's samples" in text, [x for x in text.splitlines() if "GIL held (py-spy)" in x]
    assert "GIL held by tierfs's threads, ms per step: " in text
    assert "full garbage collections in the timed steps" in text
    assert "building the state (" in text and "ms per call" in text
    assert "tierfs over the floor:" in (tmp_path / "result.md").read_text()
    runs = json.loads((tmp_path / "result.json").read_text())
    (run,) = runs
    assert sorted(r["rank"] for r in run) == [0, 1]
    for r in run:
        fig = r["targets"]["0.02"]
        rounds = fig["rounds"]
        assert all(len(rounds[v]) == 3 and all(len(s["times"]) == 4 for s in rounds[v]) for v in rounds)
        assert all(isinstance(s["full_gc"], list) for v in rounds for s in rounds[v])
        assert fig["verified_floor_mismatches"] == 0  # every copy the verified floor sent arrived whole
        assert fig["gil_sampling"] == "py-spy"
        assert all(isinstance(s["gil_held"], dict) for v in rounds for s in rounds[v])  # every segment sampled
        last = fig["last"]
        # tierfs saved its last step to RAM and peers; the last multiple of 2 before it went to S3 too
        assert fig["held"][str(last)] == ["peer", "ram"]
        assert "s3" in fig["held"][str(last - 1)]
    # the training thread and tierfs's threads held the GIL (a few samples a segment: some segment of some
    # rank has them)
    assert any(s["gil_held"].get("MainThread", 0) > 0 for r in run for segs in r["targets"]["0.02"]["rounds"].values()
               for s in segs)
    assert any(k.startswith("tierfs-") for r in run for s in r["targets"]["0.02"]["rounds"]["tierfs"]
               for k in s["gil_held"])
