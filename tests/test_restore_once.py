"""CheckpointManager.restore is one restore: the store gathers the restore's plan once, and the plan picks
the step, each rank's source and whether a DCP step must first be brought into RAM; the restore reads the
step bit for bit, whether a node was replaced or not (:mod:`tierfs.core.restore.session`)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import gloo_job

CHILDREN = Path(__file__).parent / "children"


def job(shm: str, fmt: str, mode: str) -> list[dict]:
    return gloo_job.run_job(2, CHILDREN / "restore_once_child.py", shm, fmt, mode, timeout=180)


def test_a_store_format_restart_gathers_the_plan_once(shm_dir):
    job(shm_dir, "store", "save")
    outs = job(shm_dir, "store", "restore")
    for o in outs:
        assert (o["step"], o["exact"], o["plans"]) == (3, True, 1), o
        assert o["loader"] == 300 + o["rank"] and o["sources"] == [["ram", None], ["ram", None]], o
    # the plan (a few all-reduces), whether the step was saved through DCP (one), the restore's agreement
    # and the sources' report: the same few calls on every rank, whatever the state
    assert len({o["calls"] for o in outs}) == 1


def test_a_replaced_node_restores_from_its_peer_with_one_plan(shm_dir):
    job(shm_dir, "store", "save")
    shutil.rmtree(Path(shm_dir) / "node1")  # replaced: its shard of step 3 is only on its peer
    outs = job(shm_dir, "store", "restore")
    for o in outs:
        assert (o["step"], o["exact"], o["plans"]) == (3, True, 1), o
        assert o["sources"] == [["ram", None], ["peer", 0]], o
        # its loader's state is read from its own shard: the restore put it in its RAM, in the same pass
        assert o["loader"] == 300 + o["rank"] and 3 in o["ram"], o


@pytest.mark.parametrize("replaced", [False, True])
def test_a_dcp_restart_gathers_the_plan_once(shm_dir, replaced):
    job(shm_dir, "dcp", "save")
    if replaced:  # the step is brought into the node's RAM first (DCP's reader reads tiers directly)
        shutil.rmtree(Path(shm_dir) / "node1")
    outs = job(shm_dir, "dcp", "restore")
    for o in outs:
        assert (o["step"], o["exact"], o["plans"]) == (3, True, 1), o
        # every rank reads its shard from its RAM (a replaced node's brought there from its peer first)
        assert 3 in o["ram"] and o["sources"] == [["ram", None], ["ram", None]], o
