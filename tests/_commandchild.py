"""A child process a test talks to line by line: it reads one command per line on stdin and answers each
with one JSON line on stdout (the scripts are in tests/children/, which is on its ``PYTHONPATH``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

CHILDREN = Path(__file__).parent / "children"


class CommandChild:
    """``tests/children/<script>`` started with ``args``; :meth:`ask` sends a command and returns its answer."""

    def __init__(self, script: str, *args: str) -> None:
        path = os.pathsep.join(p for p in (str(CHILDREN), os.environ.get("PYTHONPATH")) if p)
        self.proc = subprocess.Popen([sys.executable, str(CHILDREN / script), *args], text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env=os.environ | {"PYTHONPATH": path})

    def answer(self) -> Any:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, f"the child process ended (exit code {self.proc.wait()})"
        return json.loads(line)

    def ask(self, cmd: str) -> Any:
        assert self.proc.stdin is not None
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        return self.answer()

    def close(self) -> None:
        """End it (stdin closed) and check it exits with status 0."""
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        assert self.proc.wait(timeout=60) == 0

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
