"""One rank of a two-rank job taking groups from the process's pool as stores do (gloo on localhost).

Steps, each an opening (``POOL.opening``) that makes a store's groups (``TorchGroup()``, ``fork(lanes=2)``:
the test turns the streams off, so that the fork is its two lanes), and what it made: a first one; a
second one while the first holds its groups (it makes its own); a third one after the first gave its
groups back while the second is still open (it makes none); then a failure seen on rank 1 alone (the
groups of the third's fork are not reused), after which the next opening makes new groups on both ranks
instead of hanging on groups that only one rank has. Once every opening gave its groups back (the last
store closed), none is left. Each step checks its groups work (an all-reduce, a transfer). Prints one
JSON line.
"""

import numpy as np
import torch.distributed as dist

from tierfs.ranks import TorchGroup
from tierfs.ranks.pool import POOL

from _child import finish  # tests/children/ is the script's directory, first on sys.path


def main() -> None:
    dist.init_process_group("gloo")
    made = [0]
    new_group = dist.new_group

    def counted(*args, **kwargs):
        made[0] += 1
        return new_group(*args, **kwargs)
    dist.new_group = counted
    out: dict = {"rank": dist.get_rank(), "steps": []}

    def opening():
        before = made[0]
        with POOL.opening(30.0) as lease:
            g = TorchGroup(timeout=30.0)
            f = g.fork(lanes=2)
        mine = np.full(1000, g.rank, np.uint8)
        theirs = np.zeros(1000, np.uint8)
        f.exchange([(1 - g.rank, mine)], [(1 - g.rank, theirs)])
        works = g.all_reduce([g.rank], "sum") == [1] and f.all_reduce([1], "sum") == [2] and \
            bool((theirs == 1 - g.rank).all())
        out["steps"].append({"made": made[0] - before, "works": works, "job": g._job, "free": POOL.free()})
        return lease, g, f

    first, _, _ = opening()
    second, _, _ = opening()  # the first holds its groups: new ones
    first.give_back()  # the second is still open: the first's groups wait for the next
    third, _, f = opening()  # the groups the first gave back
    if out["rank"] == 1:  # a wait failed on one of the third's groups, seen on this rank alone
        f._state["failed"] = "a transfer failed"
    third.give_back()  # rank 1 destroys that group; rank 0 keeps it
    out["free_before_vote"] = POOL.free()
    last, _, _ = opening()  # the ranks' pools differ: every rank makes new groups
    last.give_back()
    out["free_while_one_is_open"] = POOL.free()
    second.give_back()  # the last store closes: its groups go
    out["free_at_end"] = POOL.free()
    finish(out)


if __name__ == "__main__":
    main()
