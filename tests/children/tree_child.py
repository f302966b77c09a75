"""One rank of a job exercising the collectives of a forked group over tierfs's streams (a binary tree of
the ranks: with 6, rank 1 has a parent and two children, rank 2 one child, ranks 3-5 none).

Every rank runs all-reduces (min, max, sum), a broadcast from a leaf, all-gathers of JSON and of integers
and a barrier over the tree, then the last rank leaves the job (its process ends) and the others start one
more all-reduce: each must fail naming that rank alone, whichever of its neighbours it waited on. Prints one
JSON line.
"""

import os

import torch.distributed as dist

from tierfs.errors import RankWaitError
from tierfs.ranks import TorchGroup

from _child import finish  # tests/children/ is the script's directory, first on sys.path


def main() -> None:
    dist.init_process_group("gloo")
    g = TorchGroup().fork()
    me, world = g.rank, g.world_size
    out: dict = {"rank": me, "tree": g._tree, "lanes": len(g._lanes)}
    out["reduced"] = [g.all_reduce([me, -me, 2 ** 40 + me], op) for op in ("min", "max", "sum")]
    out["broadcast"] = g.broadcast({"from": me, "text": "é" * 3000} if me == world - 1 else None, world - 1)
    out["gathered"] = g.all_gather({"r": me, "pad": "x" * (me * 700)})
    out["ints"] = g.all_gather_ints([me, me * me, -1])
    g.barrier()
    out["neighbours"] = sorted(set(g._link._sent) | set(g._link._got)) if g._link is not None else None
    if me == world - 1:
        finish(out)  # its process ends: its streams close
    try:
        g.all_reduce([me], "sum")
        out["error"] = None
    except RankWaitError as e:
        out["error"] = [type(e).__name__, str(e), e.ranks]
    finish(out)


if __name__ == "__main__":
    os.environ.setdefault("TIERFS_STREAMS", "1")
    main()
