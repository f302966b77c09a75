"""``benchmarks/bench_streams.py`` at a tiny size: two ranks swap mapped files over gloo, over tierfs's
streams and over a plain socket, every byte compared, and the report gives each variant against the floor."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_streams_run_moves_every_byte_each_way_and_reports_each_variant(tmp_path) -> None:
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_streams.py"), "--mib", "3",
                          "--rounds", "3", "--small", "20", "--out", str(tmp_path / "result")],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    for variant in ("gloo", "streams", "socket floor"):
        assert f"| {variant} |" in out.stdout, variant
    text = (tmp_path / "result.md").read_text()
    assert "streams against gloo: CPU" in text
    for small in ("1-byte exchange, gloo", "1-byte exchange, streams", "all-reduce of 3 integers, gloo"):
        assert f"| {small} |" in text, small
