"""The erasure-coded tier: its groups and stripes (pure functions), and real jobs of 5 and 6 gloo ranks on
localhost, each its own node with its own RAM directory. Nodes are lost by deleting their RAM directory,
parity damaged by flipping a byte in the file that keeps it; every restored shard is compared bit for bit
with what was saved."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

import gloo_job
from tierfs.errors import ArgumentError, TierfsError
from tierfs.format import step_dirname
from tierfs.tiers import ErasureCodedTier
from tierfs.tiers._encoding import FIRST
from tierfs.tiers._stripes import Stripes, WorkBuffers, ec_groups

HERE = Path(__file__).parent
CHILD = HERE / "children" / "erasure_child.py"


# -- groups and stripes ---------------------------------------------------------------------------
@pytest.mark.parametrize("nodes, data, parity, sizes", [
    (5, 4, 1, [5]), (4, 4, 1, [4]), (2, 4, 1, [2]), (10, 4, 1, [5, 5]), (11, 4, 1, [5, 6]), (14, 4, 1, [7, 7]),
    (6, 4, 2, [6]), (13, 4, 2, [6, 7]), (3, 4, 2, [3])])
def test_nodes_form_groups_of_data_plus_parity_the_remainder_spread_over_the_last(nodes, data, parity, sizes):
    groups = ec_groups(list(range(nodes)), data, parity)
    assert [len(g) for g in groups] == sizes
    assert sorted(r for g in groups for r in g) == list(range(nodes))


def test_ranks_of_a_group_are_on_distinct_nodes_with_the_same_local_index():
    nodes = [n for n in range(5) for _ in range(3)]  # 5 nodes of 3 ranks
    groups = ec_groups(nodes, 4, 1)
    assert groups == [[0, 3, 6, 9, 12], [1, 4, 7, 10, 13], [2, 5, 8, 11, 14]]


def test_too_few_nodes_is_a_clear_error():
    with pytest.raises(TierfsError, match="at least 3 nodes"):
        ec_groups([0, 0, 1, 1], 4, 2)
    with pytest.raises(ArgumentError):
        ErasureCodedTier(data=0)
    for block in (1001, 0):
        with pytest.raises(ArgumentError):
            ErasureCodedTier(block=block)


@pytest.mark.parametrize("m, parity", [(5, 1), (6, 2), (3, 1), (7, 3)])
def test_every_member_keeps_parity_pieces_and_gives_each_chunk_once(m, parity):
    s = Stripes(tuple(range(m)), parity, tuple(1000 + 7 * i for i in range(m)), block=64)
    d = m - parity
    assert s.chunk % 8 == 0 and s.chunk * d >= max(s.lengths)
    for i in range(m):
        assert len(s.kept(i)) == parity  # parity/d of a payload
        assert len(s.stripes_of(i)) == d  # each of its d chunks in one stripe
    for j in range(m):
        assert len(s.data_members(j)) == d and not set(s.data_members(j)) & set(s.holders(j))


def test_block_buffers_are_kept_between_exchanges_and_never_shared_while_lent():
    pool = WorkBuffers()
    with pool.lend(3, 64) as first:
        with pool.lend(2, 64) as second:  # an exchange running at once gets buffers of its own
            assert len({id(b) for b in first + second}) == 5
            assert all(b.size == 64 and b.dtype == np.uint8 for b in first + second)
    assert pool.nbytes == 5 * 64
    with pool.lend(4, 64) as again:  # the next save's exchange: no new pages
        assert {id(b) for b in again} <= {id(b) for b in first + second}
    with pool.lend(1, 128) as wider:  # the shards changed size: the old width goes
        assert wider[0].size == 128
    assert pool.nbytes == 128
    with pytest.raises(RuntimeError), pool.lend(1, 128):  # a transfer abandoned after a failure may still
        raise RuntimeError("a peer was lost")  # write into them: they are not lent again
    assert pool.nbytes == 0


def _manifest_of(payload: np.ndarray, layout: dict[str, list[tuple[str, int, int]]], block: int):
    """A manifest of files cut from ``payload`` in name order (``{file: [(entry, offset, length)]}``)."""
    from tierfs.format import Entry, Manifest, crc32c

    files, entries, at = {}, [], 0
    for f in sorted(layout):
        size = max(o + n for _, o, n in layout[f])
        for name, o, n in layout[f]:
            data = payload[at + o:at + o + n]
            entries.append(Entry(name, "array", "numpy", "uint8", [n], f, o, n,
                                 [crc32c(data[k:k + block]) for k in range(0, max(n, 1), block)]))
        files[f], at = size, at + size
    return Manifest(2, 0, 1, entries, files, block)


def test_a_rebuilt_payload_lands_in_the_arrays_and_files_it_belongs_to_and_is_verified_where_it_landed():
    """A lost member's payload received in blocks of any size, as a rebuild receives it (the padding after
    it included): each block inside a landed entry or inside a file with nothing landing goes straight
    there, each one across them through a block buffer; every entry is then checked where it is."""
    from tierfs.errors import ChecksumError
    from tierfs.tiers._stripes import Rebuilt

    rng = np.random.default_rng(7)
    # file a: a landed entry, one that is not, a gap; file b: a landed entry over all of it; file c: small ones
    layout = {"a": [("x", 16, 300), ("y", 316, 100), ("g", 500, 12)], "b": [("z", 0, 256)],
              "c": [("u", 0, 40), ("v", 40, 9)]}
    payload = rng.integers(0, 256, 512 + 256 + 49, dtype=np.uint8)
    m = _manifest_of(payload, layout, 64)
    for step in (7, 64, 128, 1000):
        padded = np.concatenate([payload, rng.integers(0, 256, 23, dtype=np.uint8)])
        arrays = {"x": np.zeros(300, np.uint8), "z": np.zeros(256, np.uint8)}
        dest = Rebuilt(m, arrays)
        spare = np.empty(step, np.uint8)
        kinds = set()
        for a in range(0, padded.size, step):
            b = min(a + step, padded.size)
            where, direct = dest.into(a, b, spare)
            where[:] = padded[a:b]
            if direct:
                kinds.add("landed" if any(np.shares_memory(where, v) for v in arrays.values()) else "file")
            else:
                kinds.add("apart")
                dest.settle(a, b, where)
        dest.verify()
        assert arrays["x"].tobytes() == payload[16:316].tobytes()
        assert arrays["z"].tobytes() == payload[512:768].tobytes()
        a = dest.files["a"]  # every byte of the files but the landed entries' (undefined there)
        assert a[:16].tobytes() + a[316:].tobytes() == payload[:16].tobytes() + payload[316:512].tobytes()
        assert dest.files["c"].tobytes() == payload[768:].tobytes()
        assert set(dest.files) == {"a", "b", "c"} and dest.landed.keys() == {"x", "z"}
        if step == 64:
            assert kinds == {"landed", "file", "apart"}, kinds
    arrays["z"][100] ^= 1  # damaged where it landed: the check names it
    with pytest.raises(ChecksumError, match="'z'"):
        dest.verify()
    with pytest.raises(ValueError, match="cannot land in an array of 10 bytes"):
        Rebuilt(m, {"x": np.zeros(10, np.uint8)})


def test_a_step_passed_over_because_a_group_lost_too_many_says_so():
    """A restore that goes back to an older step names the newer one it passed over, the ranks that cannot
    get it and, where the erasure-coded tier said why, that reason (its group lost more than its parity)."""
    from tierfs.core.restore.plan import RestorePlan

    why = "erasure group [0, 1, 2] lost 2 members [1, 2], more than parity=1"
    plan = RestorePlan([{1, 2}, {1, 2}, {1}], {}, {}, notes={2: why})
    assert plan.steps(None, ["ram", "erasure", "file"]) == [1]
    assert plan.passed_over(1) == [(2, f"held by only some ranks: rank(s) [2] cannot get it ({why})")]
    assert plan.passed_over(2) == []


# -- real jobs ------------------------------------------------------------------------------------
def job(world: int, shm: Path, obj: Path | str, mode: str, code: str, *extra: str) -> list[dict]:
    return gloo_job.run_job(world, CHILD, str(shm), str(obj), mode, code, *extra)


def fresh(saved: Path, tmp_path: Path) -> Path:
    shutil.copytree(saved / "shm", tmp_path / "shm")
    return tmp_path / "shm"


def test_node_rank_given_on_some_ranks_only_is_an_error_on_every_rank(tmp_path):
    outs = job(2, tmp_path / "shm", "-", "half-node-rank", "1:1")
    assert all("ranks disagree on whether ErasureCodedTier node_rank is given: [1, 0]" in o.get("error", "")
               for o in outs), outs


@pytest.fixture(scope="module")
def saved_4_1(tmp_path_factory):
    """5 ranks, one group of 4 data + 1 parity, steps 1 and 2 in RAM, parity and a file:// object tier."""
    root = tmp_path_factory.mktemp("ec41")
    outs = job(5, root / "shm", root / "obj", "save", "4:1")
    for o in outs:
        assert o["group"] == [0, 1, 2, 3, 4]
        assert o["steps"]["2"] == ["ram", "erasure", "file"]
        assert o["held"] == {"2": [r for r in range(5) if r != o["rank"]]}  # the newest step's parity
    return root


def test_4_1_parity_costs_a_quarter_of_a_shard(saved_4_1):
    node = saved_4_1 / "shm" / "node0"
    shard = sum(f.stat().st_size for f in (node / step_dirname(2)).glob("*.bin"))
    parity = sum(f.stat().st_size for f in (node / "erasure" / "rank_00000" / step_dirname(2)).glob("*.bin"))
    assert 0.25 * shard <= parity <= 0.25 * shard * 1.1 + 64  # the group's longest shard over 4, rounded


def test_the_jobs_heads_include_one_longer_than_a_swaps_first_message_and_others_that_fit(saved_4_1):
    # the head a member sends the others holds its manifest: rank 0's is longer than a swap's first message
    # (its second round runs), the others' fit; the rebuilds below are bit-exact from what was swapped
    sizes = [(saved_4_1 / "shm" / f"node{r}" / step_dirname(2) / f"rank_{r:05d}.manifest.json").stat().st_size
             for r in range(5)]
    assert sizes[0] > FIRST and max(sizes[1:]) < FIRST // 2, sizes


def test_4_1_a_lost_node_is_rebuilt_bit_exact(saved_4_1, tmp_path):
    shm = fresh(saved_4_1, tmp_path)
    shutil.rmtree(shm / "node2")
    outs = job(5, shm, saved_4_1 / "obj", "restore", "4:1")
    assert all(o.get("exact") and o["step"] == 2 for o in outs), outs
    assert [r["tier"] for r in outs[0]["ranks"]] == ["ram", "ram", "erasure", "ram", "ram"]
    assert outs[2]["held"] == {"2": [0, 1, 3, 4]}  # the replaced node keeps its parity pieces again


def test_4_1_damaged_parity_is_detected_and_the_object_tier_serves(saved_4_1, tmp_path):
    shm = fresh(saved_4_1, tmp_path)
    shutil.rmtree(shm / "node2")
    for n in (0, 1, 3, 4):  # every parity piece the rebuild reads is damaged
        f = shm / f"node{n}" / "erasure" / f"rank_{n:05d}" / step_dirname(2) / "parity.bin"
        data = bytearray(f.read_bytes())
        data[len(data) // 3] ^= 0x10
        f.write_bytes(bytes(data))
    outs = job(5, shm, saved_4_1 / "obj", "restore", "4:1")
    assert all(o.get("exact") and o["step"] == 2 for o in outs), outs
    assert outs[2]["tier"] == "file"
    assert any("erasure" in str(s) and "could not read" in str(s) for s in outs[2]["skipped"]), outs[2]["skipped"]


@pytest.fixture(scope="module")
def saved_4_2(tmp_path_factory):
    """6 ranks, one group of 4 data + 2 parity, steps 1 and 2 in RAM and parity, no slower tier."""
    root = tmp_path_factory.mktemp("ec42")
    outs = job(6, root / "shm", "-", "save", "4:2")
    assert all(o["steps"]["2"] == ["ram", "erasure"] for o in outs)
    return root


def test_4_2_two_lost_nodes_are_rebuilt_and_three_are_an_error_naming_the_loss(saved_4_2, tmp_path):
    shm = fresh(saved_4_2, tmp_path)
    shutil.rmtree(shm / "node1")
    shutil.rmtree(shm / "node4")
    outs = job(6, shm, "-", "restore", "4:2")
    assert all(o.get("exact") and o["step"] == 2 for o in outs), outs
    assert [r["tier"] for r in outs[0]["ranks"]] == ["ram", "erasure", "ram", "ram", "erasure", "ram"]
    shm = tmp_path / "three"
    shutil.copytree(saved_4_2 / "shm", shm)
    for n in (0, 2, 5):
        shutil.rmtree(shm / f"node{n}")
    outs = job(6, shm, "-", "restore", "4:2")
    assert all("CheckpointLostError" in o.get("error", "") for o in outs), outs
    assert "group [0, 1, 2, 3, 4, 5] lost 3 members [0, 2, 5], more than parity=2" in outs[0]["error"]
    assert "step 2" in outs[0]["error"] and "'erasure'" in outs[0]["error"]  # the steps and the tiers tried


@pytest.mark.parametrize("d", [1, 2, 3, 4, 8])
def test_parity_checksum_is_the_chunks_checksums_xored_so_one_damaged_chunk_shows(d):
    """How a parity=1 receiver checks every chunk it gets with one pass over the parity it computed."""
    from tierfs.format import crc32c
    from tierfs.tiers._encoding import xor_crc

    rng = np.random.default_rng(d)
    chunks = [rng.integers(0, 256, 4096, dtype=np.uint8) for _ in range(d)]
    parity = np.bitwise_xor.reduce(chunks)
    sums = [crc32c(c) for c in chunks]
    assert crc32c(parity) == xor_crc(sums, 4096)
    chunks[-1][100] ^= 0x08  # damaged on its way: its sender's checksum no longer matches
    assert crc32c(np.bitwise_xor.reduce(chunks)) != xor_crc(sums, 4096)
