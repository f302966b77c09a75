"""The process's pool of groups (tierfs.ranks.pool) in a real two-rank gloo job: a store opened while another
is open takes the groups a closed one gave back, stores open at once never share one, a group a failure
was seen on (on one rank only) makes every rank make new ones instead of hanging, and when the last store
closes its groups are destroyed."""

from __future__ import annotations

from pathlib import Path

import pytest

import gloo_job

pytest.importorskip("torch")

CHILDREN = Path(__file__).parent / "children"


def test_groups_are_made_once_and_taken_again_while_a_store_is_open():
    # the bulk bytes over gloo, so that the fork is 2 lanes (over the streams it would be one)
    outs = gloo_job.run_job(2, CHILDREN / "pool_child.py", env={"TIERFS_STREAMS": "0"})
    for o in outs:
        steps = o["steps"]
        assert all(s["works"] for s in steps), steps
        # made 3 (the store's group and a fork of 2 lanes); while the first holds its own: 3 more; the
        # first's taken again: none; after the failure: 3
        assert [s["made"] for s in steps] == [3, 3, 0, 3], steps
        # nothing free once an opening took its groups (after the failure every rank destroyed what it had)
        assert [s["free"] for s in steps] == [0, 0, 0, 0], steps
        # the last opening's groups wait while the second store is open; when it closes, all are destroyed
        assert (o["free_while_one_is_open"], o["free_at_end"]) == (3, 0)
    # each opening names its groups anew (a failed collective's diagnosis keys), the same on every rank
    assert [s["job"] for s in outs[0]["steps"]] == [s["job"] for s in outs[1]["steps"]]
    assert len({s["job"] for s in outs[0]["steps"]}) == 4
    # rank 1 destroyed the groups it saw fail (the fork's 2 lanes), rank 0 kept them: the vote saw the
    # ranks' pools differ, and both made new ones
    assert [o["free_before_vote"] for o in outs] == [3, 1]
