"""One rank of a job checking ``tierfs.ranks.agree.views``: every rank must get every rank's view, whether
all are the same, a few differ (sent on their own) or many do (gathered). Prints one JSON line: each case's
views and the bytes the all-reduces moved."""

import torch.distributed as dist

from tierfs.ranks import TorchGroup
from tierfs.ranks.agree import views

from _child import finish  # tests/children/ is the script's directory, first on sys.path


def case_views(rank: int, world: int) -> dict[str, object]:
    """Each case's view of ``rank`` (what the test expects back, on every rank)."""
    common = {"steps": [3, 4, 5], "kept": [[5, 1]], "name": "ram"}
    return {
        "same": common,
        "last_differs": {"steps": [], "kept": [], "name": "ram"} if rank == world - 1 else common,
        "two_differ": ({"steps": list(range(rank * 50))} if rank in (0, 2) else common),  # rank 0 odd too
        "all_differ": {"rank": rank, "pad": "x" * rank},
        "split_evenly": [rank % 2],  # no class is a clear majority: the larger of the two extremes wins
    }


def main() -> None:
    dist.init_process_group("gloo")
    g = TorchGroup()
    rank, world = g.rank, g.world_size
    mine = case_views(rank, world)
    out: dict[str, object] = {"rank": rank}
    for name, view in mine.items():
        out[name] = views(g, view)
    out["few_is_one"] = views(g, mine["two_differ"], few=1)  # more differ than sent on their own
    finish(out)


if __name__ == "__main__":
    main()
