"""TieredStore behaviour: policies per tier, fallbacks on damage, budgets and clear errors."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np
import pytest

from tierfs import (BackgroundError, CapacityError, RestoreError, StateMismatchError, StepExistsError, StepNotFoundError,
                    TieredStore, TierUnavailableError)
from tierfs.format import MARKER, spread_bucket, step_dirname
from tierfs.format.keys import key
from tierfs.policies import FixedIntervalPolicy, LatestN
from tierfs.testing import assert_states_equal
from tierfs.tiers import MemoryTier, ObjectTier

from _gatedtier import GatedTier


def state_for(step: int, n: int = 3, size: int = 50_000) -> dict:
    rng = np.random.default_rng(step)
    return {f"layer{i}.weight": rng.standard_normal(size).astype(np.float32) for i in range(n)} | {
        "step": step, "opt": {"exp_avg": rng.standard_normal(1000)}}


@pytest.fixture
def hybrid(shm_dir, tmp_path):
    def make(**kw):
        return TieredStore([
            MemoryTier(shm_dir, save=FixedIntervalPolicy(1), keep=LatestN(2)),
            ObjectTier(f"file://{tmp_path}/obj", save=FixedIntervalPolicy(10), keep=LatestN(3)),
        ], **kw)
    return make


def test_hybrid_policy_over_20_steps(hybrid, shm_dir, tmp_path):
    with hybrid() as store:
        for step in range(20):
            assert store.save(step, state_for(step)) is True
        store.wait_until_finished()
        assert store.steps() == {0: ["file"], 10: ["file"], 18: ["ram"], 19: ["ram"]}
    # The directories hold exactly those steps, all committed, nothing else.
    assert sorted(p.name for p in Path(shm_dir).iterdir() if not p.name.startswith(".")) == \
        [step_dirname(18), step_dirname(19)]
    obj = tmp_path / "obj"  # the markers under the steps, each rank's files under its bucket: rank 0's
    assert sorted(p.name for p in obj.iterdir()) == ["ranks", step_dirname(0), step_dirname(10)]
    assert sorted(p.name for p in (obj / key(0, MARKER)).parent.iterdir()) == [MARKER]
    assert [p.name for p in (obj / "ranks").iterdir()] == [spread_bucket(0)]
    assert sorted(p.name for p in (obj / "ranks" / spread_bucket(0)).iterdir()) == [step_dirname(0), step_dirname(10)]


def test_policy_skips_return_false(shm_dir, tmp_path):
    with TieredStore([MemoryTier(shm_dir, save=FixedIntervalPolicy(5))]) as store:
        assert [store.save(s, state_for(s)) for s in range(6)] == [True, False, False, False, False, True]
        assert store.save(7, state_for(7), force=True) is True
        assert sorted(store.steps()) == [5, 7]


def test_step_saved_only_for_slow_tier_is_staged_then_leaves_ram(shm_dir, tmp_path):
    with TieredStore([MemoryTier(shm_dir, save=FixedIntervalPolicy(4)),
                      ObjectTier(f"file://{tmp_path}/obj", save=FixedIntervalPolicy(3))]) as store:
        for s in range(1, 7):
            store.save(s, state_for(s))
        store.wait_until_finished()
        assert store.steps() == {3: ["file"], 4: ["ram"], 6: ["file"]}


def test_restore_newest_from_ram_and_metadata(hybrid):
    with hybrid() as store:
        for s in range(12):
            store.save(s, state_for(s), metadata={"lr": 0.1 * s})
        out, info = store.restore()
        assert info.step == 11 and info.tier == "ram" and info.skipped == []
        assert info.metadata == {"lr": pytest.approx(1.1)} and info.nbytes > 600_000
        assert_states_equal(out, state_for(11))
        store.wait_until_finished()  # step 10's copy to the file tier runs in the background
        out, info = store.restore(step=10, tiers=["file"])
        assert info.tier == "file"
        assert_states_equal(out, state_for(10))


def test_ram_wiped_restores_from_object_tier(hybrid, shm_dir):
    with hybrid() as store:
        for s in range(12):
            store.save(s, state_for(s))
    for p in Path(shm_dir).iterdir():
        os.system(f"rm -rf {p}")
    with hybrid() as store:
        target = state_for(0)
        info = store.restore_into(target)
        assert info.step == 10 and info.tier == "file"
        assert_states_equal(target, state_for(10))


def test_flipped_byte_in_ram_is_detected_and_served_from_object(hybrid, shm_dir):
    with hybrid() as store:
        for s in range(11):
            store.save(s, state_for(s))
        store.wait_until_finished()
    shard = Path(shm_dir) / step_dirname(10) / "rank_00000.0000.bin"
    with open(shard, "r+b") as f:
        f.seek(123_456)
        b = f.read(1)
        f.seek(123_456)
        f.write(bytes([b[0] ^ 0x01]))
    with hybrid() as store:
        target = state_for(0)
        info = store.restore_into(target)
        assert info.step == 10 and info.tier == "file"
        assert [(t, s) for t, s, _ in info.skipped] == [("ram", 10)]
        assert "checksum mismatch" in info.skipped[0][2] and "layer" in info.skipped[0][2]
        assert_states_equal(target, state_for(10))


def test_damaged_newest_everywhere_falls_back_to_older_step(shm_dir):
    with TieredStore([MemoryTier(shm_dir, keep=LatestN(2))]) as store:
        store.save(1, state_for(1))
        store.save(2, state_for(2))
    with open(Path(shm_dir) / step_dirname(2) / "rank_00000.manifest.json", "r+b") as f:
        f.write(b"X")
    with TieredStore([MemoryTier(shm_dir)]) as store:
        out, info = store.restore()
        assert info.step == 1 and "manifest" in info.skipped[0][2]
        assert_states_equal(out, state_for(1))
        with pytest.raises(RestoreError, match="does not match"):
            store.restore(step=2)
        # the job redoes step 2: saving it replaces the damaged copy the restore passed over
        store.restore()
        store.save(2, state_for(2))
        assert_states_equal(store.restore()[0], state_for(2))
        with pytest.raises(StepExistsError):  # only passed-over steps are replaced without overwrite=True
            store.save(1, state_for(1))


def test_step_without_marker_is_never_restored_and_is_cleaned_up(shm_dir):
    with TieredStore([MemoryTier(shm_dir, keep=LatestN(5))]) as store:
        store.save(1, state_for(1))
        store.save(2, state_for(2))
    (Path(shm_dir) / step_dirname(2) / MARKER).unlink()
    tier = MemoryTier(shm_dir)
    assert tier.list_steps() == {1: True, 2: False}
    with TieredStore([tier]) as store:
        assert store.steps() == {1: ["ram"]}
        out, info = store.restore()
        assert info.step == 1
        assert not (Path(shm_dir) / step_dirname(2)).exists(), "uncommitted leftovers are removed on open"


def test_nothing_to_restore(shm_dir):
    with TieredStore([MemoryTier(shm_dir)]) as store:
        with pytest.raises(StepNotFoundError, match="nothing to restore"):
            store.restore()
        store.save(3, state_for(3))
        with pytest.raises(StepNotFoundError, match="step 4"):
            store.restore(step=4)


def test_saving_a_committed_step_again(shm_dir):
    with TieredStore([MemoryTier(shm_dir)]) as store:
        store.save(3, state_for(3))
        with pytest.raises(StepExistsError, match="overwrite=True"):
            store.save(3, state_for(4))
        store.save(3, state_for(4) | {"step": 3}, overwrite=True)
        out, _ = store.restore()
        assert out["layer0.weight"].tobytes() == state_for(4)["layer0.weight"].tobytes()


def test_over_budget_fails_before_writing_and_keeps_earlier_steps(shm_dir):
    one = 3 * 50_000 * 4 + 8000  # bytes of one step's arrays
    with TieredStore([MemoryTier(shm_dir, keep=LatestN(2), budget=int(2.5 * one))]) as store:
        store.save(1, state_for(1))
        store.save(2, state_for(2))
        with pytest.raises(CapacityError, match=r"RAM tier .* step 3 needs .*budget"):
            store.save(3, state_for(3))
        assert store.steps() == {1: ["ram"], 2: ["ram"]}
        assert not (Path(shm_dir) / step_dirname(3)).exists()
        out, info = store.restore()
        assert_states_equal(out, state_for(2))
    with TieredStore([MemoryTier(shm_dir, keep=LatestN(2), budget=int(3.5 * one))]) as store:
        for s in range(3, 10):  # (kept + 1) steps fit: steady state reuses pooled buffers
            store.save(s, state_for(s))
        assert sorted(store.steps()) == [8, 9]


def test_a_spare_made_while_a_save_stages_neither_takes_its_room_nor_leaves_the_tier_over_budget(shm_dir):
    """The background makes a spare buffer for the next save while that save stages (released as the save
    starts staging, so either may get there first): the save finds room all the same (the spare's bytes
    count as free), and the spare is kept only if it still fits, so at rest the tier holds no more than its
    budget (two kept steps and a spare would be 3 steps' bytes in a budget of 2.5) and the next step that
    does not fit fails before writing."""
    from tierfs.testing import hooks

    one = 3 * 50_000 * 4 + 8000  # bytes of one step's arrays
    reached, go = threading.Event(), threading.Event()

    def spare(nbytes):  # the background, about to make the spare: held until save 2 stages
        reached.set()
        assert go.wait(30)

    def staging(stage, step, tier):
        if stage == "staging" and step == 2:
            go.set()

    with hooks.on("spare", spare), hooks.on("stage", staging):
        with TieredStore([MemoryTier(shm_dir, keep=LatestN(2), budget=int(2.5 * one))]) as store:
            ram = store.tiers[0]
            store.save(1, state_for(1))
            assert reached.wait(30)
            store.save(2, state_for(2))
            store.wait_until_finished()
            stats = ram.stats()
            assert stats["made_ahead"] == 1 and stats["reused"] + stats["created"] == 3, stats
            assert ram.capacity().used <= int(2.5 * one)
            with pytest.raises(CapacityError, match="step 3 needs"):
                store.save(3, state_for(3))
            assert store.steps() == {1: ["ram"], 2: ["ram"]}
            assert_states_equal(store.restore()[0], state_for(2))


def test_a_spare_being_made_counts_as_free_only_for_the_bytes_it_already_holds(shm_dir):
    """A spare buffer the background has begun but not yet made holds no bytes: a save that needs more room
    than the budget has left fails before writing, whether or not a spare is under way (counting the spare's
    whole size as free would let the save in, and the tier would end over its budget)."""
    from tierfs.testing import hooks

    small, big = 250_000, 375_000  # step 1's array, then step 2's: more than the budget leaves after step 1
    budget = 2 * small + 20_000  # room for step 1 and a spare of its size, not for step 2 beside step 1
    reached, go = threading.Event(), threading.Event()

    def spare(nbytes):  # the background, about to make the spare of step 1's size: held until save 2 ended
        reached.set()
        assert go.wait(30)

    with hooks.on("spare", spare):
        with TieredStore([MemoryTier(shm_dir, keep=LatestN(2), budget=budget)]) as store:
            ram = store.tiers[0]
            store.save(1, {"w": np.full(small, 1, np.uint8)})
            assert reached.wait(30)
            try:
                with pytest.raises(CapacityError, match="step 2 needs"):
                    store.save(2, {"w": np.full(big, 2, np.uint8)})
            finally:
                go.set()
            store.wait_until_finished()
            assert ram.capacity().used <= budget
            assert ram.stats()["made_ahead"] == 1  # the spare fits beside step 1: kept
            assert store.steps() == {1: ["ram"]}
            assert (store.restore()[0]["w"] == 1).all()


def test_pooled_buffers_are_reused_across_steps(shm_dir):
    tier = MemoryTier(shm_dir, keep=LatestN(1))
    with TieredStore([tier]) as store:
        store.save(0, state_for(0))
        store.save(1, state_for(1))  # step 0's files go to the pool
        before = tier.stats()
        assert before["pooled"]
        store.save(2, state_for(2))  # ... and come back as step 2's files
        after = tier.stats()
        assert after["reused"] - before["reused"] >= before["pooled"] and after["created"] == before["created"]
        out, _ = store.restore()
        assert_states_equal(out, state_for(2))


def test_saves_while_an_upload_holds_an_old_step_copy_into_buffers_made_ahead(shm_dir, tmp_path):
    """A step being uploaded stays in RAM past its keep policy, so its buffers cannot be the next saves'
    spares: a spare set is made in the background after a commit, and the saving thread still makes none."""
    ram = MemoryTier(shm_dir, keep=LatestN(2))
    slow = GatedTier(f"file://{tmp_path}/o", name="slow", save=FixedIntervalPolicy(100))
    with TieredStore([ram, slow], max_in_flight=8) as store:
        made = []  # buffers each save made on the saving thread
        try:
            for s in range(8):  # step 0 goes to the slow tier too, whose upload waits at the gate
                store.wait_until_committed()  # the commit worker is idle: what it made ahead is counted before
                before = ram.stats()
                store.save(s, state_for(s), blocking=False)
                after = ram.stats()
                made.append((after["created"] - after["made_ahead"]) - (before["created"] - before["made_ahead"]))
        finally:
            slow.gate.set()
        assert made[3:] == [0] * 5, made  # past the warm-up, with step 0 held from step 2 on
        assert ram.stats()["made_ahead"] > 0
        store.wait_until_finished()
        assert store.steps()[0] == ["slow"] and sorted(store.steps())[-2:] == [6, 7]
        out, _ = store.restore(step=0)
        assert_states_equal(out, state_for(0))
        one_set = sum(f.stat().st_size for f in (Path(shm_dir) / step_dirname(7)).glob("*.bin"))
        assert 0 < ram.stats()["pooled_bytes"] <= one_set  # step 0's buffers came back: the extra set went


def test_a_step_staged_again_after_a_failed_save_counts_once_in_the_spare_set(shm_dir):
    """A save retried with the same step stages its files again: the spare set made ahead is one set of
    them, not one per try."""
    ram = MemoryTier(shm_dir, keep=LatestN(1))
    sizes = {"rank_00000.0000.bin": 64 * 1024, "rank_00000.0001.bin": 128 * 1024}
    with TieredStore([ram]):
        for _ in range(3):  # staged, the save fails, the caller tries the step again
            ram.buffers(5, sizes)
            ram.discard(5)
        ram.buffers(5, sizes)
        ram.discard(5)  # its buffers go to the pool: one set of them
        ram.prepare(5, sizes)  # made once the step is saved: nothing is missing
        assert ram.stats()["made_ahead"] == 0 and ram.stats()["pooled_bytes"] == sum(sizes.values())


def test_a_spare_whose_room_cannot_be_counted_is_given_back_and_no_longer_counts_as_free(shm_dir):
    """The background made a spare but counting the tier's room then failed (raised): the spare is removed,
    not left on disk outside the pool, and no staging counts it as free any more."""
    from tierfs.tiers._mapped import Pool

    pool = Pool(Path(shm_dir) / "pool")
    pool.limit = 1 << 20
    counted = []

    def room():  # room to begin the spare; then the count fails, as an unreadable directory's would
        counted.append(1)
        if len(counted) > 1:
            raise PermissionError("the RAM directory cannot be read")
        return None

    with pytest.raises(PermissionError):
        pool.fill([64 * 1024], threading.Lock(), room)
    assert pool.making is None and pool.made() == 0 and pool.files == []
    assert list((Path(shm_dir) / "pool").iterdir()) == []


def test_a_save_does_not_wait_for_spare_buffers_being_made_in_the_background(shm_dir, monkeypatch):
    """The spare set is made at a low priority; a save that needs buffers meanwhile makes what the pool
    lacks itself, and the background stops after the file it is making (which the pool keeps)."""
    from tierfs.tiers._mapped import Pool

    gate, making = threading.Event(), threading.Event()
    real = Pool.new

    def held_at_the_gate(self, path, size, ahead=False):  # the background's file takes as long as the test says
        if ahead:
            making.set()
            gate.wait(120)
        return real(self, path, size, ahead)
    monkeypatch.setattr(Pool, "new", held_at_the_gate)
    ram = MemoryTier(shm_dir, keep=LatestN(1))
    sizes = {"rank_00000.0000.bin": 64 * 1024, "rank_00000.0001.bin": 128 * 1024}
    with TieredStore([ram]):
        ram.buffers(1, sizes)  # step 1 staged: a spare set is one such set
        spares = threading.Thread(target=ram.prepare, args=(1, sizes))
        spares.start()
        try:
            assert making.wait(120)
            staged = threading.Thread(target=ram.buffers, args=(2, sizes))
            staged.start()
            staged.join(120)
            assert not staged.is_alive()  # it did not wait for the gate
            assert ram.stats()["created"] == 4 and ram.stats()["made_ahead"] == 0
        finally:
            gate.set()
            spares.join(120)
        # the file under way went to the pool; the next one was not made
        assert ram.stats()["made_ahead"] == 1 and ram.stats()["pooled_bytes"] == 128 * 1024


def test_directories_are_private(shm_dir, tmp_path):
    ram = Path(shm_dir) / "job"
    with TieredStore([MemoryTier(ram), ObjectTier(f"file://{tmp_path}/o")]) as store:
        store.save(1, state_for(1))
        store.wait_until_finished()
    for d in (ram, ram / step_dirname(1), tmp_path / "o"):
        assert d.stat().st_mode & 0o777 == 0o700, d
    assert (ram / step_dirname(1) / "rank_00000.0000.bin").stat().st_mode & 0o077 == 0


def test_private_directories_are_made_or_made_private(tmp_path):
    from tierfs.util.fileio import make_private_dir

    deep = tmp_path / "a" / "b" / "c"
    make_private_dir(deep)  # parents too
    assert deep.is_dir() and deep.stat().st_mode & 0o777 == 0o700
    open_dir = tmp_path / "shared"
    open_dir.mkdir(mode=0o755)
    open_dir.chmod(0o755)
    make_private_dir(str(open_dir))  # one that others can enter is closed to them
    assert open_dir.stat().st_mode & 0o777 == 0o700
    make_private_dir(open_dir)  # again: nothing to do
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileExistsError):
        make_private_dir(tmp_path / "file")


def test_ram_tier_files_are_fsynced_unless_on_tmpfs(shm_dir, tmp_path, monkeypatch):
    """On tmpfs an fsync does nothing but cost its system calls; elsewhere a manifest is written durably."""
    from tierfs.tiers.rootdir import filesystem_type

    synced: list[int] = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real(fd))[1])
    for path, tmpfs in ((shm_dir, True), (tmp_path / "disk", False)):
        if not tmpfs and filesystem_type(tmp_path) == "tmpfs":
            continue  # (no other file system at hand)
        tier = MemoryTier(path)
        tier.open()
        try:
            synced.clear()
            tier.write_file(1, "rank_00000.manifest.json", b"{}")
            assert bool(synced) is not tmpfs, path
            assert (Path(path) / step_dirname(1) / "rank_00000.manifest.json").read_bytes() == b"{}"
        finally:
            tier.close()


def test_restore_rejects_mismatched_target(shm_dir):
    with TieredStore([MemoryTier(shm_dir)]) as store:
        store.save(1, state_for(1))
        bad = state_for(1)
        bad["layer0.weight"] = np.zeros(10, np.float32)
        with pytest.raises(ValueError, match="layer0.weight.*shape"):
            store.restore_into(bad)
        missing = state_for(1) | {"extra": np.zeros(3)}
        with pytest.raises(StateMismatchError, match="extra"):
            store.restore_into(missing)


def test_zero_copy_restore_views_are_never_reused(shm_dir):
    tier = MemoryTier(shm_dir, keep=LatestN(1))
    with TieredStore([tier]) as store:
        store.save(1, state_for(1))
        out, _ = store.restore(zero_copy=True)
        assert not out["layer0.weight"].flags.writeable
        for s in range(2, 5):
            store.save(s, state_for(s))
        assert_states_equal(out, state_for(1))  # the views still hold step 1's bytes


def test_bad_inputs_give_clear_errors(shm_dir):
    with pytest.raises(ValueError, match="at least one tier"):
        TieredStore([])
    with pytest.raises(ValueError, match="unique"):
        TieredStore([MemoryTier(shm_dir), MemoryTier(shm_dir)])
    with pytest.raises(TierUnavailableError, match="nosuchproto"):
        ObjectTier("nosuchproto://bucket/x")
    with TieredStore([MemoryTier(shm_dir)]) as store:
        with pytest.raises(TypeError, match="unsupported leaf type"):
            store.save(1, {"x": object()})
        with pytest.raises(TypeError, match="metadata must be JSON"):
            store.save(1, {"x": np.zeros(3)}, metadata={"f": object()})
        with pytest.raises(TypeError, match="object/structured"):
            store.save(1, {"x": np.array([object()])})
        assert store.steps() == {}


def test_missing_bucket_is_one_clear_error(s3_storage_options, gcs_storage_options):
    with pytest.raises(TierUnavailableError, match="bucket 'no-such-bucket' does not exist"):
        TieredStore([ObjectTier("s3://no-such-bucket/run", storage_options=s3_storage_options)])
    with pytest.raises(TierUnavailableError, match="bucket 'no-such-bucket' does not exist"):
        TieredStore([ObjectTier("gs://no-such-bucket/run", storage_options=gcs_storage_options)])


def test_storage_options_are_honoured(s3_url, shm_dir):
    url, opts = s3_url
    tier = ObjectTier(url, storage_options=opts)
    assert tier.fs.client_kwargs.get("endpoint_url", tier.fs.endpoint_url) == opts["endpoint_url"]
    with TieredStore([MemoryTier(shm_dir), tier]) as store:
        store.save(1, state_for(1))
        store.wait_until_finished()
        assert store.steps() == {1: ["ram", "s3"]}
        out, info = store.restore(tiers=["s3"])
        assert info.tier == "s3"
        assert_states_equal(out, state_for(1))


def test_background_failure_is_raised_by_the_next_call(s3_url, shm_dir):
    import s3fs

    url, opts = s3_url
    with TieredStore([MemoryTier(shm_dir, keep=LatestN(2)), ObjectTier(url, storage_options=opts)]) as store:
        store.save(1, state_for(1))
        store.wait_until_finished()
        fs = s3fs.S3FileSystem(skip_instance_cache=True, **opts)
        fs.rm("tierfs-test", recursive=True)  # the bucket disappears under the running job
        store.save(2, state_for(2))  # RAM commit succeeds; the upload fails in the background
        with pytest.raises(BackgroundError, match="background copy failed"):
            store.wait_until_finished()
        assert store.steps()[2] == ["ram"], "a failed copy is not counted as stored"
        store.save(3, state_for(3))  # the error was reported once; the job goes on
        with pytest.raises(BackgroundError):
            store.close()


@pytest.fixture
def tiny_tmpfs(tmp_path):
    """A real 4 MiB tmpfs, so 'out of space' is the kernel's, not a budget."""
    import subprocess

    mnt = tmp_path / "tiny"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m,mode=0700", "tmpfs", str(mnt)],
                      capture_output=True).returncode != 0:
        pytest.skip("mounting a tmpfs needs root")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_full_tmpfs_is_a_clean_capacity_error(tiny_tmpfs):
    ram = tiny_tmpfs / "job"
    with TieredStore([MemoryTier(ram, keep=LatestN(10))]) as store:
        for s in range(5):  # ~0.6 MB each
            store.save(s, state_for(s))
        store.wait_until_finished()  # the tier's spare buffers are in place
        # someone else fills the tmpfs
        with open(tiny_tmpfs / "filler", "wb") as f:
            f.write(b"\0" * (os.statvfs(tiny_tmpfs).f_bavail * os.statvfs(tiny_tmpfs).f_frsize - 100_000))
        bigger = state_for(5) | {"extra": np.ones(100_000, np.float32)}  # more than the spare buffers hold
        with pytest.raises(CapacityError, match="step 5 needs"):
            store.save(5, bigger)
        assert not (ram / step_dirname(5)).exists()
        assert sorted(store.steps()) == [0, 1, 2, 3, 4]
        out, info = store.restore()
        assert_states_equal(out, state_for(4))
        (tiny_tmpfs / "filler").unlink()
        store.save(5, bigger)  # space back: the job goes on
        out, info = store.restore()
        assert_states_equal(out, bigger)


def test_unreachable_endpoint_is_not_reported_as_missing_bucket(s3_storage_options):
    # the client's own retries of a refused connection (with backoff) only make the test slow
    opts = s3_storage_options | {"endpoint_url": "http://127.0.0.1:1",
                                 "config_kwargs": {"retries": {"max_attempts": 1}}}
    with pytest.raises(TierUnavailableError, match="cannot reach the store"):
        TieredStore([ObjectTier("s3://tierfs-test/run", storage_options=opts)])


def test_reader_with_cleanup_false_leaves_partial_steps_alone(shm_dir):
    with TieredStore([MemoryTier(shm_dir, keep=LatestN(5))]) as store:
        store.save(1, state_for(1))
        store.save(2, state_for(2))
    (Path(shm_dir) / step_dirname(2) / MARKER).unlink()  # as if step 2 were still being written
    with TieredStore([MemoryTier(shm_dir)], cleanup=False) as reader:
        out, info = reader.restore()
        assert info.step == 1
    assert (Path(shm_dir) / step_dirname(2) / "rank_00000.manifest.json").exists()


def test_bad_credentials_are_one_clear_error(s3_storage_options, monkeypatch):
    import moto.settings

    monkeypatch.setattr(moto.settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0)  # the server checks keys now
    opts = s3_storage_options | {"key": "AKIAWRONGWRONGWRONG0", "secret": "wrong"}
    with pytest.raises(TierUnavailableError, match="access denied .* check credentials"):
        TieredStore([ObjectTier("s3://tierfs-test/run", storage_options=opts)])


def test_a_target_that_would_silently_miss_saved_values_is_a_mismatch_naming_them(shm_dir):
    """Restoring in place into a fresh optimizer's state (empty until its first step) would load none of
    its moments, and a tensor of several elements where the step holds a plain value would be swapped out
    of the mapping while the tensor (a module's buffer, say) kept its value: both are StateMismatchErrors
    naming the key. A number goes into a one-element tensor or array in place (the same object), and the
    right target restores bit-exact."""
    torch = pytest.importorskip("torch")
    net = torch.nn.Linear(4, 2)
    opt = torch.optim.Adam(net.parameters())
    net(torch.ones(1, 4)).sum().backward()
    opt.step()
    with TieredStore([MemoryTier(shm_dir)]) as store:
        store.save(1, {"model": net.state_dict(), "optim": opt.state_dict(), "seen": 5})
        fresh = torch.optim.Adam(torch.nn.Linear(4, 2).parameters())
        with pytest.raises(StateMismatchError, match=r"'optim/state' is empty but step 1 holds 6 entries under it "
                                                     r"\(e.g. 'optim/state/0/"):
            store.restore_into({"optim": fresh.state_dict()})
        with pytest.raises(StateMismatchError, match=r"'seen': step 1 holds a plain value \(int 5\) where the "
                                                     r"target has a Tensor of 3 elements"):
            store.restore_into({"seen": torch.zeros(3)})
        one, arr = torch.zeros(()), np.zeros((1, 1))
        for t in (one, arr):
            into = {"seen": t}
            store.restore_into(into)
            assert into["seen"] is t and float(t.reshape(-1)[0]) == 5.0
        fresh_net = torch.nn.Linear(4, 2)
        fresh_opt = torch.optim.Adam(fresh_net.parameters())
        fresh_net(torch.ones(1, 4)).sum().backward()
        fresh_opt.step()  # its state exists now: the step's values go into it
        target = {"model": fresh_net.state_dict(), "optim": fresh_opt.state_dict(), "seen": 0}
        assert store.restore_into(target).step == 1 and target["seen"] == 5
        assert all(torch.equal(a, b) for a, b in zip(fresh_net.state_dict().values(), net.state_dict().values()))
        want = opt.state_dict()["state"][0]
        got = target["optim"]["state"][0]
        assert all(torch.equal(got[k], want[k]) for k in ("exp_avg", "exp_avg_sq", "step"))
