"""What the object tier asks of the store: a save's requests are its uploads plus a few small ones (no
request per file beyond its upload); requests refused for the rate (S3's 503 SlowDown, GCS's 429) are
waited out with jittered backoff, outside the retry count, and a job-wide request budget keeps every rank
within its share.

The store is real (moto) behind the fault proxy (tests/_faultproxy.py) in its token-bucket mode: each key
prefix serves a fixed number of requests per second, shared by every client, and answers 503 SlowDown
beyond it. The client is the real s3fs, its own retries turned down so that tierfs's are the ones tested.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
import urllib.parse
from pathlib import Path

import botocore.exceptions
import numpy as np
import pytest
import s3fs
from gcsfs.retry import HttpError
from s3fs.errors import translate_boto_error

import gloo_job
from _faultproxy import FaultProxy
from tierfs import TieredStore, TierUnavailableError
from tierfs.cli import main
from tierfs.util.retry import Throttled, retry, throttled
from tierfs.format import MARKER, step_dirname
from tierfs.format.keys import key
from tierfs.policies import LatestN
from tierfs.testing import assert_states_equal
from tierfs.tiers import MemoryTier, ObjectTier
from tierfs.tiers._budget import JobBudget
from tierfs.tiers._parts import upload


CHILD = Path(__file__).resolve().parent / "children" / "throttle_child.py"
OPEN_CHILD = Path(__file__).resolve().parent / "children" / "open_child.py"


def slowdown() -> Exception:
    """What s3fs raises for S3's answer once its own retries are spent."""
    err = botocore.exceptions.ClientError(
        {"Error": {"Code": "SlowDown", "Message": "Please reduce your request rate."},
         "ResponseMetadata": {"HTTPStatusCode": 503}}, "PutObject")
    return translate_boto_error(err)


def internal() -> Exception:
    err = botocore.exceptions.ClientError(
        {"Error": {"Code": "InternalError", "Message": "We encountered an internal error."},
         "ResponseMetadata": {"HTTPStatusCode": 500}}, "PutObject")
    return translate_boto_error(err)


class Clock:
    """A fake clock that sleeping moves on."""

    def __init__(self) -> None:
        self.now, self.slept = 0.0, []

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.now += s


# -- recognising throttling and waiting it out --------------------------------------------------------
def test_throttling_is_told_from_other_failures_for_s3_and_gcs():
    assert throttled(slowdown())
    assert throttled(HttpError({"code": 429, "message": "rate limit exceeded"}))
    assert throttled(HttpError({"code": 503, "message": "Service Unavailable"}))
    assert not throttled(internal())
    assert not throttled(HttpError({"code": 500, "message": "backend error"}))
    assert not throttled(ConnectionResetError("connection reset by peer"))


def test_throttled_tries_do_not_count_and_other_failures_do():
    clock = Clock()
    answers = [slowdown()] * 12 + [internal()] + [slowdown()] * 3 + ["done"]

    def request():
        a = answers.pop(0)
        if isinstance(a, Exception):
            raise a
        return a

    assert retry(request, attempts=2, what="upload", label="tier s3", sleep=clock.sleep, clock=clock) == "done"
    assert not answers and len(clock.slept) == 16  # 15 throttled tries waited out, one 500 retried
    waits = clock.slept[:12]
    assert max(waits) <= 20.0 and len(set(waits)) > 1  # jittered, bounded

    def failing():
        raise internal()
    with pytest.raises(OSError, match="internal error"):
        retry(failing, attempts=2, what="upload", label="tier s3", sleep=clock.sleep, clock=clock)


def test_throttling_past_the_patience_is_one_error_saying_what_to_do():
    clock = Clock()

    def request():
        raise slowdown()
    with pytest.raises(Throttled) as e:
        retry(request, attempts=3, what="step 7: upload rank_00001.bin", label="tier s3", sleep=clock.sleep,
              clock=clock, patience=120.0)
    assert isinstance(e.value, TierUnavailableError)
    msg = str(e.value)
    assert "\n" not in msg and "step 7: upload rank_00001.bin" in msg and "requests_per_second" in msg, msg
    assert 120.0 <= clock.now <= 141.0


def test_each_rank_spends_its_share_of_the_job_s_budget_in_bursts_of_a_second():
    clock = Clock()
    b = JobBudget(40.0, world=4, clock=clock, sleep=clock.sleep)  # 10 requests per second for this rank
    for _ in range(10):  # a burst of one second's worth passes at once
        b.take()
    assert clock.now == 0.0
    for _ in range(20):
        b.take()
    assert 2.0 - 1e-9 <= clock.now <= 3.0 + 1e-9  # 30 requests at 10/s: at most rate x t + a burst in t
    start = clock.now
    b.take(25)  # more than a burst (a multipart upload): waits for what came before, then its own time
    b.take()
    assert clock.now - start >= 2.5 - 1e-9
    assert upload("s3", 1 << 20, 5 << 20)[1] == 1 and upload("s3", 12 << 20, 5 << 20)[1] == 5
    assert upload("s3", 8 << 20, 5 << 20)[1] == 1  # under two parts: put whole, as s3fs does


# -- a real store ----------------------------------------------------------------------------------------
def state_for(step: int) -> dict:
    rng = np.random.default_rng(step)
    return {"model": {f"layer{i}.weight": rng.standard_normal(20_000).astype(np.float32) for i in range(6)},
            "opt": {"exp_avg": rng.standard_normal(30_000)}, "step": step}


@pytest.fixture
def throttling(s3_url):
    url, opts = s3_url
    with FaultProxy(opts["endpoint_url"]) as p:
        yield url, opts, p


def via(proxy: FaultProxy, opts: dict) -> dict:
    # botocore's own retries off: s3fs still retries a SlowDown a few times, tierfs does the rest
    return {**opts, "endpoint_url": proxy.url, "skip_instance_cache": True,
            "config_kwargs": {"connect_timeout": 2.0, "read_timeout": 10.0, "retries": {"max_attempts": 0}}}


def test_every_save_reaches_a_throttling_store_and_restores_bit_exact(throttling, shm_dir):
    url, opts, proxy = throttling
    proxy.set_bucket(4.0, burst=4.0)  # 4 requests per second per prefix: far below what the saves ask
    obj = ObjectTier(url, via(proxy, opts), retries=2)
    with TieredStore([MemoryTier(shm_dir, keep=LatestN(1)), obj], file_size=64 << 10) as store:
        for step in (1, 2, 3):  # RAM keeps only the newest: the uploads lagging behind still complete
            store.save(step, state_for(step), blocking=False)
        store.wait_until_finished()  # raises if any upload failed
        assert all("s3" in tiers for s, tiers in store.steps().items() if s in (1, 2, 3)), store.steps()
    refused = proxy.requests(fault="slowdown")
    assert refused, "the bucket never refused a request: the test does not throttle"
    proxy.clear()
    with TieredStore([MemoryTier(Path(shm_dir) / "fresh"), ObjectTier(url, opts)]) as store:
        for step in (1, 2, 3):
            got, info = store.restore(step, tiers=["s3"])
            assert_states_equal(got, state_for(step))


def test_a_request_budget_within_the_store_s_rate_is_never_refused(throttling, shm_dir):
    url, opts, proxy = throttling
    proxy.set_bucket(12.0, burst=12.0)
    obj = ObjectTier(url, via(proxy, opts), requests_per_second=8.0)  # this one-process job's whole budget
    with TieredStore([MemoryTier(shm_dir, keep=LatestN(1)), obj], file_size=64 << 10) as store:
        for step in (1, 2):
            store.save(step, state_for(step))
            store.wait_until_finished()
        assert store.steps()[2] == ["ram", "s3"]
    assert not proxy.requests(fault="slowdown")
    assert obj._budget.share is not None and obj._budget.share.rate == 8.0  # this one-rank job's whole budget


def test_a_save_asks_its_uploads_and_three_small_requests_none_per_file(throttling, shm_dir):
    url, opts, proxy = throttling
    obj = ObjectTier(url, via(proxy, opts), part_size=5 << 20)
    big = {"big": np.random.default_rng(0).standard_normal(3 << 20).astype(np.float32)}  # 12 MiB: multipart
    with TieredStore([MemoryTier(shm_dir, keep=LatestN(1)), obj], file_size=64 << 10) as store:
        store.save(1, state_for(1))
        store.wait_until_finished()
        for step, state in ((2, state_for(2)), (3, {**state_for(3), **big})):
            proxy.log.clear()
            store.save(step, state)
            store.wait_until_finished()
            data = [r for r in proxy.log if "/rank_00000.0" in r.path]
            small = [r for r in proxy.log if r not in data]
            files = {r.path for r in data}
            assert len(files) > 4  # several shard files: a request per file would show
            # the shard's files: one PUT each, or a multipart upload's start, parts and completion
            assert all(r.method in ("PUT", "POST") for r in data)
            assert len(data) == len(files) + (0 if step == 2 else 2 + 2), [(r.method, r.path) for r in data]
            # the manifest, one listing that confirms them, the marker: no HEAD or listing per file
            assert sorted((r.method, r.is_listing) for r in small) == [("GET", True), ("PUT", False), ("PUT", False)]


def test_a_12_rank_job_training_against_a_throttling_store_loses_no_save_and_sees_no_error(throttling, shm_dir):
    url, opts, proxy = throttling
    proxy.set_bucket(2.0, burst=2.0)  # per prefix, shared by every rank using it: below what a rank asks at once
    outs = gloo_job.run_job(12, CHILD, shm_dir, url, proxy.url, opts["endpoint_url"], "2", "0", timeout=600)
    for o in outs:
        assert o["errors"] == [], o  # training saw nothing
        assert o["on_object"] == [1, 2], o  # every save reached the object tier, late
        assert o["exact"] == {"1": True, "2": True}, o
    refused = proxy.requests(fault="slowdown")
    assert len(refused) > 12, "the bucket refused almost nothing: the job was not throttled"
    # one rank asked the store whether the bucket is there, for the whole job (the others heard its answer
    # in the open's agreement); the restores went to the store directly
    bucket = url.removeprefix("s3://").split("/")[0]
    probes = [r for r in proxy.requests(fault=None) if r.method == "HEAD" and r.path.strip("/") == bucket]
    assert len(probes) == 1, probes
    # the keys of a step: each rank's under a prefix of its own (the store's partitions), the marker apart
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **opts)
    root = url.removeprefix("s3://")
    step_keys = [k[len(root) + 1:] for k in fs.find(root) if f"/{step_dirname(1)}/" in k]
    by_prefix: dict[str, set[str]] = {}
    for k in step_keys:
        by_prefix.setdefault(k.rsplit("/", 2)[0] if k.startswith("ranks/") else "", set()).add(k.rsplit("/", 1)[1])
    assert len(by_prefix) >= min(12, 16) + 1, sorted(by_prefix)
    assert by_prefix[""] == {MARKER}
    for prefix, names in by_prefix.items():
        ranks = {n.split(".")[0] for n in names if n != MARKER}
        assert len(ranks) <= 1 and (not ranks or key(1, f"{ranks.pop()}.manifest.json").startswith(prefix + "/"))


def test_one_rank_asks_for_the_bucket_and_a_missing_one_fails_every_rank_naming_it(s3_url, shm_dir):
    url, opts = s3_url
    with FaultProxy(opts["endpoint_url"]) as proxy:
        env = {"TIERFS_TEST_STORAGE_OPTIONS": json.dumps({**opts, "endpoint_url": proxy.url})}
        outs = gloo_job.run_job(3, OPEN_CHILD, shm_dir, url, env=env, timeout=300)
        assert [o["raised"] for o in outs] == [None] * 3
        bucket = url.removeprefix("s3://").split("/")[0]
        assert [r.method for r in proxy.requests() if r.path.strip("/") == bucket and not r.is_listing] == ["HEAD"]
        proxy.log.clear()
        missing = "s3://no-such-bucket/run"
        outs = gloo_job.run_job(3, OPEN_CHILD, shm_dir, missing, env=env, timeout=300)
    for o in outs:  # rank 0 asked; every rank raises, naming the bucket and what to do
        cls, msg = o["raised"]
        assert cls == "TierUnavailableError", o
        assert "bucket 'no-such-bucket' does not exist; create it or fix the URL" in msg, o
        assert o["rank"] == 0 or "rank 0 failed" in msg, o
    assert len([r for r in proxy.requests() if r.path.strip("/") == "no-such-bucket"]) == 1


def test_uploads_are_in_parts_that_fit_the_store():
    # S3: multipart above two parts of at least 5 MiB; GCS: resumable above two chunks of 256 KiB multiples
    assert upload("s3", 40 << 20, 16 << 20) == ({"chunksize": 16 << 20}, 3 + 2)
    assert upload("gs", 40 << 20, 16 << 20) == ({"chunksize": 16 << 20}, 3 + 1)
    assert upload("gs", 20 << 20, 16 << 20) == ({"chunksize": (20 << 20) + 1}, 1)  # whole, in one request
    assert upload("gs", 3 << 20, (1 << 20) + 1)[0] == {"chunksize": (1 << 20) + (256 << 10)}
    assert upload("memory", 40 << 20, 16 << 20) == ({}, 1)


def test_a_large_file_goes_to_gcs_as_a_resumable_upload_in_chunks_and_reads_back_bit_exact(gcs_url, caplog):
    url, opts = gcs_url
    tier = ObjectTier(url, opts, part_size=1 << 20)
    data = np.random.default_rng(5).integers(0, 255, (3 << 20) + 12345, dtype=np.uint8).tobytes()
    with caplog.at_level(logging.DEBUG, logger="gcsfs"):
        tier.write_file(1, "rank_00000.0000.bin", data)
    sent = [r.getMessage() for r in caplog.records if r.getMessage().startswith(("POST", "PUT"))]
    assert len(sent) == 1 + 4, sent  # the upload's start, then four chunks of 1 MiB (the last one shorter)
    assert "upload_id=" not in sent[0] and all("uploadType=resumable&upload_id=" in m for m in sent[1:]), sent
    assert bytes(ObjectTier(url, opts).read_file(1, "rank_00000.0000.bin")) == data


def wait_for(condition, what: str, timeout: float = 120.0):
    """``condition()``'s first true value, polled until ``timeout`` (then the test fails saying ``what``)."""
    deadline = time.monotonic() + timeout
    while not (got := condition()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)
    return got


@contextlib.contextmanager
def cleared(proxy: FaultProxy):
    """The proxy's faults cleared on the way out, however the block ends (so the store's close never
    waits out a store refusing it)."""
    try:
        yield
    finally:
        proxy.clear()


def test_retention_keeps_the_newest_durable_step_while_a_newer_one_lags_and_ls_shows_the_lag(
        throttling, shm_dir, tmp_path, caplog, capsys):
    url, opts, proxy = throttling
    direct = ObjectTier(url, opts)  # what the store holds, seen past the proxy

    def step3(r) -> bool:  # step 3's keys, and listings of them
        return step_dirname(3) in r.path or step_dirname(3) in urllib.parse.unquote(r.query)

    tiers = [MemoryTier(shm_dir, keep=LatestN(1)), ObjectTier(url, via(proxy, opts), keep=LatestN(1), retries=2)]
    with TieredStore(tiers, file_size=64 << 10) as store:
        for step in (1, 2):
            store.save(step, state_for(step))
        store.wait_until_finished()
        assert direct.committed_steps() == [2]
        proxy.fail_next(10**6, "slowdown", match=step3)  # every request of step 3's copy refused for the rate
        with caplog.at_level(logging.WARNING, logger="tierfs"), cleared(proxy):
            store.save(3, state_for(3), blocking=False)
            wait_for(lambda: proxy.requests(fault="slowdown", match=step3), "step 3's copy to be refused")
            # step 3 lags: the newest durable step stays, the log and ls say so
            assert direct.committed_steps() == [2]
            assert store.steps()[2] == ["s3"] and store.steps()[3] == ["ram"]
            cfg = tmp_path / "tiers.json"
            cfg.write_text(json.dumps({"tiers": [{"kind": "memory", "path": shm_dir, "budget": None, "name": "ram"},
                                                 {"kind": "object", "url": url, "storage_options": opts, "name": "s3"}]}))
            assert main(["ls", str(cfg)]) == 0
            assert capsys.readouterr().out.rstrip().endswith("newest committed step: ram 3, s3 2 (1 step behind)")
            wait_for(lambda: [r for r in caplog.records if "its copy lags" in r.getMessage()], "the lag's log line")
        store.wait_until_finished()
    assert direct.committed_steps() == [3]  # once step 3 landed, retention let step 2 go
    got, info = TieredStore([MemoryTier(str(tmp_path / "fresh")), direct]).restore(3, tiers=["s3"])
    assert info.tier == "s3"
    assert_states_equal(got, state_for(3))
