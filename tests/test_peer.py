"""The peer tier with real processes: 3-4 gloo ranks on localhost, each its own node with its own RAM
directory. Nodes are lost by deleting their RAM directory (and, in one test, by SIGKILL mid-replication);
every restored shard is compared bit for bit with what was saved."""

from __future__ import annotations

import shutil
import signal
from pathlib import Path

import pytest

import gloo_job
from tierfs.util.worker import BACKGROUND_NICE
from tierfs.errors import ChecksumError, TierfsError
from tierfs.format import step_dirname
from tierfs.tiers import PeerTier
from tierfs.tiers.peer import plan_fetch, replica_targets

HERE = Path(__file__).parent
CHILDREN = HERE / "children"
CHILD = CHILDREN / "peer_child.py"


# -- placement and fetch planning (pure functions) ------------------------------------------------
def test_ring_sends_to_the_next_nodes_any_count():
    assert replica_targets([0, 1, 2, 3], 1) == [[1], [2], [3], [0]]
    assert replica_targets([0, 1, 2], 2) == [[1, 2], [2, 0], [0, 1]]
    # two ranks per node: same local index on the next node
    assert replica_targets([0, 0, 1, 1, 2, 2], 1) == [[2], [3], [4], [5], [0], [1]]


def test_pairwise_pairs_nodes_and_folds_an_odd_one_into_the_last_group():
    assert replica_targets([0, 1, 2, 3], 1, "pairwise") == [[1], [0], [3], [2]]
    assert replica_targets([0, 1, 2, 3, 4], 1, "pairwise") == [[1], [0], [3], [4], [2]]


def test_custom_strategy_is_checked():
    assert replica_targets([0, 1, 2], 1, lambda r, nodes, k: [(r + 2) % 3]) == [[2], [0], [1]]
    with pytest.raises(TierfsError, match="other nodes"):
        replica_targets([0, 0, 1], 1, lambda r, nodes, k: [r ^ 1])  # rank 0 -> rank 1, same node


def test_too_few_nodes_is_a_clear_error():
    with pytest.raises(TierfsError, match="at least 2 nodes"):
        replica_targets([0, 0], 1)
    with pytest.raises(TierfsError, match="replicas=2 needs at least 3 nodes"):
        replica_targets([0, 1], 2)


@pytest.mark.parametrize("kw, needle", [({"replicas": 0}, "replicas"), ({"connections": 0}, "connections"),
                                        ({"strategy": "star"}, "strategy")])
def test_bad_peer_tier_arguments_are_clear_errors(kw, needle):
    with pytest.raises(ValueError, match=needle):
        PeerTier(**kw)


def test_fetch_plan_spreads_the_load_over_holders():
    assert plan_fetch({1: [3], 2: [3, 0]}) == {1: 3, 2: 0}
    assert plan_fetch({0: [2, 3], 1: [2, 3]}) == {0: 2, 1: 3}
    assert plan_fetch({5: []}) == {}


@pytest.mark.parametrize("error,bad", [(ChecksumError("block 3 of rank_00001.0000.bin"), True),
                                       (FileNotFoundError(2, "No such file", "rank_00001.0000.bin"), True),
                                       (OSError(24, "Too many open files"), False),
                                       (OSError(12, "Cannot allocate memory"), False)])
def test_only_a_copy_its_holder_finds_damaged_or_missing_counts_as_bad(error, bad):
    """A holder that cannot send its copy says why in the header; its receiver counts the copy as bad (and
    it is dropped: no later restore picks it) only when the bytes are damaged or gone, never for a failure
    of the moment, which would delete the only copy of a lost node's shard for a file descriptor."""
    from tierfs.core.restore.sources import BAD_COPY
    from tierfs.tiers import _wire

    h = _wire.parse_header(_wire.header(3, 1, b"", b"", {}, error=_wire.unsendable(error)))
    with pytest.raises(TierfsError) as got:
        _wire.check_header(h, 3, 1)
    said = f"{type(got.value).__name__}: {got.value}"
    assert said.startswith(BAD_COPY) is bad, said
    assert type(error).__name__ in said


# -- real jobs ----------------------------------------------------------------------------------
def job(world: int, shm: Path, obj: Path | str, mode: str, replicas: int | str, *extra: str,
        env: dict[str, str | None] | None = None) -> list[dict]:
    return gloo_job.run_job(world, CHILD, str(shm), str(obj), mode, str(replicas), *extra, env=env)


def wipe(shm: Path, *nodes: int) -> None:
    for n in nodes:
        shutil.rmtree(shm / f"node{n}")


@pytest.fixture(scope="module")
def saved_r1(tmp_path_factory):
    """4 ranks, replicas=1, steps 1..3 saved to RAM, peers and a file:// object tier."""
    root = tmp_path_factory.mktemp("r1")
    outs = job(4, root / "shm", root / "obj", "save", 1, "3")
    for o in outs:
        assert o["steps"]["3"] == ["ram", "peer", "file"]  # replicated and durable
        assert "peer" not in o["steps"]["2"]  # peers keep only the newest replicated step
    # ring: rank r keeps the shard of rank r-1
    assert [o["held"] for o in outs] == [{"3": [3]}, {"3": [0]}, {"3": [1]}, {"3": [2]}]
    return root


def fresh_copy(saved: Path, tmp_path: Path) -> Path:
    shutil.copytree(saved / "shm", tmp_path / "shm")
    return tmp_path / "shm"


def test_a_lost_node_restores_from_its_peer_and_gets_its_replicas_back(saved_r1, tmp_path):
    shm = fresh_copy(saved_r1, tmp_path)
    wipe(shm, 1)
    # rank 1 takes its shard in only once the other ranks have returned, their state in place (else none
    # returns: the job fails on its side group's timeout)
    outs = job(4, shm, saved_r1 / "obj", "restore-early", 1)
    assert all(o["exact"] and o["step"] == 3 for o in outs)
    sources = [(r["tier"], r["peer"]) for r in outs[0]["ranks"]]
    assert sources == [("ram", None), ("peer", 2), ("ram", None), ("ram", None)]  # object tier untouched
    assert all(o["ranks"] == outs[0]["ranks"] for o in outs)  # every rank reports every rank's source
    assert outs[1]["held"] == {"3": [0]}  # the replaced node keeps rank 0's copy again
    # gloo groups, all made when the store opened, none by the restores: the store's own, at full priority;
    # the commit's, the copy workers' and the peer tier's groups have none (their collectives go over
    # tierfs's streams, on the threads that call them), so no idle I/O loop of theirs
    assert all(o["loops"] == [0] for o in outs), [o["loops"] for o in outs]
    assert [o["groups_restoring"] for o in outs] == [0] * 4
    # closed and opened again in the same processes while another store of theirs is open: the second store
    # takes the group the first gave back (no new group, no new thread but the other store's loop), and its
    # restore over them gets the replaced node's shard from its peer
    assert [o["groups_reopening"] for o in outs] == [0] * 4
    assert all(o["loops_reopened"] == [0] + o["loops"] for o in outs), [o["loops_reopened"] for o in outs]
    assert [o["reopened_tier"] for o in outs] == ["ram", "peer", "ram", "ram"] and all(o["reopened_exact"] for o in outs)
    assert (shm / "node1" / "peers" / "rank_00001" / step_dirname(3) / "rank_00000.manifest.json").exists()
    # into new arrays: the replaced node's shard again from its peer, its large entry received in place
    assert [o["again_tier"] for o in outs] == ["ram", "peer", "ram", "ram"] and all(o["again_exact"] for o in outs)


def test_a_lost_node_whose_only_copy_fails_after_the_others_returned_fails_every_rank_then_restarts_older(
        saved_r1, tmp_path):
    """The other ranks return as soon as their own state is in place; rank 1's only copy of step 3 then
    fails its checks (and the object tier lacks step 3): every rank raises, the returned ones at their next
    call, since they cannot all move back. The holder drops the bad copy, so the job's restart restores
    step 2 instead of failing again."""
    shm = fresh_copy(saved_r1, tmp_path)
    obj = tmp_path / "obj"
    shutil.copytree(saved_r1 / "obj", obj)
    shutil.rmtree(obj / step_dirname(3))
    wipe(shm, 1)
    bad = shm / "node2" / "peers" / "rank_00002" / step_dirname(3) / "rank_00001.0001.bin"
    data = bytearray(bad.read_bytes())
    data[12345] ^= 0x40
    bad.write_bytes(bytes(data))
    outs = job(4, shm, obj, "restore-split", 1)
    assert [o.get("step") for o in outs] == [3, None, 3, 3] and all(outs[r]["exact"] for r in (0, 2, 3))
    assert "RestoreIncompleteError: step 3: rank(s) [1] could not get their shard" in outs[1]["error"]
    assert "checksum mismatch" in outs[1]["error"] and "restart the job" in outs[1]["error"]
    for r in (0, 2, 3):
        assert "error" not in outs[r] and "RestoreIncompleteError: step 3: rank(s) [1]" in outs[r]["later"]
    assert outs[2]["held"] == {} and any("dropping the copy of rank 1" in w for w in outs[2]["warnings"])
    outs = job(4, shm, obj, "restore", 1)  # the restart
    assert all(o["exact"] and o["step"] == 2 for o in outs)
    assert [r["tier"] for r in outs[0]["ranks"]] == ["ram", "file", "ram", "ram"]


def test_two_neighbours_lost_with_one_replica_falls_back_to_the_object_tier(saved_r1, tmp_path):
    shm = fresh_copy(saved_r1, tmp_path)
    wipe(shm, 1, 2)  # rank 1's only copy was on node 2
    outs = job(4, shm, saved_r1 / "obj", "restore", 1)
    assert all(o["exact"] and o["step"] == 3 for o in outs)
    assert [(r["tier"], r["peer"]) for r in outs[0]["ranks"]] == [
        ("ram", None), ("file", None), ("peer", 3), ("ram", None)]


@pytest.fixture(scope="module")
def saved_r2(tmp_path_factory):
    """4 ranks, replicas=2, no object tier."""
    root = tmp_path_factory.mktemp("r2")
    outs = job(4, root / "shm", "-", "save", 2, "2")
    assert [o["targets"] for o in outs] == [[1, 2], [2, 3], [3, 0], [0, 1]]
    assert [o["held"] for o in outs] == [{"2": [2, 3]}, {"2": [0, 3]}, {"2": [0, 1]}, {"2": [1, 2]}]
    return root


def test_two_neighbours_lost_with_two_replicas_restore_from_peers_spread_over_holders(saved_r2, tmp_path):
    shm = fresh_copy(saved_r2, tmp_path)
    wipe(shm, 1, 2)
    outs = job(4, shm, "-", "restore", 2)
    assert all(o["exact"] and o["step"] == 2 for o in outs)
    # rank 1's copies: nodes 2 (lost) and 3; rank 2's: nodes 3 and 0 -> node 3 is not asked twice
    assert [(r["tier"], r["peer"]) for r in outs[0]["ranks"]] == [
        ("ram", None), ("peer", 3), ("peer", 0), ("ram", None)]
    assert outs[1]["held"] == {"2": [0, 3]} and outs[2]["held"] == {"2": [0, 1]}  # re-seeded


def test_a_corrupted_replica_is_detected_and_another_peer_serves(saved_r2, tmp_path):
    shm = fresh_copy(saved_r2, tmp_path)
    wipe(shm, 1)
    bad = shm / "node2" / "peers" / "rank_00002" / step_dirname(2) / "rank_00001.0001.bin"
    data = bytearray(bad.read_bytes())
    data[12345] ^= 0x40
    bad.write_bytes(bytes(data))
    outs = job(4, shm, "-", "restore", 2)
    assert all(o["exact"] and o["step"] == 2 for o in outs)
    assert (outs[1]["tier"], outs[1]["peer"]) == ("peer", 3)
    assert any(t == "peer" and "rank 2" in why and "checksum mismatch" in why for t, _, why in outs[1]["skipped"])
    # node 2 dropped the bad copy; re-seeding gave it rank 1's shard again, as node 3 keeps it
    assert any("dropping the copy of rank 1" in w for w in outs[2]["warnings"]) and outs[2]["held"] == {"2": [0, 1]}
    good = shm / "node3" / "peers" / "rank_00003" / step_dirname(2) / "rank_00001.0001.bin"
    assert bad.read_bytes() == good.read_bytes()


def test_a_rank_killed_while_replicating_restores_the_newest_fully_replicated_step(tmp_path):
    procs = gloo_job.start_job(4, CHILD, str(tmp_path / "shm"), "-", "die-replicating", "1", "2")
    try:
        procs[1].wait(timeout=120)
        assert procs[1].returncode == -signal.SIGKILL
    finally:
        for p in procs:  # torchrun tears the job down when a worker dies
            if p.poll() is None:
                p.kill()
            p.communicate()
    wipe(tmp_path / "shm", 1)  # and the node is replaced
    outs = job(4, tmp_path / "shm", "-", "restore", 1)
    # step 2 was committed in RAM everywhere but never fully replicated: rank 1 has no copy of it
    assert all(o["exact"] and o["step"] == 1 for o in outs)
    assert [r["tier"] for r in outs[0]["ranks"]] == ["ram", "peer", "ram", "ram"]


@pytest.mark.parametrize("first", ["", ":1024"])  # headers in the first message, or longer than it
def test_three_nodes_work(tmp_path, first):  # and transfers on one connection per pair, or three
    outs = job(3, tmp_path / "shm", "-", "save", "1:1" + first, "2")
    assert [o["held"] for o in outs] == [{"2": [2]}, {"2": [0]}, {"2": [1]}]
    wipe(tmp_path / "shm", 0)
    outs = job(3, tmp_path / "shm", "-", "restore", "1:3" + first)
    assert all(o["exact"] and o["step"] == 2 for o in outs)
    assert [(r["tier"], r["peer"]) for r in outs[0]["ranks"]] == [("peer", 1), ("ram", None), ("ram", None)]


def test_a_replica_over_the_ram_budget_is_refused_and_training_goes_on(tmp_path):
    # rank 1's budget holds its own steps and step 1's small replica, not step 2's
    outs = job(2, tmp_path / "shm", "-", "tight", 1, "2")  # save and wait_until_finished raise nothing
    for o in outs:
        assert o["steps"] == {"1": ["ram", "peer"], "2": ["ram"]}  # step 2 committed in RAM, not replicated
        assert o["held"] == {"1": [1 - o["rank"]]}  # rank 0 dropped step 2's copy it did receive
        assert any("step 2 is not replicated" in w and "rank 0 -> 1" in w and "CapacityError" in w
                   for w in o["warnings"]), o["warnings"]
    assert [p.name for p in (tmp_path / "shm" / "node1" / "peers" / "rank_00001").iterdir()] == [step_dirname(1)]


def test_while_later_steps_fail_to_replicate_ram_keeps_the_replicated_one_and_a_lost_node_restores_it(tmp_path):
    """RAM keeps two steps, and from step 2 on no step replicates (a sender cannot read its shard). The
    peers still hold step 1, which a lost node can come back to only if every other rank still has its own
    copy: RAM keeps step 1 in place of step 2 (which no peer holds), so after node 1 is lost the job
    restores step 1 (rank 1's shard from its peer), not nothing, and RAM holds no more steps than before."""
    outs = job(2, tmp_path / "shm", "-", "lagging", 1, "3")
    for o in outs:
        assert o["steps"] == {"1": ["ram", "peer"], "3": ["ram"]}, o["steps"]
        assert o["held"] == {"1": [1 - o["rank"]]}
        assert any("step 3 is not replicated" in w and "injected" in w for w in o["warnings"]), o["warnings"]
    wipe(tmp_path / "shm", 1)
    outs = job(2, tmp_path / "shm", "-", "restore", 1)
    assert all(o["exact"] and o["step"] == 1 for o in outs), outs
    assert [o["common"] for o in outs] == [[1], [1]]  # as the adapters choose their step: not none
    assert [(r["tier"], r["peer"]) for r in outs[0]["ranks"]] == [("ram", None), ("peer", 0)]
    # the newer step, passed over, is named with the rank that cannot get it
    assert [(x[1], x[2]) for x in outs[0]["skipped"]] == [(3, "held by only some ranks: rank(s) [1] cannot get it")]


@pytest.mark.parametrize("world,first", [(2, ""), (3, ""), (3, ":1024")])
def test_a_header_a_receiver_refuses_fails_the_copy_without_a_hang(tmp_path, world, first):
    """A receiver that cannot take a peer's header (a rank whose header limit differs) says so from its
    length, in the first message: the job goes on at once (no wait for gloo's timeout), the step stays in
    RAM, no half copy is kept. With three ranks the third pair's copy arrives whole and is dropped too.
    With a 1 KiB first message the headers (a few KiB) are long: the rest of the refused one is never sent."""
    outs = job(world, tmp_path / "shm", "-", "mismatch", "1:2" + first, "1")
    for o in outs:
        assert o["steps"] == {"1": ["ram"]}
        assert o["held"] == {}
        assert any("step 1 is not replicated" in w for w in o["warnings"]), o["warnings"]
        reasons = {(s, t): why for s, t, why in o["failed"]}
        assert set(reasons) == {(0, 1), (1, 2 % world)}  # rank 1 takes from rank 0 and sends to the next
        assert "announced a header of" in reasons[0, 1] and "same tierfs version" in reasons[0, 1]  # refused
        assert "cannot send it" in reasons[1, 2 % world] and "over 64" in reasons[1, 2 % world]  # said why


def test_node_rank_given_on_some_ranks_only_is_an_error_on_every_rank(tmp_path):
    outs = job(2, tmp_path / "shm", "-", "half-node-rank", 1)
    assert all("ranks disagree on PeerTier node_rank given: [1, 0]" in o.get("error", "") for o in outs), outs


def test_a_peer_tier_needs_several_nodes(tmp_path):
    from tierfs import TieredStore
    from tierfs.tiers import MemoryTier, PeerTier

    with pytest.raises(TierfsError, match="several processes"):
        TieredStore([MemoryTier(tmp_path / "ram"), PeerTier()])
    with pytest.raises(ValueError, match="after the RAM tier"):
        TieredStore([PeerTier(), MemoryTier(tmp_path / "ram")])


@pytest.mark.parametrize("nice,streams", [(None, None), ("10", "0")], ids=["default", "nice10-gloo"])
def test_replication_runs_at_the_background_priority(tmp_path, nice, streams):
    """The worker that replicates and the I/O threads of its groups (gloo's loops, which do the kernel
    copies where the bytes go over gloo) run at the background priority: by default the training thread's
    own (a lower one makes a background thread that holds the GIL wait for a core with it), or
    ``TIERFS_BACKGROUND_NICE``'s; the commit group's at full priority either way. Over the streams the
    forked groups hold no gloo group (their collectives run on the threads that call them); over gloo
    (``TIERFS_STREAMS=0``) each of the peer tier's roles has one per connection."""
    outs = job(2, tmp_path / "shm", "-", "priorities", 1,
               env={"TIERFS_BACKGROUND_NICE": nice, "TIERFS_STREAMS": streams})
    low, per_role = int(nice or 0), 1 if streams is None else 2
    for o in outs:
        assert o["steps"]["1"] == ["ram", "peer"]
        loops = sorted(n for name, n in o["threads"] if name == "gloo_tcp_loop")
        # over gloo: store + commit group and the peer tier's restore groups (made at open so that no restore
        # makes groups): full priority; the peer tier's copy groups: the background's; over the streams, the
        # store's own group alone
        want = [0] if streams is None else [0, 0] + [0] * per_role + [low] * per_role
        assert loops == sorted(want), o["threads"]
        workers = [n for name, n in o["threads"] if not name.startswith(("gloo", "pt_"))]
        assert low in workers and set(workers) <= {0, low}  # the replicating worker


def test_localize_brings_a_lost_shard_back_into_ram(saved_r1, tmp_path):
    """What readers without collectives (DCP's) rely on: after localize, RAM alone serves every rank."""
    shm = fresh_copy(saved_r1, tmp_path)
    wipe(shm, 1)
    outs = job(4, shm, saved_r1 / "obj", "localize", 1)
    assert [(r["tier"], r["peer"]) for r in outs[0]["ranks"]] == [
        ("ram", None), ("peer", 2), ("ram", None), ("ram", None)]
    assert all(o["exact"] and o["step"] == 3 and 3 in o["ram"] for o in outs)


def test_data_parallel_manager_state_restores_from_ram_and_peers_alone(tmp_path):
    """DCP writes a replicated tensor from one rank only; tierfs keeps it in every rank's shard, so each
    node reloads from its own RAM, and a replaced node from its peer, with no durable tier at all."""
    child = CHILDREN / "ddp_child.py"
    shm = tmp_path / "shm"
    gloo_job.run_job(3, child, str(shm), "save")
    outs = gloo_job.run_job(3, child, str(shm), "load")
    assert [(o["step"], o["exact"], o["tier"], o["skipped"]) for o in outs] == [(4, True, "ram", [])] * 3
    wipe(shm, 1)
    outs = gloo_job.run_job(3, child, str(shm), "load")
    assert [(o["step"], o["exact"], o["tier"]) for o in outs] == [(4, True, "ram")] * 3
    assert 4 in outs[1]["ram"] and outs[1]["held"] == {"4": [0]}  # shard back in RAM, replica re-seeded


def test_a_save_every_step_reuses_ram_buffers_while_the_last_replica_is_on_its_way(tmp_path):
    """The next step staged while the last one's replica still arrives: the buffers both free afterwards
    (the rank's old step and the old replica) are kept for reuse, so a second such overlap makes no new
    buffer (the pool kept one spare set only, and each overlap made and faulted a fresh one)."""
    outs = gloo_job.run_job(2, CHILDREN / "every_step_child.py", str(tmp_path), timeout=300)
    for o in outs:
        assert o["made"] == 0, o
        assert o["last"] == ["peer", "ram"], o
