"""One rank of a two-rank job saving every step to RAM and peers, where a save stages the next step while
the last one's replica is still on its way (held in the ``transfer`` test hook until that save returned).
Then the freed buffers of both (this rank's old step, the old replica) are all kept for reuse: a second
such overlap, and the saves after it, make no new RAM buffer. Prints one JSON line: the buffers made
during the second overlap, and the tiers holding the last step."""

import sys
import threading

import numpy as np
import torch.distributed as dist

from tierfs import TieredStore
from tierfs.policies import LatestN
from tierfs.testing import hooks
from tierfs.tiers import MemoryTier, PeerTier

from _child import finish  # tests/children/ is the script's directory, first on sys.path


def main() -> None:
    root = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ram = MemoryTier(f"{root}/ram{rank}", keep=LatestN(2))
    held: dict[int, threading.Event] = {}

    def hold(step: int, tier: str, nbytes: int) -> None:
        if tier == "peer" and step in held and not held[step].wait(120):
            raise TimeoutError(f"step {step + 1} was not staged")

    def state(step: int) -> dict:
        return {f"w{i}": np.full(1 << 18, step * 10 + i, np.float32) for i in range(6)}  # 6 MiB, one file

    with TieredStore([ram, PeerTier(replicas=1)], background_bandwidth=None, timeout=120) as store:
        hooks.add("transfer", hold)

        def steady(steps: range) -> None:
            for s in steps:
                store.save(s, state(s))
                store.wait_until_finished()

        def overlap(step: int) -> None:
            """``step``'s replica waits until ``step + 1`` is staged."""
            held[step] = threading.Event()
            store.save(step, state(step), blocking=False)
            store.save(step + 1, state(step + 1), blocking=False)
            held[step].set()
            store.wait_until_finished()

        steady(range(0, 4))
        overlap(4)
        steady(range(6, 9))
        before = ram.stats()["created"]
        overlap(9)
        steady(range(11, 14))
        made = ram.stats()["created"] - before
        last = store.steps()[13]
    finish({"rank": rank, "made": made, "last": sorted(last)})


if __name__ == "__main__":
    main()
