"""Uploads from a helper process (``TieredStore(helper=True)``): the object tier gets every step bit-exact
from a process of the rank's own; a helper killed mid-upload is named by the store's next call, the step
stays restorable from RAM, and a store opened again brings the object tier up to date. Real processes, a
real S3 server (moto) and a ``file://`` tier; the kill is a real SIGKILL, at the helper's first throttle
request for the step (the ``transfer`` hook runs in the training process as the helper asks)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch

from tierfs import TieredStore
from tierfs.errors import BackgroundError
from tierfs.testing import hooks
from tierfs.tiers import MemoryTier, ObjectTier


def train_state(seed: int) -> dict:
    """A model and AdamW's state after two steps: many small tensors, as a training job saves."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Embedding(64, 32), torch.nn.Linear(32, 64), torch.nn.GELU(),
                                torch.nn.LayerNorm(64), torch.nn.Linear(64, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(2):
        model(torch.randint(0, 64, (4, 5))).sum().backward()
        opt.step()
    return {"model": model.state_dict(), "optim": opt.state_dict()}


def same(a, b) -> bool:
    """Bit-exact equality of two nested states (keys as the store returns them: strings)."""
    if isinstance(a, dict):
        a, b = {str(k): v for k, v in a.items()}, {str(k): v for k, v in b.items()}
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and bytes(a.numpy().data) == bytes(b.numpy().data)
    return a == b


@pytest.fixture(params=["file", "s3"])
def object_tier(request, tmp_path):
    """A function making the object tier, a file:// one or one on the moto S3 server."""
    if request.param == "file":
        return lambda: ObjectTier(f"file://{tmp_path}/objects")
    url, opts = request.getfixturevalue("s3_url")
    return lambda: ObjectTier(url, storage_options=opts)


def test_every_upload_runs_in_the_helper_and_lands_bit_exact(shm_dir, object_tier):
    states = {s: train_state(s) for s in (1, 2, 3)}
    with TieredStore([MemoryTier(shm_dir), object_tier()], helper=True) as store:
        for s, state in states.items():
            store.save(s, state)
        store.wait_until_finished()
        helper = store._ctx.work.helper
        assert helper is not None and helper.copies == 3
        assert helper.pid is not None and helper.pid != os.getpid()
        pid = helper.pid
    assert not _alive(pid)  # closing the store ends its helper
    with TieredStore([object_tier()]) as durable:
        for s, state in states.items():
            got, info = durable.restore(s)
            assert same(got, state) and info.tier == object_tier().name


def test_a_helper_killed_mid_upload_is_named_and_the_tier_catches_up_after_a_restart(shm_dir, object_tier):
    states = {s: train_state(s) for s in (1, 2, 3)}
    store = TieredStore([MemoryTier(shm_dir), object_tier()], helper=True)
    store.save(1, states[1])
    store.wait_until_finished()
    helper = store._ctx.work.helper
    killed: list[int] = []

    def kill_the_helper(step: int, tier: str, nbytes: int) -> None:
        if step == 2 and not killed:  # the helper is mid-upload: it asked to move the step's first bytes
            killed.append(helper.pid)
            os.kill(helper.pid, signal.SIGKILL)

    with hooks.on("transfer", kill_the_helper):
        store.save(2, states[2])
        with pytest.raises(BackgroundError) as raised:  # the next call names the helper and the step
            store.wait_until_finished()
    message = str(raised.value)
    assert f"upload helper (pid {killed[0]})" in message and "SIGKILL" in message and "step 2" in message
    got, info = store.restore(2)  # the step is still in RAM
    assert same(got, states[2]) and info.tier == "ram"
    store.save(3, states[3])  # a new helper takes the next upload
    store.wait_until_finished()
    assert helper.pid not in (None, killed[0]) and helper.copies == 2
    with TieredStore([object_tier()]) as durable:
        assert sorted(durable.steps()) == [1, 3]
    store.close()
    with TieredStore([MemoryTier(shm_dir), object_tier()], helper=True) as again:  # a restart
        again.wait_until_finished()  # it copies on what the object tier lacks
    with TieredStore([object_tier()]) as durable:
        assert sorted(durable.steps()) == [1, 2, 3]
        got, info = durable.restore(2)
        assert same(got, states[2]) and info.tier == object_tier().name


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie not reaped yet counts as ended
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_helper_killed_on_one_rank_fails_that_steps_upload_on_every_rank(shm_dir, tmp_path):
    """Two ranks, each its own node: rank 0's helper is killed mid-upload of step 2. Both ranks' next call
    raises (rank 0's names its helper; rank 1's names rank 0 and the upload), the object tier never gets
    step 2 half-written, step 2 restores from RAM on both, a new helper uploads step 3, and a restart brings
    step 2 to the object tier: every step then restores from it alone, bit-exact, on every rank."""
    import gloo_job

    outs = gloo_job.run_job(2, Path(__file__).parent / "children" / "helper_kill_child.py", shm_dir,
                            str(tmp_path / "objects"))
    first, second = outs
    assert len(first["killed"]) == 1
    assert first["raised"][0] == "BackgroundError" and f"upload helper (pid {first['killed'][0]})" in first["raised"][1]
    assert second["raised"][0] == "BackgroundError" and "rank 0 failed" in second["raised"][1]
    assert "HelperError" in second["raised"][1] and "step 2" in second["raised"][1]
    for o in outs:
        assert o["ram_restore"] == ["ram", True] and o["new_helper"]
        assert o["object_steps"] == [1, 3]
        assert o["object_steps_after_restart"] == [1, 2, 3] and o["object_exact"] == [True, True, True]


def test_a_tier_the_helper_cannot_build_uploads_in_the_training_process(shm_dir, tmp_path):
    """An object tier with a request budget (whose share the helper could not spend) uploads as without a
    helper: no helper process is started, and the step lands bit-exact all the same."""
    state = train_state(4)
    budgeted = ObjectTier(f"file://{tmp_path}/objects", requests_per_second=1000.0)
    assert budgeted.recipe() is None and ObjectTier(f"file://{tmp_path}/objects").recipe() is not None
    with TieredStore([MemoryTier(shm_dir), budgeted], helper=True) as store:
        store.save(1, state)
        store.wait_until_finished()
        helper = store._ctx.work.helper
        assert helper.copies == 0 and helper.pid is None
    with TieredStore([ObjectTier(f"file://{tmp_path}/objects")]) as durable:
        got, info = durable.restore(1)
        assert same(got, state) and info.tier == "file"
