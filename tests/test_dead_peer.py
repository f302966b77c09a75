"""A peer that dies mid-replication is noticed as soon as its connections drop, and one that stops answering
within one timeout for the whole replication; either way every other rank's next call names exactly that
rank and the stage, and the survivors close and exit cleanly.

A real job of 3 processes (gloo on localhost, each its own node with its own RAM directory under
/dev/shm), a RAM tier and ``PeerTier(replicas=1)``: rank 1 is struck in the ``transfer`` test hook, as it
is about to send its first bytes of step 2 to its peer (tests/children/dead_peer_child.py).
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import gloo_job

HERE = Path(__file__).parent
CHILDREN = HERE / "children"
CHILD = CHILDREN / "dead_peer_child.py"
VICTIM = 1
STAGE = "replication of step 2 on peer"


def run(shm: str, mode: str, timeout: float) -> tuple[dict[int, dict], dict[int, int]]:
    """Every survivor's JSON line and every rank's exit status."""
    procs = gloo_job.start_job(3, CHILD, shm, str(VICTIM), mode, str(timeout))
    outs, codes = {}, {}
    try:
        for r, p in enumerate(procs):
            if r != VICTIM:
                out, err = p.communicate(timeout=120)
                codes[r] = p.returncode
                assert p.returncode == 0, f"rank {r} exited with {p.returncode} after a clean close: {err[-3000:]}"
                outs[r] = json.loads(out.strip().splitlines()[-1])
    finally:
        for p in procs:  # the victim: dead already, or stuck (it never returns)
            if p.poll() is None:
                p.kill()
            p.communicate()
    codes[VICTIM] = procs[VICTIM].returncode
    return outs, codes


def test_a_peer_killed_mid_replication_is_named_by_every_rank_at_once(shm_dir):
    timeout = 120.0  # far past anything the test waits: only the dropped connections can end the waits
    outs, codes = run(shm_dir, "kill", timeout)
    assert codes[VICTIM] == -signal.SIGKILL
    for r, o in outs.items():
        kind, message, cause, ranks, stage = o["error"]
        print(f"rank {r} raised {o['after']:.3f} s after rank {VICTIM} was killed: {message}")
        assert kind == "BackgroundError" and cause == "RankWaitError", o
        assert ranks == [VICTIM] and stage == STAGE, o  # exactly the dead rank, and the stage
        assert f"{STAGE}: rank(s) [{VICTIM}] is gone" in message, message
        assert "did not arrive" not in message, message  # its connection dropped: not a timeout
        assert o["after"] < timeout / 4, o  # noticed as the connection dropped, far from the timeout
    assert set(codes.values()) == {0, -signal.SIGKILL}  # the survivors closed and exited cleanly


def test_a_peer_that_stops_answering_mid_replication_costs_one_timeout(shm_dir):
    """The replication is several rounds of messages and two agreements: their waits share one deadline,
    so a rank that stops answering costs the others one timeout (plus a short grace), not one per wait."""
    timeout = 3.0
    outs, codes = run(shm_dir, "hang", timeout)
    for r, o in outs.items():
        kind, message, cause, ranks, stage = o["error"]
        print(f"rank {r} raised {o['after']:.3f} s after rank {VICTIM} stopped answering: {message}")
        assert kind == "BackgroundError" and cause == "RankWaitError", o
        assert ranks == [VICTIM] and stage == STAGE, o
        assert message.count("within 3 s") == 1 and f"rank(s) [{VICTIM}] did not arrive" in message, message
        assert "gone" not in message, message  # no rank that gave up waiting is taken for a dead one
        assert timeout - 0.5 < o["after"] < 2 * timeout, o  # one timeout, not one per wait
    assert all(codes[r] == 0 for r in outs)
