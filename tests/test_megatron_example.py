"""examples/megatron_gpt.py, a real Megatron GPTModel with Megatron's DDP and optimizer, as a user runs it.

Each phase is a 2-process job on one node, with the environment ``torchrun --nproc-per-node 2`` gives its
ranks (gloo, CPU), the object tier on the moto S3 server. The example prints, with ``--digest``, sha256
digests of the model's and the optimizer's state gathered whole, at every save (the state it saves) and
after every resume (what the model and the optimizer then hold): equal digests are equal bits, at any
layout. Skipped where megatron-core is not installed (Linux: the dev extra installs it).
"""

from __future__ import annotations

import importlib.util
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from _ports import free_port

if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
    pytest.skip("megatron-core is not installed", allow_module_level=True)

from tierfs import TieredStore  # noqa: E402
from tierfs.tiers import MemoryTier, ObjectTier  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "megatron_gpt.py"
CHILD = ROOT / "tests" / "children" / "megatron_gpt_child.py"
TIMEOUT = 240  # seconds a phase may take on a loaded machine (a guard against a hang, not a measurement)


def start(script: Path, args: list[str], logs: Path) -> list[subprocess.Popen]:
    """The job's 2 ranks, as torchrun starts them on one node (each rank's stderr to a file in ``logs``)."""
    port = free_port()
    logs.mkdir(parents=True, exist_ok=True)
    procs = []
    for rank in range(2):
        env = os.environ | {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                            "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2",
                            "GROUP_RANK": "0", "PYTHONPATH": str(ROOT)}
        env.pop("TIERFS_NODE_RANK", None)
        with open(logs / f"rank{rank}.err", "w") as err:
            procs.append(subprocess.Popen([sys.executable, str(script), *args], stdout=subprocess.PIPE,
                                          stderr=err, text=True, env=env, cwd=ROOT))
    return procs


def stderr_of(logs: Path) -> str:
    return "\n".join(f"--- rank {r} ---\n{(logs / f'rank{r}.err').read_text()[-3000:]}" for r in range(2))


def finish(procs: list[subprocess.Popen], args: list[str], logs: Path) -> str:
    """Wait for the job's end; both ranks must succeed. Returns rank 0's output."""
    outs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=TIMEOUT)
            assert p.returncode == 0, f"{args}: exit {p.returncode}\n{out}\n{stderr_of(logs)}"
            outs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return outs[0]


def run(args: list[str], logs: Path) -> str:
    """Run the example to the end; both ranks must succeed. Returns rank 0's output."""
    return finish(start(EXAMPLE, args, logs), args, logs)


def digests(out: str, kind: str) -> dict[int, tuple[str, str]]:
    """``{step: (model digest, optimizer digest)}`` of the ``saved`` or ``loaded`` lines of an output."""
    return {int(s): (m, o) for s, m, o in re.findall(rf"^{kind} step (\d+) model (\w+) optimizer (\w+)", out, re.M)}


def steps_held(ram: Path, url: str, opts: dict) -> dict[int, list[str]]:
    """``{step: [tier names]}`` of the committed steps in the RAM directory and on S3, as a store lists them."""
    store = TieredStore([MemoryTier(str(ram)), ObjectTier(url, opts)], cleanup=False)
    try:
        return store.steps()
    finally:
        store.close()


def resumed(out: str) -> tuple[int, str]:
    m = re.search(r"^resumed step (\d+) from iter_\d+, tiers per rank: (.*)$", out, re.M)
    assert m, out
    return int(m.group(1)), m.group(2)


@pytest.mark.slow
@pytest.mark.s3
@pytest.mark.timeout(600)  # 4 jobs, 8 processes that each import torch and megatron-core: minutes on a loaded machine
@pytest.mark.filterwarnings("ignore:Transformer Engine and Apex:UserWarning")
def test_gpt_killed_mid_run_resumes_bit_exact_from_ram_object_storage_and_at_tp1(shm_dir, tmp_path, s3_url):
    """TP=2, asynchronous saves to RAM every step and to S3 every 3rd. Both ranks SIGKILLed while step 5
    commits: resumed from RAM at step 4, model and optimizer bit-exact, and trained on as the killed run
    did (step 5 again the same bits). With RAM and the checkpoint directories gone: resumed from S3 at
    step 6, bit-exact; and loaded at TP=1 x DP=2, every tensor gathered whole bit-exact, training on there."""
    url, opts = s3_url
    ram, ckpt = Path(shm_dir) / "ram", tmp_path / "ckpt"

    def example_args(ram: Path, ckpt: Path, *more: str) -> list[str]:
        return ["--ram", str(ram), "--ckpt", str(ckpt), "--object", url, "--endpoint-url", opts["endpoint_url"],
                "--digest", *more]

    # the job is killed mid-run: both ranks stop in step 5's commit (they say so on stdout), then SIGKILL
    logs = tmp_path / "killed"
    procs = start(CHILD, ["5", *example_args(ram, ckpt, "--tp", "2", "--steps", "8")], logs)
    lines: queue.Queue = queue.Queue()
    outs: list[list[str]] = [[], []]

    def read(rank: int, p: subprocess.Popen) -> None:
        for line in p.stdout:
            outs[rank].append(line)
            lines.put((rank, line))
        lines.put((rank, None))  # the rank's stdout closed: it exited

    readers = [threading.Thread(target=read, args=(rank, p), daemon=True) for rank, p in enumerate(procs)]
    for t in readers:
        t.start()
    paused = set()
    try:
        while paused != {0, 1}:
            rank, line = lines.get(timeout=TIMEOUT)
            assert line is not None, f"rank {rank} exited before step 5\n{''.join(outs[0])}\n{stderr_of(logs)}"
            if line.strip() == "paused at step 5":
                paused.add(rank)
        for p in reversed(procs):  # rank 1 first, then rank 0: the whole job goes down with its node
            p.send_signal(signal.SIGKILL)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, t in zip(procs, readers):
        assert p.wait(timeout=TIMEOUT) == -signal.SIGKILL
        t.join(timeout=TIMEOUT)  # the rest of its output: its stdout is closed
    first = "".join(outs[0])
    saved = digests(first, "saved")
    assert {1, 2, 3, 4, 5} <= set(saved), first
    held = steps_held(ram, url, opts)  # step 5 never committed anywhere; S3 may not have step 3 yet
    assert {s for s, tiers in held.items() if "ram" in tiers} == {3, 4} and set(held) <= {3, 4}, held

    # the same node again: RAM holds steps 3 and 4 (step 5 never committed)
    second = run(example_args(ram, ckpt, "--tp", "2", "--steps", "6"), tmp_path / "ram-resume")
    assert resumed(second) == (4, "[['ram'], ['ram']]"), second
    assert digests(second, "loaded") == {4: saved[4]}, second
    again = digests(second, "saved")
    assert set(again) == {5, 6}, second
    assert again[5] == saved[5], second  # trained on from step 4 exactly as the killed run did
    assert re.search(r"^tiers hold: step 3: s3, step 5: ram, step 6: ram\+s3$", second, re.M), second

    # new machines: RAM and the checkpoint directories gone, S3 holds steps 3 and 6. Two jobs at once, each
    # on its own new machine (own RAM and checkpoint directories), both loading step 6 from S3: one at the
    # saving layout, the other at TP=1 x DP=2, resharded from the TP=2 shards
    shutil.rmtree(ram)
    shutil.rmtree(ckpt)
    tp2 = example_args(ram, ckpt, "--tp", "2", "--steps", "6")
    tp1 = example_args(Path(f"{ram}-tp1"), Path(f"{ckpt}-tp1"), "--tp", "1", "--steps", "7")
    jobs = [(start(EXAMPLE, args, tmp_path / name), args, tmp_path / name)
            for args, name in ((tp2, "object-resume"), (tp1, "tp1"))]
    try:
        third, fourth = [finish(*job) for job in jobs]
    finally:
        for procs, _, _ in jobs:
            for p in procs:
                if p.poll() is None:
                    p.kill()
    assert resumed(third) == (6, "[['s3'], ['s3']]"), third
    assert digests(third, "loaded") == {6: again[6]}, third
    assert "GPTModel at TP=1 x DP=2" in fourth, fourth
    assert resumed(fourth) == (6, "[['s3'], ['s3']]"), fourth
    assert digests(fourth, "loaded") == {6: again[6]}, fourth
    assert set(digests(fourth, "saved")) == {7}, fourth  # and trains on at the new layout (other sums: other bits)
    assert re.search(r"^tiers hold: step 3: s3, step 6: s3, step 7: ram$", fourth, re.M), fourth
