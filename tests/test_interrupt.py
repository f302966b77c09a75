"""Ctrl-C while a step's copy to the object tier is pending: what the waits say, and how a second Ctrl-C
ends them.

A child process (tests/children/interrupt_child.py) saves a step whose copy waits in the ``transfer`` test hook
until the test writes to its stdin, so the copy is pending for exactly as long as the test wants; every
step here is synchronised on the child's output, never on time.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path

from tierfs import TieredStore
from tierfs.tiers import ObjectTier

CHILD = Path(__file__).parent / "children" / "interrupt_child.py"
WAIT = 120  # seconds any one line may take to appear (a bound, never a pause)


class Child:
    """The child process, its output read line by line on threads."""

    def __init__(self, ram: str, url: str, mode: str) -> None:
        path = os.pathsep.join([str(CHILD.parents[2]), os.environ.get("PYTHONPATH", "")])
        env = {**os.environ, "PYTHONPATH": path}
        self.p = subprocess.Popen([sys.executable, str(CHILD), ram, url, mode], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        self.lines: dict[str, queue.Queue[str | None]] = {"out": queue.Queue(), "err": queue.Queue()}
        self.seen: dict[str, list[str]] = {"out": [], "err": []}
        for name, stream in (("out", self.p.stdout), ("err", self.p.stderr)):
            threading.Thread(target=self._read, args=(stream, self.lines[name]), daemon=True).start()

    @staticmethod
    def _read(stream, q: queue.Queue) -> None:
        for line in stream:
            q.put(line.rstrip("\n"))
        q.put(None)

    def expect(self, stream: str, text: str) -> str:
        """The next line of ``stream`` holding ``text`` (earlier lines are kept in ``seen``)."""
        while True:
            line = self.lines[stream].get(timeout=WAIT)
            assert line is not None, f"{text!r} never came; stderr: {self.seen['err']}"
            self.seen[stream].append(line)
            if text in line:
                return line

    def interrupt(self) -> None:
        self.p.send_signal(signal.SIGINT)

    def release_copy(self) -> None:
        assert self.p.stdin is not None
        self.p.stdin.write("go\n")
        self.p.stdin.flush()

    def finish(self) -> tuple[int, list[str]]:
        """Exit status and every stderr line, once the child has ended."""
        rc = self.p.wait(timeout=WAIT)
        for name, q in self.lines.items():
            while (line := q.get(timeout=WAIT)) is not None:
                self.seen[name].append(line)
        return rc, self.seen["err"]


def _start(shm_dir: str, tmp_path: Path, mode: str) -> tuple[Child, str]:
    url = f"file://{tmp_path / 'obj'}"
    child = Child(shm_dir, url, mode)
    child.expect("out", "saved")
    return child, url


def _steps(url: str) -> dict:
    with TieredStore([ObjectTier(url)], cleanup=False) as store:
        return store.steps()


def test_closing_says_what_it_waits_for_and_a_second_ctrl_c_stops_at_once(shm_dir, tmp_path):
    child, url = _start(shm_dir, tmp_path, "close")
    waiting = child.expect("err", "closing the store: waiting for")
    assert "step 1" in waiting and "not yet on" in waiting and "file" in waiting and "Ctrl-C twice" in waiting
    child.interrupt()
    still = child.expect("err", "press Ctrl-C again")
    assert "step 1" in still and "not yet on" in still and "file" in still
    child.interrupt()
    rc, err = child.finish()
    assert rc == 130 and "KeyboardInterrupt" in child.seen["out"]
    lost = [line for line in err if "NOT durable" in line]
    assert len(lost) == 1, err
    assert lost[0].startswith("tierfs: closing the store, interrupted by Ctrl-C: ")
    assert f"step 1 is NOT durable on tier 'file' ({url})" in lost[0] and shm_dir in lost[0]
    assert not any("Traceback" in line for line in err), err
    assert _steps(url) == {}  # never committed on the object tier


def test_one_ctrl_c_while_closing_finishes_the_copy_then_stops(shm_dir, tmp_path):
    child, url = _start(shm_dir, tmp_path, "close")
    child.expect("err", "closing the store: waiting for")
    child.interrupt()
    child.expect("err", "press Ctrl-C again")
    child.release_copy()
    rc, err = child.finish()
    assert rc == 130 and "KeyboardInterrupt" in child.seen["out"] and "closed" not in child.seen["out"]
    assert not any("NOT durable" in line or "Traceback" in line for line in err), err
    assert _steps(url) == {1: ["file"]}


def test_at_exit_a_second_ctrl_c_stops_waiting_and_ends_the_process_as_ctrl_c_does(shm_dir, tmp_path):
    child, url = _start(shm_dir, tmp_path, "exit")
    waiting = child.expect("err", "finishing at exit")
    assert "step 1" in waiting and "not yet on" in waiting and "file" in waiting and "Ctrl-C twice" in waiting
    child.interrupt()
    still = child.expect("err", "press Ctrl-C again")
    assert "step 1" in still
    child.interrupt()
    rc, err = child.finish()
    assert rc == -signal.SIGINT, err  # as an uncaught Ctrl-C ends a Python program
    lost = [line for line in err if "NOT durable" in line]
    assert len(lost) == 1 and "exit interrupted by Ctrl-C" in lost[0], err
    assert f"step 1 is NOT durable on tier 'file' ({url})" in lost[0]
    assert not any("Traceback" in line for line in err), err
