"""The conformance suite of a :class:`~tierfs.tiers.base.Replicator` (the peer tier's role), run in a real
multi-process job: subclass :class:`ReplicatorTests` for yours.

    from tierfs.testing import ReplicatorTests

    def make() -> MyReplicator:            # in an importable module: every rank builds its own
        return MyReplicator(replicas=1)

    class TestMyReplicator(ReplicatorTests):
        factory = "mypkg.testing:make"

The suite starts a gloo job of ``world_size`` processes on this machine (:mod:`tierfs.testing.launch`),
each its own node with its own RAM directory, in which every rank runs
:mod:`tierfs.testing.replicator_rank`: it saves two steps to its RAM tier, binds a replicator to it,
replicates both, loses a shard and fetches it back, corrupts a copy, deletes the steps, and reports what it
saw. The tests below check those reports; the job runs once per subclass.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Any, Iterator

import pytest

from .launch import run_job
from .replicator_rank import LOST, STEP, resolve

__all__ = ["ReplicatorTests"]

Report = list[dict[str, Any]]


class ReplicatorTests:
    """Tests every :class:`~tierfs.tiers.base.Replicator` passes, in a real job of several processes.

    Subclass it with a name starting with ``Test`` and set :attr:`factory`; the other attributes have
    defaults that suit a replicator keeping its copies like the peer tier does.

    Attributes
    ----------
    factory : str
        ``"package.module:function"``: a callable with no arguments that returns a new, unbound replicator.
        Every rank imports and calls it (so it must be importable there: the ranks get this process's
        ``sys.path``). Required.
    corrupt : str
        ``"package.module:function"``: ``corrupt(replicator, step, source)`` damages the copy of
        ``source``'s shard of ``step`` that this rank's replicator keeps, so that ``fetch`` must refuse it.
        The default flips a byte of a copy kept in ``replicator.local`` (a :class:`~tierfs.tiers.Tier`).
    world_size : int
        Ranks (and nodes) of the job, at least 2; with 3 (the default) and one copy per shard, some rank
        keeps no copy of a given shard.
    timeout : float
        Seconds the job may take before every rank is killed.

    Notes
    -----
    The contract checked: the ranks agree on ``targets``, none of which is the rank itself; after
    ``replicate`` of two steps fails nothing, ``holdings()``, ``list_steps()`` and ``committed_steps()``
    report exactly the copies a rank keeps for the ranks that target it; ``capacity()`` is the RAM tier's;
    ``fetch`` gives a rank that lost its shard the shard bit for bit (manifest, marker, files) and None to
    every other rank, and a reason instead when the holder keeps no copy or its copy is corrupted;
    ``delete_step`` drops a step's copies and leaves the RAM tier's steps alone.
    """

    factory: str = ""
    corrupt: str = "tierfs.testing.replicator_rank:corrupt_local_copy"
    world_size: int = 3
    timeout: float = 120.0

    @pytest.fixture(scope="class")
    @classmethod
    def report(cls) -> Iterator[Report]:
        """Every rank's report of one job (run once per subclass), in rank order."""
        if not cls.factory:
            raise NotImplementedError(f"{cls.__name__} must set factory = 'package.module:function'")
        resolve(cls.factory)  # fails here, clearly, when the name is wrong
        resolve(cls.corrupt)
        base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None  # RAM tiers on tmpfs where there is one
        root = tempfile.mkdtemp(prefix="tierfs-replicator-", dir=base)
        try:
            config = {"factory": cls.factory, "corrupt": cls.corrupt, "root": root}
            yield run_job(cls.world_size, "tierfs.testing.replicator_rank", [json.dumps(config)],
                          timeout=cls.timeout)
        finally:
            shutil.rmtree(root, ignore_errors=True)

    # -- binding --------------------------------------------------------------------------------------
    def test_ranks_agree_on_targets_on_other_ranks(self, report: Report) -> None:
        targets = report[0]["targets"]
        assert all(r["targets"] == targets for r in report)
        assert len(targets) == self.world_size
        for rank, ts in enumerate(targets):
            assert ts and rank not in ts and all(0 <= t < self.world_size for t in ts), (rank, ts)

    def test_nothing_is_kept_before_replicating(self, report: Report) -> None:
        for r in report:
            assert r["before"] == {"list": {}, "holdings": {}, "committed": []}, r["rank"]

    # -- replicate ------------------------------------------------------------------------------------
    def test_replicate_fails_no_copy(self, report: Report) -> None:
        for r in report:
            assert r["failed"] == [[], []], r["rank"]

    def test_holdings_are_exactly_the_copies_for_the_ranks_that_target_it(self, report: Report) -> None:
        for r in report:
            src = _sources(report, r["rank"])
            assert r["replicated"]["holdings"] == ({"1": src, str(STEP): src} if src else {}), r["rank"]

    def test_steps_listed_are_the_steps_copied(self, report: Report) -> None:
        for r in report:
            kept = bool(_sources(report, r["rank"]))
            assert r["replicated"]["list"] == ({"1": True, str(STEP): True} if kept else {}), r["rank"]
            assert r["replicated"]["committed"] == ([1, STEP] if kept else []), r["rank"]

    def test_capacity_is_the_ram_tiers(self, report: Report) -> None:
        for r in report:
            used, budget, has_free = r["capacity"]["replicator"]
            assert [used, budget, has_free] == r["capacity"]["ram"], r["rank"]
            assert used > 0 and budget is not None, r["rank"]

    # -- fetch ----------------------------------------------------------------------------------------
    def test_fetch_gives_the_lost_shard_back_bit_exact(self, report: Report) -> None:
        got = report[LOST]["fetch"]
        assert got["kind"] == "shard" and got["exact"], got

    def test_fetch_lands_the_entries_the_landing_names_in_their_arrays(self, report: Report) -> None:
        got = report[LOST]["fetch_landed"]
        assert got["kind"] == "shard" and got["landed"] == ["big"] and got["exact"], got

    def test_fetch_gives_other_ranks_none(self, report: Report) -> None:
        for r in report:
            if r["rank"] != LOST:
                assert r["fetch"] == {"kind": "none"}, r["rank"]
                assert r["fetch_corrupt"] == r["fetch_landed"] == {"kind": "none"}, r["rank"]

    def test_fetch_from_a_rank_without_a_copy_gives_a_reason(self, report: Report) -> None:
        if "fetch_missing" not in report[LOST]:
            pytest.skip("every other rank keeps a copy of the lost shard")
        got = report[LOST]["fetch_missing"]
        assert got["kind"] == "reason" and got["why"], got

    def test_a_corrupted_copy_is_refused_with_a_reason(self, report: Report) -> None:
        got = report[LOST]["fetch_corrupt"]
        assert got["kind"] == "reason" and got["why"], got

    # -- delete_step ----------------------------------------------------------------------------------
    def test_delete_step_drops_the_copies_of_that_step(self, report: Report) -> None:
        for r in report:
            src = _sources(report, r["rank"])
            assert r["deleted_1"]["holdings"] == ({str(STEP): src} if src else {}), r["rank"]
            assert r["deleted_1"]["list"] == ({str(STEP): True} if src else {}), r["rank"]
            assert r["deleted_both"] == {"list": {}, "holdings": {}, "committed": []}, r["rank"]

    def test_delete_step_leaves_the_ram_tier_alone(self, report: Report) -> None:
        for r in report:
            assert r["ram"] == ({"1": True} if r["rank"] == LOST else {"1": True, str(STEP): True}), r["rank"]


def _sources(report: Report, rank: int) -> list[int]:
    """The ranks whose shard ``rank`` keeps a copy of: those that target it."""
    return [s for s, ts in enumerate(report[0]["targets"]) if rank in ts]
