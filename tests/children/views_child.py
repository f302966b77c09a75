"""One rank of a job checking ``tierfs.ranks.agree.views``: every rank must get every rank's view, whether
all are the same, a few differ (sent on their own) or many do (gathered). Prints one JSON line: each case's
views and the bytes its all-reduces moved (``bytes``)."""

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
    moved = {}  # tensor bytes each case's collectives moved on this rank (the real all_reduce, counted)
    all_reduce, count = dist.all_reduce, [0]

    def counted(tensor, *args, **kwargs):
        count[0] += tensor.numel() * tensor.element_size()
        return all_reduce(tensor, *args, **kwargs)
    dist.all_reduce = counted

    def case(name, view, **kw):
        count[0] = 0
        out[name] = views(g, view, **kw)
        moved[name] = count[0]
    for name, view in mine.items():
        case(name, view)
    case("few_is_one", mine["two_differ"], few=1)  # more differ than sent on their own: gathered
    out["bytes"] = moved
    finish(out)


if __name__ == "__main__":
    main()
