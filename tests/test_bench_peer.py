"""``benchmarks/bench_peer.py``'s whole run, at a tiny size: every phase runs on both ranks and its report
prints every table (the lost-node phase times some figures on some ranks only, which the report must take)."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_full_run_reports_throughput_training_loop_and_lost_node() -> None:
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_peer.py"), "--size-mib", "1",
                          "--repeats", "1", "--interval", "0.2", "--rounds", "1", "--world", "2"],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    assert "### Throughput per rank" in text
    assert "tierfs replication, unthrottled" in text
    for variant in ("no checkpoints", "RAM only", "RAM + plain socket copy (floor)",
                    "RAM + peers, default throttle", "RAM + peers, unthrottled"):
        assert f"| {variant} |" in text, variant
    assert "### A lost node back" in text
    assert "| own shards |" in text and "| data parallel |" in text
