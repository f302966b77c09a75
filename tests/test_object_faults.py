"""The object tier against a failing object store: real servers (SeaweedFS, moto) behind a fault-injecting
proxy (tests/_faultproxy.py), the real s3fs client, the real store and manager.

- A fifth of all requests faulted (503 SlowDown, 500 InternalError, resets mid-body, responses slower
  than the client's read timeout): saves and restores complete, bit-exact, also with the RAM tier wiped.
- The store down past every retry: one clear error on the next call, nothing counted durable that is
  not, RAM saves go on, and the next steps reach the store once it is back.
- Retries: a transient failure of a listing or a read is retried by the tier, a permanent one (404, 403)
  is not; an exhausted one is one ``TierUnavailableError`` naming the tier, the step and the file.

The clients retry too (botocore, then s3fs); tests that count attempts turn botocore's retries off
(``retries={"max_attempts": 0}``) and use faults s3fs does not retry itself (500 InternalError).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import s3fs

from _faultproxy import KINDS, FaultProxy, Request
from tierfs import BackgroundError, CheckpointManager, RestoreError, TieredStore, TierUnavailableError
from tierfs.format import MARKER, step_dirname
from tierfs.policies import FixedIntervalPolicy, LatestN
from tierfs.testing import assert_states_equal
from tierfs.tiers import MemoryTier, ObjectTier

pytestmark = pytest.mark.s3

SEED = 20240611
MiB = 1 << 20
FILE_SIZE = MiB  # several shard files per step, some larger than PART_SIZE: ranged reads
PART_SIZE = MiB


def state_for(step: int) -> dict:
    """About 3 MiB: two arrays larger than a shard file, a small one and JSON values."""
    rng = np.random.default_rng(step)
    return {"model": {"w": rng.standard_normal(384_000).astype(np.float32),
                      "b": rng.standard_normal(1000).astype(np.float32)},
            "opt": {"exp_avg": rng.standard_normal(192_000)}, "step": step, "note": "faults"}


def via(proxy: FaultProxy, opts: dict, *, client_retries: int | None = None, read_timeout: float = 1.0) -> dict:
    """``opts`` pointed at the proxy, with short client timeouts (and botocore's retries, if given)."""
    kw: dict = {"connect_timeout": 1.0, "read_timeout": read_timeout}
    if client_retries is not None:
        kw["retries"] = {"max_attempts": client_retries}  # retries after the first attempt
    return {**opts, "endpoint_url": proxy.url, "skip_instance_cache": True, "config_kwargs": kw}


def in_step(step: int) -> Callable[[Request], bool]:
    return lambda r: f"/{step_dirname(step)}/" in r.path


def named(name: str) -> Callable[[Request], bool]:
    return lambda r: r.path.endswith(f"/{name}")


def listing(r: Request) -> bool:
    return r.is_listing


@pytest.fixture
def proxy(seaweed_url):
    """A fault proxy in front of SeaweedFS."""
    with FaultProxy(seaweed_url[1]["endpoint_url"], seed=SEED) as p:
        yield p


@pytest.fixture(params=["seaweedfs", "moto"])
def either(request):
    """(url, storage_options, proxy): a fresh bucket of SeaweedFS, then of moto, behind a fault proxy."""
    url, opts = request.getfixturevalue({"seaweedfs": "seaweed_url", "moto": "s3_url"}[request.param])
    with FaultProxy(opts["endpoint_url"], seed=SEED) as p:
        yield url, opts, p


# -- a fifth of the requests fail --------------------------------------------------------------------
def test_saves_and_restores_are_bit_exact_with_a_fifth_of_requests_faulted(seaweed_url, proxy, shm_dir):
    url, opts = seaweed_url
    # opening a store fails fast by design (one clear line when the store cannot be reached, after the
    # client's own retry): the random faults start once it is open
    # and each kind at least once where it hurts most: a shard file's body cut, the marker's answer
    # late, a listing throttled, a ranged read's body cut, the marker's read failing
    proxy.fail_next(1, "reset", match=lambda r: r.method == "PUT" and ".bin" in r.path)
    proxy.fail_next(1, "slow", match=lambda r: r.method == "PUT" and r.path.endswith(MARKER))
    proxy.fail_next(1, "slowdown", match=listing)
    # one botocore retry (its jittered backoff, up to 1 s, is most of this test's time), then s3fs's and
    # the tier's; a "slow" fault costs the 0.5 s read timeout
    tiers = lambda: [MemoryTier(shm_dir, keep=LatestN(2)),  # noqa: E731
                     ObjectTier(url, via(proxy, opts, client_retries=1, read_timeout=0.5),
                                save=FixedIntervalPolicy(2), keep=LatestN(2), part_size=PART_SIZE)]
    with CheckpointManager(tiers(), file_size=FILE_SIZE) as mgr:
        proxy.set_faults(0.2)
        for step in range(5):
            assert mgr.save(step, state_for(step)) is True  # returns once copied into RAM
        mgr.wait_until_finished()
        assert mgr.store.steps() == {2: ["s3"], 3: ["ram"], 4: ["ram", "s3"]}
        got, info = mgr.store.restore(4, tiers=["s3"])
        assert info.tier == "s3"
        assert_states_equal(got, state_for(4))
    shutil.rmtree(shm_dir)  # the node is gone: only the object store holds the steps
    Path(shm_dir).mkdir(mode=0o700)
    proxy.set_faults(0.0)
    with CheckpointManager(tiers(), file_size=FILE_SIZE) as mgr:
        proxy.set_faults(0.2)
        proxy.fail_next(1, "reset", match=lambda r: r.method == "GET" and bool(r.range))
        proxy.fail_next(1, "internal", match=lambda r: r.method == "GET" and r.path.endswith(MARKER))
        target = state_for(99)  # same shapes, other values: every leaf must be overwritten
        assert mgr.restore(target) == 4
        assert mgr.last_restore_info.tier == "s3"
        assert_states_equal(target, state_for(4))
        assert mgr.restore(target, step=2) == 2
        assert_states_equal(target, state_for(2))
    assert proxy.scripted_left() == 0, "a request meant to be faulted never came"
    for kind in KINDS:
        assert proxy.requests(fault=kind), f"no request got the fault {kind!r}"
    faulted, total = len(proxy.requests(fault=False)), len(proxy.requests())
    # through no proxy: exactly the kept steps, committed, nothing left by retries or deletions (SeaweedFS
    # keeps an emptied directory, listed as "step_.../" by a delimited listing, until it is deleted too)
    assert ObjectTier(url, opts).list_steps() == {2: True, 4: True}, f"{faulted} of {total} requests faulted"
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **opts)

    def names(path: str) -> list[str]:
        return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(path))
    root = url.removeprefix("s3://")
    assert names(root) == ["ranks", step_dirname(2), step_dirname(4)]
    for bucket in names(f"{root}/ranks"):  # each rank's files: under its own key prefix
        assert names(f"{root}/ranks/{bucket}") == [step_dirname(2), step_dirname(4)], bucket


# -- the store stays down --------------------------------------------------------------------------
def test_store_down_past_the_retries_is_one_error_and_the_job_goes_on(either, shm_dir):
    url, opts, proxy = either
    obj = ObjectTier(url, via(proxy, opts, client_retries=0), save=FixedIntervalPolicy(2), retries=2)
    direct = ObjectTier(url, opts)  # the real server, through no proxy
    with CheckpointManager([MemoryTier(shm_dir, keep=LatestN(2)), obj], file_size=FILE_SIZE) as mgr:
        mgr.save(0, state_for(0))
        mgr.wait_until_finished()
        proxy.set_faults(1.0, ["internal"])  # down: every request answered 500
        mgr.save(1, state_for(1))
        mgr.save(2, state_for(2))  # committed in RAM; its upload fails in the background
        with pytest.raises(BackgroundError) as err:
            mgr.wait_until_finished()
        msg = str(err.value)
        assert "\n" not in msg and "tier 's3'" in msg and "step 2" in msg and "failed 2 time(s)" in msg, msg
        mgr.check_for_errors()  # raised once
        # bounded: every file of step 2 was tried exactly `retries` times, and no transfer still runs
        tries = {}
        for r in proxy.requests(match=in_step(2)):
            tries[r.path] = tries.get(r.path, 0) + 1
        assert tries and set(tries.values()) == {2}, tries
        assert mgr.store.steps() == {0: ["s3"], 1: ["ram"], 2: ["ram"]}
        assert direct.committed_steps() == [0]
        assert direct.list_steps().get(2) in (None, False), "step 2 looks committed on the store"
        assert mgr.save(3, state_for(3)) is True  # training saves to RAM go on while the store is down
        mgr.store.wait_until_committed()
        assert mgr.store.steps()[3] == ["ram"]
        proxy.clear()  # the store is back
        assert mgr.save(4, state_for(4)) is True
        mgr.wait_until_finished()
        assert mgr.store.steps() == {0: ["s3"], 3: ["ram"], 4: ["ram", "s3"]}
    assert direct.committed_steps() == [0, 4]
    with TieredStore([MemoryTier(shm_dir), direct]) as store:
        got, info = store.restore(4, tiers=["s3"])
        assert_states_equal(got, state_for(4))


def test_restore_from_a_store_that_fails_every_read_is_one_clear_error(seaweed_url, proxy, shm_dir):
    url, opts = seaweed_url
    tiers = lambda: [MemoryTier(shm_dir), ObjectTier(url, via(proxy, opts, client_retries=0), retries=1)]  # noqa: E731
    with TieredStore(tiers()) as store:
        store.save(1, state_for(1))
        store.wait_until_finished()
    shutil.rmtree(shm_dir)
    Path(shm_dir).mkdir(mode=0o700)
    with TieredStore(tiers()) as store:
        proxy.set_faults(1.0, ["reset"])  # every answer cut off mid-body (s3fs retries these itself too)
        with pytest.raises(RestoreError) as err:
            store.restore()
        assert "\n" not in str(err.value) and "'s3'" in str(err.value) and "step 1" in str(err.value), err.value
        proxy.clear()
        got, info = store.restore()
        assert info.tier == "s3" and info.step == 1
        assert_states_equal(got, state_for(1))


def test_a_failed_write_leaves_no_transfer_running(seaweed_url, proxy):
    """When one file of a write fails, the tier raises only once its other transfers have finished."""
    url, opts = seaweed_url
    tier = ObjectTier(url, via(proxy, opts, client_retries=0), retries=2)
    proxy.fail_next(2, "internal", match=named("a.bin"))
    proxy.fail_next(1, "slow", match=named("b.bin"))  # still running when a.bin has failed twice
    with pytest.raises(TierUnavailableError, match=r"tier 's3': step 3: upload a\.bin failed 2 time\(s\)"):
        tier.write_files(3, {"a.bin": b"a" * 1000, "b.bin": b"b" * 1000})
    seen = len(proxy.requests(match=in_step(3)))
    assert proxy.requests(fault=None, match=named("b.bin")), "b.bin was still uploading when the error came"
    tier.close()  # joins the tier's threads
    assert len(proxy.requests(match=in_step(3))) == seen, "a transfer of the failed write went on after it"


# -- what is retried --------------------------------------------------------------------------------
def test_transient_listing_and_read_failures_are_retried_by_the_tier(either):
    url, opts, proxy = either
    ObjectTier(url, opts).write_file(1, "rank_00000.0000.bin", b"x" * 5000)
    ObjectTier(url, opts).write_marker(1, b"{}")
    tier = ObjectTier(url, via(proxy, opts, client_retries=0), retries=3)
    proxy.fail_next(2, "internal", match=listing)
    assert tier.list_steps() == {1: True}
    assert len(proxy.requests(fault="internal", match=listing)) == 2
    proxy.fail_next(2, "internal", match=named("rank_00000.0000.bin"))
    assert tier.read_file(1, "rank_00000.0000.bin") == b"x" * 5000
    assert tier.read_range(1, "rank_00000.0000.bin", 10, 20) == b"x" * 10
    faults = [r.fault for r in proxy.requests(match=named("rank_00000.0000.bin"))]
    assert faults[:2] == ["internal"] * 2 and faults[2:] and set(faults[2:]) == {None}  # retried, then served
    proxy.fail_next(3, "internal", match=named("rank_00000.0000.bin"))  # one more than it tries
    with pytest.raises(TierUnavailableError) as err:
        tier.read_file(1, "rank_00000.0000.bin")
    assert "\n" not in str(err.value) and "step 1: read rank_00000.0000.bin failed 3 time(s)" in str(err.value)


def test_permanent_errors_are_not_retried(seaweed_url, proxy):
    url, opts = seaweed_url
    ObjectTier(url, opts).write_file(1, "rank_00000.0000.bin", b"x" * 100)
    tier = ObjectTier(url, via(proxy, opts), retries=4)  # botocore's own retries on, too
    with pytest.raises(FileNotFoundError):  # 404 from the server
        tier.read_file(1, "rank_00007.0000.bin")
    # asked once where each layout puts it (the step's marker, which says which, is not there): never retried
    asked = [r.path for r in proxy.requests(match=named("rank_00007.0000.bin"))]
    assert len(asked) == 2 and "/ranks/e0/step_000000000001/" in asked[0] and "/step_000000000001/" in asked[1]
    proxy.fail_next(5, "denied", match=named("rank_00000.0000.bin"))  # 403
    with pytest.raises(PermissionError):
        tier.read_file(1, "rank_00000.0000.bin")
    assert len(proxy.requests(match=named("rank_00000.0000.bin"))) == 1
    proxy.clear()
    wrong = ObjectTier(url, via(proxy, opts | {"secret": "wrong"}), retries=4)  # the server's own 403
    with pytest.raises(PermissionError):
        wrong.read_file(1, "rank_00000.0000.bin")
    assert len(proxy.requests(match=named("rank_00000.0000.bin"))) == 2
    with pytest.raises(TierUnavailableError, match="access denied .* check credentials"):
        TieredStore([ObjectTier(url, opts | {"secret": "wrong"})])


def test_a_marker_is_deleted_by_a_request_of_its_own_whose_failure_raises(seaweed_url, proxy):
    """Retention deletes a step's marker first, and the ranks then delete their files: a marker the store
    failed to delete must raise, never pass as deleted (a batch delete answers OK whatever befell each key,
    so a marker would stay over deleted files and look like a durable step). Files still go in one batch."""
    url, opts = seaweed_url
    for name in ("rank_00000.0000.bin", "rank_00000.0001.bin", MARKER):
        ObjectTier(url, opts).write_file(3, name, b"x" * 100)
    tier = ObjectTier(url, via(proxy, opts), retries=4)
    proxy.fail_next(1, "denied", match=named(MARKER))
    with pytest.raises(PermissionError):
        tier.delete_files(3, [MARKER])
    assert tier.committed_steps() == [3]  # the marker is there, and said so
    tier.delete_files(3, [MARKER])
    assert tier.committed_steps() == []
    tier.delete_files(3, ["rank_00000.0000.bin", "rank_00000.0001.bin"])
    deletes = proxy.requests(fault=None, match=lambda r: r.method in ("DELETE", "POST"))
    assert [(r.method, r.path.endswith(MARKER)) for r in deletes] == [("DELETE", True), ("POST", False)]


def test_parts_smaller_than_s3_allows_still_upload(seaweed_url):
    """part_size below S3's 5 MiB minimum: reads use it, multipart uploads use 5 MiB parts."""
    url, opts = seaweed_url
    tier = ObjectTier(url, opts, part_size=PART_SIZE)
    data = np.random.default_rng(0).integers(0, 255, 5 * PART_SIZE // 2, dtype=np.uint8).tobytes()
    tier.write_file(1, "rank_00000.0000.bin", data)  # 2.5 MiB >= 2 parts: a multipart upload
    got = tier.read_files(1, ["rank_00000.0000.bin"])["rank_00000.0000.bin"]  # three ranged reads
    assert bytes(got) == data
