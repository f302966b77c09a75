"""Several processes with torch.distributed (gloo) on localhost, each its own node with its own RAM
directory, one shared object tier: every rank's shard is committed once all are written, and restored
bit-exact, from RAM or, for a node whose RAM was lost, from the object tier."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import gloo_job
from tierfs.ranks import GATHER_WIDTH
from tierfs.format import Marker, step_dirname

HERE = Path(__file__).parent
CHILDREN = HERE / "children"


def run_job(world: int, shm: str, obj: str, mode: str, same_node: bool = False) -> list[dict]:
    return gloo_job.run_job(world, CHILDREN / "mp_child.py", shm, obj, mode, same_node=same_node)


@pytest.mark.parametrize("world, mode", [(2, "save-sync"), (3, "save-async")])
def test_ranks_save_and_restore_their_shards(world, mode, shm_dir, tmp_path):
    obj = str(tmp_path / "obj")
    outs = run_job(world, shm_dir, obj, mode)
    for o in outs:
        assert o["steps"] == {"2": ["file"], "3": ["ram"], "4": ["ram", "file"]}
        assert (o["step"], o["tier"], o["exact"]) == (4, "ram", True)
        assert (o["obj_step"], o["obj_exact"]) == (4, True)
    # one marker per tier copy, listing every rank's manifest; each node's RAM holds only its own shard
    marker = Marker.from_bytes((Path(obj) / step_dirname(4) / "COMMITTED").read_bytes())
    assert sorted(marker.manifests) == [f"rank_{r:05d}.manifest.json" for r in range(world)]
    for r in range(world):
        names = sorted(p.name for p in (Path(shm_dir) / f"node{r}" / step_dirname(4)).iterdir())
        assert names == ["COMMITTED", f"rank_{r:05d}.0000.bin", f"rank_{r:05d}.manifest.json"]


def test_a_node_that_lost_its_ram_restores_from_the_object_tier(shm_dir, tmp_path):
    obj = str(tmp_path / "obj")
    run_job(3, shm_dir, obj, "save-sync")
    shutil.rmtree(Path(shm_dir) / "node1")  # node 1 is replaced: empty RAM
    outs = run_job(3, shm_dir, obj, "restore")
    assert [(o["step"], o["tier"], o["exact"]) for o in outs] == [(4, "ram", True), (4, "file", True),
                                                                    (4, "ram", True)]


def test_a_rank_that_fails_to_save_fails_the_step_everywhere_without_hanging(shm_dir, tmp_path):
    outs = run_job(2, shm_dir, str(tmp_path / "obj"), "fail-rank1")
    assert outs[1]["blocking=True"] == outs[1]["blocking=False"] == "CapacityError"  # raised by save
    assert outs[0]["blocking=True"] == "TierfsError"  # save raises: rank 1 failed
    assert outs[0]["blocking=False"] == "BackgroundError"  # save returned; the failed commit surfaces
    assert outs[0]["steps"] == {}  # written on rank 0, never committed, and taken back
    assert outs[1]["steps"] == {}


def test_ranks_sharing_a_node_directory_reuse_their_buffers(shm_dir, tmp_path):
    outs = run_job(2, shm_dir, str(tmp_path / "obj"), "shared-node", same_node=True)
    for o in outs:
        assert o["fresh_after_warmup"] == 0, "a rank copied into fresh tmpfs pages in steady state"
        assert [n for n in o["ram_steps"] if not n.startswith(".")] == [step_dirname(6), step_dirname(7)]
        assert (o["step"], o["tier"], o["exact"]) == (7, "ram", True)


def test_a_forks_collectives_go_up_and_down_a_tree_of_its_streams_and_name_a_rank_that_left():
    """A group forked where the ranks have streams holds no gloo group: its all-reduces, broadcast (from a
    leaf), all-gathers (of JSON longer than one round's width too) and barrier go over a binary tree of the
    ranks, each rank talking to its parent and children only; when a rank's process ends, every other rank's
    next collective fails naming that rank, not the neighbour it waited on."""
    world = 6
    outs = gloo_job.run_job(world, CHILDREN / "tree_child.py")
    for o in outs:
        r = o["rank"]
        assert (o["tree"], o["lanes"]) == (True, 0)
        assert o["reduced"] == [[0, -(world - 1), 2 ** 40], [world - 1, 0, 2 ** 40 + world - 1],
                                [sum(range(world)), -sum(range(world)), world * 2 ** 40 + sum(range(world))]]
        assert o["broadcast"] == {"from": world - 1, "text": "é" * 3000}
        assert o["gathered"] == [{"r": k, "pad": "x" * (k * 700)} for k in range(world)]
        assert o["ints"] == [[k, k * k, -1] for k in range(world)]
        parent, children = ([] if r == 0 else [(r - 1) // 2]), [c for c in (2 * r + 1, 2 * r + 2) if c < world]
        assert o["neighbours"] == sorted(parent + children), r
    for o in outs[:-1]:
        assert o["error"] is not None and o["error"][0] == "RankWaitError" and o["error"][2] == [world - 1], o


@pytest.mark.parametrize("no_streams", [None, "1"], ids=["streams", "gloo"])
def test_exchange_sends_everything_and_raises_after_a_failed_check(no_streams):
    """Point-to-point exchange, over the group's streams or (streams off on one rank: on every rank) over two
    lanes of gloo (over the streams the fork holds no gloo group: its collectives go over the streams too):
    buffers of any size (empty too) arrive bit-exact and in order; a failing check on one rank is raised there
    only once every byte has moved, and the group stays usable (all_gather of short and long JSON too). A
    stranger's connection to a rank's stream socket is closed unread and disturbs nothing."""
    outs = gloo_job.run_job(2, CHILDREN / "exchange_child.py", env={"NO_STREAMS_RANK": no_streams})
    assert all(o["streams"] is (no_streams is None) and o["streamed"] is (no_streams is None) for o in outs)
    # no idle gloo group beside the streams
    assert all((o["lanes"], o["tree"]) == ((0, True) if no_streams is None else (2, False)) for o in outs)
    assert outs[0].get("stranger_closed") is (True if no_streams is None else None)
    assert [o["raised"] for o in outs] == ["check failed", None]
    assert all(o["exact"] and o["after"] == [0, 1] and o["off_thread"] for o in outs)
    assert outs[0]["seen"] == [0, 1] and outs[1]["seen"] == [0, 1, 2, 3, 4]  # no checks after a failure
    assert all(o["paced"] == [1000, 0, 300_000, 7, 65_536] for o in outs)
    want = [[[0], "é" * GATHER_WIDTH], [{"r": 0}, {"r": 1}], ["", "x"]]
    assert all(o["gathered"] == want for o in outs)


def test_views_reach_every_rank_whether_all_few_or_many_differ():
    """``agree.views`` in a job of 5: every rank gets every rank's view when all are the same (one all-reduce),
    when a few differ (sent on their own, the common one by the first rank holding it; a differing rank 0
    too), when all differ (gathered), with no clear majority, and when more differ than it sends alone."""
    import views_child

    outs = gloo_job.run_job(5, CHILDREN / "views_child.py")
    want = [views_child.case_views(r, 5) for r in range(5)]
    for case in ("same", "last_differs", "two_differ", "all_differ", "split_evenly"):
        assert all(o[case] == [w[case] for w in want] for o in outs), case
    assert all(o["few_is_one"] == [w["two_differ"] for w in want] for o in outs)
    # what each way costs: two numbers when all match; when one rank differs, its view and the common one,
    # far less than the same views gathered from every rank
    for o in outs:
        b = o["bytes"]
        assert b["same"] == 16 and b["last_differs"] < b["few_is_one"] / 4, b
