"""``benchmarks/bench_manifest.py`` at a tiny size: a GPT's manifest encoded and parsed with orjson and with
json alone, and written with and without fsync, each a time."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_manifest_run_reports_both_encoders_and_both_writes() -> None:
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_manifest.py"), "--rounds", "1",
                          "--calls", "2", "--no-write"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {line.split(" | ")[0].lstrip("| "): line.strip(" |").split(" | ")[1:]
            for line in out.stdout.splitlines() if line.startswith("| ") and "---" not in line}
    cases = ("orjson (tierfs)", "json alone", "without fsync (tmpfs, tierfs)", "with fsync")
    assert set(rows) >= set(cases), rows
    assert all(float(x) > 0 for k in cases for x in rows[k]), rows
    assert "213 entries" in out.stdout
