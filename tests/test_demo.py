"""`make demo` (examples/demo.py) tells its story and nothing else, and still fails loudly on a real error.

Both tests run the demo as `make demo` does: the venv's python (this interpreter), cwd the repository root.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "examples" / "demo.py"


def run_demo(*args: str, timeout: float = 280) -> tuple[int, str, str]:
    p = subprocess.run([sys.executable, str(DEMO), *args], cwd=ROOT, capture_output=True, text=True,
                       timeout=timeout, env=os.environ | {"PYTHONUNBUFFERED": "1"})
    return p.returncode, p.stdout, p.stderr


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_demo_tells_its_story_without_tracebacks() -> None:
    rc, out, err = run_demo()
    both = out + err
    assert rc == 0, both
    assert "Traceback" not in both, both
    assert "[rank" not in err and "GLHF" not in both, both  # torch's prefixed excepthook, gloo's errors
    assert err.strip() == "", err  # the story goes to stdout; nothing else is printed
    assert out.rstrip().splitlines()[-1].startswith("demo passed in "), out

    # the saves, per tier, with timings in human units
    assert re.search(r"each rank's shard is [\d.]+ KiB", out), out
    for tier, what in (("ram", r"18 saves \(steps 2-36\)"), ("peer", r"18 copies \(steps 2-36\)"),
                       ("object", r"1 upload \(step 20\)")):
        assert re.search(rf"^    {tier} +{what} +[\d.]+ ms \[[\d.]+ ms\]", out, re.M), (tier, out)
    assert "tiers at the crash: step 20: object, step 34: ram, step 36: ram+peer" in out, out
    assert " MB" not in out, out  # binary units only

    # the injected failure: one line per rank, the victim first
    failure = out.split("== Injected failure: node 2 dies at step 37 (SIGKILL) ==\n", 1)[1].split("\n\n", 1)[0]
    lines = failure.splitlines()
    assert lines[0] == "  rank 2: lost its node (SIGKILL at step 37, as planned)", failure
    for r, line in zip((0, 1, 3), lines[1:4]):
        assert re.match(rf"  rank {r}: stopped(,| by the launcher,) as expected: .*rank 2", line), failure
    assert "the launcher tears the job down" in lines[4], failure

    # where each rank's state came from, and how fast
    s1 = out.split("== Scenario 1:", 1)[1].split("== Scenario 2:", 1)[0]
    s2 = out.split("== Scenario 2:", 1)[1]
    assert "every rank restored step 36, so the job redoes step 37" in s1, s1
    for r in (0, 1, 3):
        assert re.search(rf"rank {r}: ram tier, its own RAM \(node {r}\) +[\d.]+ KiB in +[\d.]+ ms", s1), s1
    assert re.search(r"rank 2: peer tier, from rank 3's RAM \(node 3\) +[\d.]+ KiB in +[\d.]+ ms", s1), s1
    assert "every rank restored step 20, so the job redoes steps 21-37" in s2, s2
    for r in range(4):
        assert re.search(rf"rank {r}: object tier +[\d.]+ KiB in +[\d.]+ ms", s2), s2

    # bit-exactness, in both scenarios
    exact = "final weights of ranks 0-3 bitwise equal to an uninterrupted run: [True, True, True, True]"
    assert s1.count(exact) == 1 and s2.count(exact) == 1, out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_demo_shows_an_unexpected_error_and_fails() -> None:
    rc, out, err = run_demo("--inject-bug", "1")
    assert rc != 0, out + err
    assert "!! the job failed in a way the demo did not plan" in out, out
    # the failing rank's own stderr, traceback and all
    assert "rank 1 (" in out and "the first to fail); its stderr:" in out, out
    assert "Traceback" in out and "RuntimeError: a bug nobody planned (--inject-bug 1, step 5)" in out, out
    assert "Injected failure" not in out, out  # the planned crash never came
    assert "Scenario 1" not in out, out  # a failed run stops the demo
    assert out.rstrip().splitlines()[-1].startswith("demo FAILED in "), out
