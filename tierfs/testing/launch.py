"""Run a small multi-process torch.distributed job on this machine, for tests.

The parent side, :func:`run_job`, starts ``world`` processes of ``python -m MODULE ARGS...`` with the
environment torchrun would give them (``MASTER_ADDR``/``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``) and ``TIERFS_NODE_RANK`` set to the rank, so that each process is a
node of its own; it returns the JSON line every rank printed last. If a rank fails, the others are killed
at once; if the job outlives its timeout, every rank is.

The child side, :func:`rank_main`, runs a rank's work and ends the process the way a gloo job must:

    def work() -> dict:
        dist.init_process_group("gloo")
        ...
        return {"rank": dist.get_rank(), ...}

    if __name__ == "__main__":
        rank_main(work)
"""

from __future__ import annotations

import json
import os
import queue
import socket
import subprocess
import sys
import threading
import time
import traceback
from typing import Any, Callable, Mapping, NoReturn, Sequence

__all__ = ["JobError", "finish", "rank_main", "run_job"]

#: characters of a rank's stderr quoted in a JobError
STDERR_TAIL = 4000


class JobError(AssertionError):
    """A rank failed, printed no JSON line, or the job did not finish in time (an AssertionError, so
    that pytest reports it as a failed check)."""


def run_job(world: int, module: str, args: Sequence[str] = (), *, timeout: float = 120.0,
            env: Mapping[str, str] | None = None) -> list[dict[str, Any]]:
    """Run ``python -m module *args`` as a job of ``world`` ranks, each its own node, to its end.

    Parameters
    ----------
    world:
        Number of processes (ranks).
    module:
        Module every rank runs (``python -m``); it must print one JSON object as its last line of stdout
        and exit 0 (see :func:`rank_main`).
    args:
        Command-line arguments, the same for every rank.
    timeout:
        Seconds the whole job may run; past it every rank still running is killed.
    env:
        Extra environment variables for every rank.

    Returns
    -------
    list[dict]
        Every rank's JSON object, in rank order.

    Raises
    ------
    JobError
        When a rank exits non-zero or prints no JSON line (the others are killed at once), or when the job
        outlives ``timeout``; the message quotes the ranks' stderr.

    Notes
    -----
    The ranks find modules where this process does: its ``sys.path`` is passed as ``PYTHONPATH``.
    """
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    path = os.pathsep.join([p for p in sys.path if p] + [os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    base = {**os.environ, **(env or {}), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "WORLD_SIZE": str(world), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "PYTHONPATH": path}
    procs = [subprocess.Popen([sys.executable, "-m", module, *args], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True,
                              env={**base, "RANK": str(r), "TIERFS_NODE_RANK": str(r)})
             for r in range(world)]
    ended: queue.Queue[tuple[int, int, str, str]] = queue.Queue()

    def wait(rank: int, p: subprocess.Popen) -> None:
        out, err = p.communicate()
        ended.put((rank, p.returncode, out, err))

    waiters = [threading.Thread(target=wait, args=(r, p), daemon=True) for r, p in enumerate(procs)]
    for w in waiters:
        w.start()
    results: dict[int, dict[str, Any]] = {}
    errs: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    problem = None
    while len(results) < world and problem is None:
        try:
            rank, rc, out, err = ended.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            problem = f"the job of {world} ranks ({module}) did not finish within {timeout:g} s"
            break
        errs[rank] = err
        line = out.strip().splitlines()[-1] if out.strip() else ""
        if rc != 0:
            problem = f"rank {rank} of {world} ({module}) exited with {rc}"
        else:
            try:
                results[rank] = json.loads(line)
            except ValueError:
                problem = f"rank {rank} of {world} ({module}) printed no JSON line last: {line[-200:]!r}"
    if problem is not None:
        killed = [r for r, p in enumerate(procs) if p.poll() is None]
        for r in killed:
            procs[r].kill()
        for w in waiters:
            w.join()
        while not ended.empty():
            rank, rc, _, err = ended.get()
            errs[rank] = err
        tails = "".join(f"\n--- rank {r} stderr ---\n{errs[r][-STDERR_TAIL:]}" for r in sorted(errs) if errs[r])
        raise JobError(f"{problem}{f'; killed ranks {killed}' if killed else ''}{tails}")
    return [results[r] for r in range(world)]


def finish(out: Mapping[str, Any]) -> NoReturn:
    """Leave the job, print ``out`` as the rank's JSON line and exit 0 at once.

    The interpreter's own teardown is skipped: torch's gloo teardown at exit aborts now and then
    ("terminate called without an active exception") after all the work is done, which would fail a job
    for nothing it did. Close stores and tiers before calling this.
    """
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    print(json.dumps(out), flush=True)
    sys.stderr.flush()
    os._exit(0)


def rank_main(work: Callable[[], Mapping[str, Any]]) -> NoReturn:
    """Run one rank's ``work`` and end the process: :func:`finish` with its result, or, if it raised,
    the traceback on stderr and exit status 1 (:func:`run_job` then kills the other ranks)."""
    try:
        out = work()
    except BaseException:  # noqa: BLE001 - every failure ends the rank with its traceback
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    finish(out)
