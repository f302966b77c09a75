"""``benchmarks/bench_save_cpu.py`` at a tiny size: two revisions (the last commit and the working tree) interleaved,
each a job of two ranks saving a small GPT's state, and a report with each thread's CPU per
save."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_save_cpu_run_reports_each_revision_and_tier(tmp_path) -> None:
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_save_cpu.py"), "--revs", "HEAD,.",
                          "--tiers", "peer", "--runs", "1", "--saves", "2", "--gap", "0.01", "--d-model", "32",
                          "--layers", "1", "--vocab", "64", "--seq", "8", "--no-write"],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line.split(" | ")[:3] for line in out.stdout.splitlines() if line.startswith("| `")]
    assert [r[:2] for r in rows] == [["| `HEAD`", "peer"], ["| `.`", "peer"]], out.stdout
    assert all(float(r[2]) > 0 for r in rows), rows  # every save took some CPU
    header = next(line for line in out.stdout.splitlines() if line.startswith("| revision | tier |"))
    assert "tierfs-commit" in header and "tierfs-copy-peer" in header and "MainThread" in header
    assert "Per round and rank, every thread's ms per save: `HEAD peer` " in out.stdout
