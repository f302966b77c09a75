"""One rank of examples/megatron_gpt.py, run as it is, that stops where a test kills it.

    megatron_gpt_child.py PAUSE_AT EXAMPLE_ARGS...

When tierfs's background thread starts writing this rank's manifest of step PAUSE_AT in the RAM tier (the
step's commit), the rank prints ``paused at step PAUSE_AT`` on stdout and waits there for the test's
SIGKILL: step PAUSE_AT is never committed, the steps before it are, whatever the training thread does
meanwhile (it trains on, and its next save waits for that commit).
"""

import os
import runpy
import sys
import threading

from tierfs.testing import hooks

EXAMPLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples", "megatron_gpt.py")


def main() -> None:
    pause_at = int(sys.argv[1])
    killed = threading.Event()  # never set: the rank waits for the SIGKILL

    def pause(stage, step, tier):
        if stage == "manifest" and step == pause_at:
            print(f"paused at step {step}", flush=True)
            killed.wait()

    hooks.add("stage", pause)
    sys.argv = [EXAMPLE, *sys.argv[2:]]
    runpy.run_path(EXAMPLE, run_name="__main__")


if __name__ == "__main__":
    main()
