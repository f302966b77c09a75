"""A peer SIGKILLed in the middle of its replica (after its first message, halfway, before its last) is
named by every other rank as soon as its connections drop, whatever the job's size: exactly that rank,
and the stage, never a live rank that was exchanging with it, and never at the timeout.

A real job (gloo on localhost, each rank its own node with its own RAM directory under /dev/shm), a RAM
tier and ``PeerTier(replicas=1)`` whose replicas move in many small messages; rank 1 kills itself in the
``transfer`` test hook (tests/children/peer_kill_child.py). The store's timeout is far past anything the
test waits, so only the dead rank's dropped connections can end the survivors' waits.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

import gloo_job

CHILD = Path(__file__).parent / "children" / "peer_kill_child.py"
VICTIM = 1
STAGE = "replication of step 3 on peer"
TIMEOUT = 120.0


def run(shm: str, world: int, where: str) -> tuple[dict[int, dict], int | None]:
    """Every survivor's JSON line, and the victim's exit status."""
    procs = gloo_job.start_job(world, CHILD, shm, str(VICTIM), where, str(TIMEOUT))
    outs = {}
    try:
        for r, p in enumerate(procs):
            if r != VICTIM:
                out, err = p.communicate(timeout=TIMEOUT + 60)
                assert p.returncode == 0, f"rank {r} exited with {p.returncode}: {err[-3000:]}"
                outs[r] = json.loads(out.strip().splitlines()[-1])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.communicate()
    return outs, procs[VICTIM].returncode


@pytest.mark.parametrize("world", [3, 4])
@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_a_peer_killed_mid_replica_is_named_by_every_survivor(shm_dir, world, where):
    outs, victim_code = run(shm_dir, world, where)
    assert victim_code == -signal.SIGKILL
    live = [r for r in range(world) if r != VICTIM]
    assert sorted(outs) == live
    for r, o in outs.items():
        assert o["error"] is not None, f"rank {r} raised nothing"
        kind, message, cause, ranks, stage = o["error"]
        print(f"{world} ranks, killed at the {where} message: rank {r} raised {o['after']:.3f} s after the "
              f"kill: {message}")
        assert kind == "BackgroundError" and cause == "RankWaitError", o
        assert ranks == [VICTIM] and stage == STAGE, o  # exactly the dead rank, and the stage
        assert f"{STAGE}: rank(s) [{VICTIM}] is gone" in message, message
        for other in live:
            assert f"[{other}" not in message and f", {other}]" not in message, message  # no live rank
        assert "did not arrive" not in message, message  # its connections dropped: not a timeout
