"""Run a script as a job of ``world`` processes with torch.distributed (gloo) on localhost.

Each process is its own node (``TIERFS_NODE_RANK`` = rank), as tierfs's multi-node tests want. Every
process must print one JSON line last; the results come back sorted by rank.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from _ports import free_port

HERE = Path(__file__).parent


def start_job(world: int, script: str | Path, *args: str, same_node: bool = False,
              env: dict[str, str | None] | None = None) -> list[subprocess.Popen]:
    """Start the processes; ``same_node``: all are one node (node rank 0, local ranks 0..world-1); ``env``:
    variables to set, or to remove where the value is None."""
    port = free_port()
    procs = []
    for rank in range(world):
        env_r = os.environ | {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                            "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank if same_node else 0),
                            "TIERFS_NODE_RANK": str(0 if same_node else rank),
                            "PYTHONPATH": str(HERE.parent)}
        for k, v in (env or {}).items():
            if v is None:
                env_r.pop(k, None)
            else:
                env_r[k] = v
        procs.append(subprocess.Popen([sys.executable, str(script), *args], stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, env=env_r))
    return procs


def run_job(world: int, script: str | Path, *args: str, timeout: float = 180, same_node: bool = False,
            env: dict[str, str | None] | None = None) -> list[dict]:
    """Run the job to the end; every process must succeed. Results come back sorted by rank."""
    procs = start_job(world, script, *args, same_node=same_node, env=env)
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            assert p.returncode == 0, err[-3000:]
            outs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return sorted(outs, key=lambda o: o["rank"])
