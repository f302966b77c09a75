"""CheckpointManager: Orbax's interface, asynchronous save, preemption, and Orbax-style options."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from tierfs import BackgroundError, CheckpointManager, CheckpointManagerOptions
from tierfs.policies import (AnyPreservationPolicy, AnySavePolicy, BestN, EveryNSteps, FixedIntervalPolicy,
                             LatestN, PreemptionCheckpointingPolicy, RestorePolicy, SpecificStepsPolicy)
from tierfs.testing import assert_states_equal
from tierfs.tiers import MemoryTier, ObjectTier

from _gatedtier import GatedTier

HERE = Path(__file__).parent
CHILDREN = HERE / "children"


def make_state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {"w": torch.randn(300, 200, generator=g), "b": torch.randn(200, generator=g)},
        "optim": {"exp_avg": torch.randn(300, 200, generator=g), "step": torch.tensor(seed)},
        "loader": {"epoch": seed // 10, "position": seed * 32},
        "rng": torch.random.get_rng_state(),
        "note": "run-1",
    }


def snapshot(state: dict) -> dict:
    return {k: snapshot(v) if isinstance(v, dict) else (v.clone() if isinstance(v, torch.Tensor) else v)
            for k, v in state.items()}


def test_thirty_steps_over_ram_and_s3(shm_dir, s3_url):
    url, opts = s3_url
    tiers = lambda: [  # noqa: E731
        MemoryTier(shm_dir, save=FixedIntervalPolicy(5), keep=LatestN(2)),
        ObjectTier(url, opts, save=FixedIntervalPolicy(10), keep=AnyPreservationPolicy([LatestN(1), EveryNSteps(20)])),
    ]
    saved = {}
    with CheckpointManager(tiers()) as mgr:
        assert mgr.restore(make_state()) is None
        state = make_state()
        for step in range(30):
            state = make_state(step)
            did = mgr.save(step, state, metrics={"loss": 1.0 / (step + 1)})
            assert did == (step % 5 == 0)
            if did:
                saved[step] = snapshot(state)
        mgr.wait_until_finished()
        assert mgr.store.steps() == {0: ["s3"], 20: ["ram", "s3"], 25: ["ram"]}
        assert mgr.all_steps() == [0, 20, 25] and mgr.latest_step() == 25
        assert mgr.metrics(20) == {"loss": pytest.approx(1 / 21)}
    shutil.rmtree(shm_dir)
    with CheckpointManager(tiers()) as mgr:
        target = make_state(99)
        assert mgr.restore(target) == 20
        assert mgr.last_restore_info.tier == "s3"
        assert_states_equal(target, saved[20])
        assert mgr.save(20, target) is False, "the restored step is not saved again"
        assert mgr.save(25, target) is True


def test_state_changed_right_after_save_is_not_in_the_checkpoint(shm_dir, tmp_path):
    with CheckpointManager([MemoryTier(shm_dir), ObjectTier(f"file://{tmp_path}/o")]) as mgr:
        state = make_state(1)
        want = snapshot(state)
        assert mgr.save(1, state)
        for t in (state["model"]["w"], state["model"]["b"], state["optim"]["exp_avg"]):
            t.add_(1.0)  # training goes on at once, in place
        state["loader"]["position"] = -1
        mgr.wait_until_finished()
        for tiers in (["ram"], ["file"]):
            mgr.restore_policy = RestorePolicy(prefer=tiers)
            got = mgr.restore()
            assert_states_equal(got, want)


def test_restore_returns_new_state_or_loads_in_place(shm_dir):
    with CheckpointManager([MemoryTier(shm_dir)]) as mgr:
        assert mgr.restore() is None
        mgr.save(3, make_state(3))
        mgr.wait_until_finished()
        assert_states_equal(mgr.restore(), make_state(3))
        target = make_state(0)
        assert mgr.restore(target) == 3
        assert_states_equal(target, make_state(3))


def test_resumed_run_replaces_steps_it_redoes(shm_dir):
    with CheckpointManager([MemoryTier(shm_dir, keep=LatestN(5))]) as mgr:
        for s in range(4):
            mgr.save(s, make_state(s))
        mgr.wait_until_finished()
        mgr.restore(make_state(0), step=1)  # go back to step 1 (e.g. after a loss spike)
        assert mgr.save(1, make_state(50)) is False
        assert mgr.save(2, make_state(52)) is True  # steps 2, 3 of the old run are replaced
        mgr.wait_until_finished()
        assert_states_equal(mgr.restore(step=2), make_state(52))


def test_orbax_options_behave_like_the_equivalent_policies(tmp_path):
    opts = CheckpointManagerOptions(save_interval_steps=3, max_to_keep=2, keep_period=6)
    with CheckpointManager(directory=str(tmp_path / "a"), options=opts) as a, \
            CheckpointManager([ObjectTier(f"file://{tmp_path}/b", save=FixedIntervalPolicy(3),
                                          keep=AnyPreservationPolicy([LatestN(2), EveryNSteps(6)]))]) as b:
        for step in range(20):
            assert a.save(step, {"x": np.full(10, step)}) == b.save(step, {"x": np.full(10, step)})
        a.wait_until_finished()
        b.wait_until_finished()
        assert a.all_steps() == b.all_steps() == [0, 6, 12, 15, 18]
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == sorted(p.name for p in (tmp_path / "b").iterdir())


def test_best_step_and_best_n(tmp_path):
    losses = [0.9, 0.4, 0.7, 0.2, 0.5, 0.3]
    opts = CheckpointManagerOptions(max_to_keep=2, best_fn=lambda m: m["loss"], best_mode="min")
    with CheckpointManager(directory=f"file://{tmp_path}/ckpt", options=opts) as mgr:
        for step, loss in enumerate(losses):
            mgr.save(step, {"x": np.zeros(4)}, metrics={"loss": loss})
        mgr.wait_until_finished()
        assert mgr.all_steps() == [3, 5] and mgr.best_step() == 3
    with CheckpointManager([MemoryTier(str(tmp_path / "ram"), keep=BestN(lambda m: m["acc"], 1, "max"))]) as mgr:
        for step, acc in enumerate([0.1, 0.8, 0.5]):
            mgr.save(step, {"x": np.zeros(4)}, metrics={"acc": acc})
        mgr.wait_until_finished()
        assert mgr.best_step() == 1


def test_at_the_in_flight_bound_slow_tiers_are_skipped_not_ram(shm_dir, tmp_path):
    slow = GatedTier(f"file://{tmp_path}/o", name="slow")
    with CheckpointManager([MemoryTier(shm_dir, keep=LatestN(3)), slow], max_in_flight=1, when_busy="skip") as mgr:
        mgr.save(1, make_state(1))  # its upload waits at the gate
        mgr.store.wait_until_committed()
        assert mgr.save(2, make_state(2)) is True  # RAM takes it; the slow tier is skipped
        mgr.store.wait_until_committed()
        assert mgr.store.steps() == {1: ["ram"], 2: ["ram"]}
        slow.gate.set()
        mgr.wait_until_finished()
        assert mgr.store.steps() == {1: ["ram", "slow"], 2: ["ram"]}


def test_at_the_in_flight_bound_save_waits(shm_dir, tmp_path):
    slow = GatedTier(f"file://{tmp_path}/o", name="slow")
    with CheckpointManager([MemoryTier(shm_dir, keep=LatestN(3)), slow], max_in_flight=1) as mgr:
        mgr.save(1, make_state(1))
        done = threading.Event()
        t = threading.Thread(target=lambda: (mgr.save(2, make_state(2)), done.set()))
        t.start()
        assert not done.wait(0.5), "save(2) must wait while step 1 is in flight"
        slow.gate.set()
        t.join(60)
        assert done.is_set()
        mgr.wait_until_finished()
        assert mgr.store.steps() == {1: ["ram", "slow"], 2: ["ram", "slow"]}


def _in_thread(fn) -> tuple[threading.Thread, list]:
    """Run ``fn`` on a thread; the list gets what it returned, or what it raised."""
    out: list = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as e:  # noqa: BLE001 - the test looks at it
            out.append(e)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def test_the_in_flight_bound_is_per_tier_an_upload_holds_back_only_saves_to_its_tier(shm_dir, tmp_path):
    slow = GatedTier(f"file://{tmp_path}/o", name="slow", save=SpecificStepsPolicy([1, 4]))
    with CheckpointManager([MemoryTier(shm_dir, keep=LatestN(3)), slow], max_in_flight=1) as mgr:
        try:
            mgr.save(1, make_state(1))  # its upload waits at the gate
            for step in (2, 3):  # RAM only: not held back by the upload
                t, out = _in_thread(lambda step=step: mgr.save(step, make_state(step)))
                t.join(30)
                assert out == [True], f"save({step}) to RAM alone waited for the upload of step 1"
            mgr.store.wait_until_committed()
            assert mgr.store.steps() == {1: ["ram"], 2: ["ram"], 3: ["ram"]}
        finally:
            slow.gate.set()
        mgr.save(4, make_state(4))  # to the slow tier again
        mgr.wait_until_finished()
        assert mgr.store.steps() == {1: ["slow"], 2: ["ram"], 3: ["ram"], 4: ["ram", "slow"]}
        assert_states_equal(mgr.restore(step=1), make_state(1))


@contextlib.contextmanager
def _waiting_for_a_copy(caplog):
    """An event set once a save logs that it waits for a copy out of the RAM tier."""
    waiting = threading.Event()

    class Waits(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "waits for a copy out of ram" in record.getMessage():
                waiting.set()
    handler = Waits()
    caplog.set_level(logging.INFO, logger="tierfs")
    logging.getLogger("tierfs").addHandler(handler)
    try:
        yield waiting
    finally:
        logging.getLogger("tierfs").removeHandler(handler)


def _third_save_short_of_ram(mgr, ram, waiting) -> tuple[threading.Thread, list]:
    """Steps 1 and 2 committed (step 1's upload waits at the gate: it stays in RAM), the RAM budget cut to
    two steps, then ``save(3)`` on a thread, once it waits for the copy."""
    mgr.save(1, make_state(1))
    mgr.store.wait_until_committed()
    ram.budget = int(2.5 * sum(ram.file_sizes(1).values()))  # room for two steps, not three
    mgr.save(2, make_state(2))
    mgr.store.wait_until_committed()
    t, out = _in_thread(lambda: mgr.save(3, make_state(3)))
    assert waiting.wait(60), "save(3) neither waited for the upload nor returned"
    return t, out


def test_a_save_short_of_ram_waits_for_a_copy_holding_a_step_there(shm_dir, tmp_path, caplog):
    """A step kept in RAM only until its upload ends holds space the next save needs: the save waits for
    the upload (and retention after it) instead of failing for want of space."""
    ram = MemoryTier(shm_dir, keep=LatestN(1))
    slow = GatedTier(f"file://{tmp_path}/o", name="slow", save=SpecificStepsPolicy([1]))
    with _waiting_for_a_copy(caplog) as waiting, CheckpointManager([ram, slow], cleanup=False) as mgr:
        try:
            t, out = _third_save_short_of_ram(mgr, ram, waiting)
            assert out == []  # (the store's calls wait for it meanwhile)
        finally:
            slow.gate.set()
        t.join(60)
        assert out == [True]
        mgr.wait_until_finished()
        assert mgr.store.steps() == {1: ["slow"], 3: ["ram"]}
        assert_states_equal(mgr.restore(step=3), make_state(3))
        assert_states_equal(mgr.restore(step=1), make_state(1))


class _RefusingTier(GatedTier):
    """Its uploads wait at the gate, then fail."""

    def write_files(self, step, files, **kw) -> None:
        assert self.gate.wait(60), "test never opened the gate"
        raise OSError("the object store refused the upload")


def test_a_save_short_of_ram_goes_on_when_the_copy_holding_a_step_fails(shm_dir, tmp_path, caplog):
    """The copy ends in failure: the step it held may go all the same, so the waiting save stages; the
    copy's failure is raised by the next call."""
    ram = MemoryTier(shm_dir, keep=LatestN(1))
    slow = _RefusingTier(f"file://{tmp_path}/o", name="slow", save=SpecificStepsPolicy([1]))
    with _waiting_for_a_copy(caplog) as waiting, CheckpointManager([ram, slow], cleanup=False) as mgr:
        try:
            t, out = _third_save_short_of_ram(mgr, ram, waiting)
        finally:
            slow.gate.set()
        t.join(60)
        assert out == [True]
        with pytest.raises(BackgroundError, match="step 1"):
            mgr.wait_until_finished()
        mgr.wait_until_finished()
        assert mgr.store.steps() == {3: ["ram"]}
        assert_states_equal(mgr.restore(step=3), make_state(3))


def test_object_store_stopping_mid_run_surfaces_on_next_call(shm_dir):
    from moto.server import ThreadedMotoServer
    import s3fs

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    host, port = server.get_host_and_port()
    opts = {"endpoint_url": f"http://{host}:{port}", "key": "testing", "secret": "testing",
            "skip_instance_cache": True, "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 2}}
    s3fs.S3FileSystem(**opts).mkdir("stopping")
    tiers = [MemoryTier(shm_dir, keep=LatestN(2)),
             ObjectTier("s3://stopping/run", opts, save=FixedIntervalPolicy(2), retries=1)]
    mgr = CheckpointManager(tiers)
    try:
        mgr.save(0, make_state(0))
        mgr.wait_until_finished()
        server.stop()
        mgr.save(1, make_state(1))
        mgr.save(2, make_state(2))  # its upload fails: the server is gone
        with pytest.raises(BackgroundError):
            mgr.wait_until_finished()
        mgr.check_for_errors()  # reported once
        assert mgr.store.steps() == {0: ["s3"], 1: ["ram"], 2: ["ram"]}
        # The store comes back (moto keeps its state in-process): step 2 is not committed there.
        again = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
        again.start()
        h2, p2 = again.get_host_and_port()
        try:
            back = ObjectTier("s3://stopping/run", opts | {"endpoint_url": f"http://{h2}:{p2}"})
            assert back.committed_steps() == [0]
            assert back.list_steps().get(2) in (None, False)
        finally:
            again.stop()
    finally:
        mgr.close()


def test_sigterm_saves_last_step_to_preemption_tiers(shm_dir, tmp_path):
    child = subprocess.Popen([sys.executable, str(CHILDREN / "preempt_child.py"), shm_dir, str(tmp_path / "o")],
                             stdout=subprocess.PIPE, text=True, env=os.environ | {"PYTHONPATH": str(CHILDREN)})
    for line in child.stdout:
        if line.startswith("step 7"):
            child.send_signal(signal.SIGTERM)
            break
    out = child.communicate(timeout=120)[0]
    assert child.returncode == 0, out
    last = int(out.strip().splitlines()[-1].split()[-1])
    assert last >= 7
    with CheckpointManager([ObjectTier(f"file://{tmp_path}/o")]) as mgr:
        assert mgr.latest_step() == last, "the step at preemption reached the object tier"
        assert mgr.restore()["x"].tolist() == [last] * 4


def test_the_save_after_reached_preemption_goes_to_the_preemption_tiers_though_one_did_before(shm_dir, tmp_path):
    """SIGTERM between ``reached_preemption(step)`` (False) and ``save(step)``: that save goes to the preemption
    tiers, and so does the loop's last one, after ``reached_preemption`` said True (the loop stops there)."""
    pre = AnySavePolicy([FixedIntervalPolicy(1000), PreemptionCheckpointingPolicy()])
    obj = f"file://{tmp_path}/o"
    with CheckpointManager([MemoryTier(shm_dir), ObjectTier(obj, save=pre)], handle_sigterm=True) as mgr:
        assert not mgr.reached_preemption(1)
        signal.raise_signal(signal.SIGTERM)  # (handled on this thread before the next call)
        assert mgr.should_save(1)
        assert mgr.save(1, {"x": np.full(4, 1)})
        assert mgr.reached_preemption(2)
        assert mgr.should_save(2)
        assert mgr.save(2, {"x": np.full(4, 2)})
        assert mgr.save(3, {"x": np.full(4, 3)})  # to RAM only: once more, not every save
        mgr.wait_until_finished()
    assert ObjectTier(obj).committed_steps() == [1, 2]


def test_sigterm_in_a_loop_that_never_asks_saves_once_then_ends_as_sigterm_would(shm_dir, tmp_path):
    child = subprocess.Popen([sys.executable, str(CHILDREN / "sigterm_child.py"), shm_dir, str(tmp_path / "o")],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=os.environ | {"PYTHONPATH": str(CHILDREN)})
    for line in child.stdout:
        if line.startswith("step 5"):
            child.send_signal(signal.SIGTERM)
            break
    out, err = child.communicate(timeout=120)
    assert child.returncode == -signal.SIGTERM, err[-3000:]  # as an unhandled SIGTERM ends it
    assert "did not stop" in err and "Traceback" not in err, err[-3000:]
    saved = [int(x.split()[1]) for x in out.split("\n") if x.startswith("step")]
    with CheckpointManager([ObjectTier(f"file://{tmp_path}/o")]) as mgr:
        [pre] = mgr.all_steps()  # once: later saves went to RAM only
        assert pre >= 5 and saved and saved[-1] > pre, (pre, saved[-5:])
        got = mgr.restore()
        rng = np.random.default_rng(pre)
        assert got["step"] == pre and got["w"].tobytes() == rng.standard_normal(50_000).astype(np.float32).tobytes()


def test_host_memory_stays_flat_over_many_saves(shm_dir):
    state = {"w": torch.randn(4 << 20)}  # 16 MiB

    def rss() -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmRSS"))
    with CheckpointManager([MemoryTier(shm_dir, keep=LatestN(2))]) as mgr:
        for step in range(10):
            mgr.save(step, state)
        mgr.wait_until_finished()
        before = rss()
        for step in range(10, 50):
            state["w"].add_(1)
            mgr.save(step, state)
        mgr.wait_until_finished()
        grew = rss() - before
    assert grew < 8 << 20, f"RSS grew by {grew / 2**20:.1f} MiB over 40 saves of a 16 MiB state"
