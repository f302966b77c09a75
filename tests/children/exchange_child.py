"""One rank of a two-rank job exercising ``TorchGroup.exchange`` over two lanes (gloo on localhost).

Rank 0's ``on_received`` fails on the second buffer: rank 0 must still send everything and raise only after,
rank 1 must get every byte, and the group must stay in step. Prints one JSON line.
"""

import threading

import numpy as np
import torch.distributed as dist

from tierfs.ranks import GATHER_WIDTH, TorchGroup

from _child import finish  # tests/children/ is the script's directory, first on sys.path


def main() -> None:
    dist.init_process_group("gloo")
    g = TorchGroup().fork(lanes=2)
    me, other = g.rank, 1 - g.rank
    sizes = [1000, 0, 300_000, 7, 65_536]
    out_bufs = [np.random.default_rng(10 * me + k).integers(0, 255, n, dtype=np.uint8) for k, n in enumerate(sizes)]
    in_bufs = [np.zeros(n, np.uint8) for n in sizes]
    seen, threads = [], set()

    def on_received(i: int) -> None:
        seen.append(i)
        threads.add(threading.get_ident())
        if me == 0 and i == 1:
            raise RuntimeError("check failed")

    paced = []
    out = {"rank": me}
    try:
        g.exchange([(other, b) for b in out_bufs], [(other, b) for b in in_bufs], pace=paced.append,
                   on_received=on_received)
        out["raised"] = None
    except RuntimeError as e:
        out["raised"] = str(e)
    want = [np.random.default_rng(10 * other + k).integers(0, 255, n, dtype=np.uint8) for k, n in enumerate(sizes)]
    out.update(exact=all(a.tobytes() == b.tobytes() for a, b in zip(in_bufs, want)), seen=seen, paced=paced,
               off_thread=threading.get_ident() not in threads, after=g.all_gather(me),
               # JSON of any length: one rank's over the first collective's width takes a second round
               gathered=[g.all_gather(x) for x in ("é" * GATHER_WIDTH if me else [me], {"r": me}, "x" * me)])
    finish(out)


if __name__ == "__main__":
    main()
