"""Which ranks share a RAM directory is observed when a store opens, not assumed from the environment."""

from __future__ import annotations

from pathlib import Path

import gloo_job

HERE = Path(__file__).parent
CHILDREN = HERE / "children"
CHILD = CHILDREN / "membership_child.py"
NO_NODES = {"TIERFS_NODE_RANK": None, "GROUP_RANK": None, "LOCAL_WORLD_SIZE": None}


def test_per_rank_directories_on_one_host_with_dcp_just_work(tmp_path):
    """Two processes, each with its own RAM directory, no node numbers: DCP save and load complete."""
    outs = gloo_job.run_job(2, CHILD, str(tmp_path), "per-rank-dcp", env=NO_NODES, timeout=120)
    assert all(o["exact"] for o in outs)


def test_ranks_sharing_one_directory_commit_one_step(tmp_path):
    outs = gloo_job.run_job(2, CHILD, str(tmp_path), "shared", env=NO_NODES, timeout=120)
    assert all(o["exact"] for o in outs)
    assert outs[0]["files"] == ["COMMITTED", "rank_00000.0000.bin", "rank_00000.manifest.json",
                                "rank_00001.0000.bin", "rank_00001.manifest.json"]


def test_node_numbers_that_contradict_the_directories_are_one_error_on_every_rank(tmp_path):
    outs = gloo_job.run_job(2, CHILD, str(tmp_path), "shared", timeout=120)  # TIERFS_NODE_RANK = rank
    for o in outs:
        kind, why = o["error"]
        assert kind == "TierfsError"
        assert "ranks 0 and 1 share the directory" in why and str(tmp_path / "shared") in why
        assert "TIERFS_NODE_RANK" in why and "nodes 0 and 1" in why
    assert outs[0]["error"] == outs[1]["error"]
