"""A manager or store shared by threads: calls run one at a time, and no save that returned True is lost.

Two threads save interleaved steps (one the even steps, the other the odd ones, each in increasing order)
while a third restores the newest step again and again. A save that would remove a step the other thread
saved (the timeline rule: a save below the newest removes the steps above it) is refused with one clear
ArgumentError; every save that returned True is then on exactly the tiers whose keep policies keep it, and
restores bit-exact. Tiny states: a small ``torch.nn`` model and its Adam state.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from tierfs import ArgumentError, CheckpointManager, TieredStore, TierfsError
from tierfs.policies import AnyPreservationPolicy, EveryNSteps, LatestN
from tierfs.testing import assert_states_equal
from tierfs.tiers import MemoryTier, ObjectTier

sys.path.insert(0, str(Path(__file__).parent))
from _badinput import assert_clear  # noqa: E402

STEPS = 12
ROUNDS = 3


def model_state(step: int, *, plain_keys: bool) -> dict[str, Any]:
    """A small model's and its Adam optimizer's state after one step, different for every ``step``.
    ``plain_keys``: the optimizer's state by str keys (the store restores int keys as str)."""
    g = torch.Generator().manual_seed(step)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(2, 4, generator=g)).sum().backward()
    opt.step()
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if plain_keys:
        adam = {str(i): {k: v.clone() for k, v in s.items()} for i, s in opt.state_dict()["state"].items()}
        return {"model": weights, "adam": adam, "step": step}
    return {"model": weights, "optim": opt.state_dict(), "step": step}


def tiers(shm: str, obj: Path) -> list[Any]:
    return [MemoryTier(shm, keep=LatestN(3)),
            ObjectTier(f"file://{obj}", keep=AnyPreservationPolicy([LatestN(2), EveryNSteps(4)]))]


def expected(saved: set[int]) -> dict[int, list[str]]:
    """Where the keep policies of :func:`tiers` keep the steps ``saved``."""
    newest = sorted(saved, reverse=True)
    ram, obj = set(newest[:3]), set(newest[:2]) | {s for s in saved if s % 4 == 0}
    return {s: [n for n, keep in (("ram", ram), ("file", obj)) if s in keep] for s in sorted(ram | obj)}


class Run:
    """Two saver threads (even and odd steps) and a restorer thread over one store or manager."""

    def __init__(self, save: Callable[[int, Any], bool], restore: Callable[[], tuple[int, Any] | None],
                 states: dict[int, Any]) -> None:
        self.save, self.restore, self.states = save, restore, states
        self.saved: set[int] = set()
        self.refused: list[tuple[int, ArgumentError]] = []
        self.restored: list[int] = []
        self.failures: list[str] = []
        self.saving = threading.Event()
        self.start = threading.Barrier(3)

    def saver(self, steps: range) -> None:
        self.start.wait()
        for s in steps:
            try:
                if not self.save(s, self.states[s]):
                    self.failures.append(f"step {s}: save returned False")
                    continue
                self.saved.add(s)
            except ArgumentError as e:
                self.refused.append((s, e))
            except BaseException as e:  # noqa: BLE001 - reported by the test
                self.failures.append(f"step {s}: {type(e).__name__}: {e}")

    def restorer(self) -> None:
        self.start.wait()
        while self.saving.is_set():
            try:
                got = self.restore()
            except TierfsError as e:
                if "nothing to restore" in str(e) or "closed" in str(e):
                    continue
                self.failures.append(f"restore: {type(e).__name__}: {e}")
                return
            if got is not None:
                step, state = got
                self.restored.append(step)
                try:
                    assert_states_equal(state, self.states[step])
                except AssertionError as e:
                    self.failures.append(f"restore of step {step}: {e}")
                    return

    def run(self) -> None:
        self.saving.set()
        threads = [threading.Thread(target=self.saver, args=(range(0, STEPS, 2),)),
                   threading.Thread(target=self.saver, args=(range(1, STEPS, 2),))]
        reader = threading.Thread(target=self.restorer)
        for t in [*threads, reader]:
            t.start()
        for t in threads:
            t.join()
        self.saving.clear()
        reader.join()

    def check(self) -> None:
        assert not self.failures, self.failures
        assert len(self.saved) + len(self.refused) == STEPS
        for s, e in self.refused:  # each refused save names the other thread's step it would have removed
            assert_clear(e, ArgumentError, f"step {s} cannot be saved from this thread", "another thread saved")
            assert any(x > s for x in self.saved)


@pytest.mark.parametrize("round_", range(ROUNDS))
def test_manager_shared_by_threads_never_loses_a_save(shm_dir, tmp_path, round_):
    states = {s: model_state(s, plain_keys=False) for s in range(STEPS)}
    mgr = CheckpointManager(tiers(shm_dir, tmp_path / "obj"))

    def restore() -> tuple[int, Any] | None:
        state = mgr.restore()
        info = mgr.last_restore_info
        return None if state is None or info is None else (info.step, state)

    run = Run(mgr.save, restore, states)
    try:
        run.run()
        run.check()
        mgr.wait_until_finished()
        mgr.store.apply_retention()  # what a restore had pinned while the last retention ran
        assert mgr.store.steps() == expected(run.saved)
    finally:
        mgr.close()
    with CheckpointManager(tiers(shm_dir, tmp_path / "obj")) as again:  # durable, each step bit-exact
        assert again.store.steps() == expected(run.saved)
        for s in expected(run.saved):
            assert_states_equal(again.restore(step=s), states[s])


@pytest.mark.parametrize("round_", range(ROUNDS))
def test_store_shared_by_threads_never_loses_a_save(shm_dir, tmp_path, round_):
    states = {s: model_state(s, plain_keys=True) for s in range(STEPS)}
    store = TieredStore(tiers(shm_dir, tmp_path / "obj"))

    def restore() -> tuple[int, Any]:
        state, info = store.restore()
        return info.step, state

    run = Run(lambda s, state: store.save(s, state, blocking=False), restore, states)
    try:
        run.run()
        run.check()
        store.wait_until_finished()
        store.apply_retention()
        assert store.steps() == expected(run.saved)
        for s, where in expected(run.saved).items():
            for tier in where:
                state, info = store.restore(s, tiers=[tier])
                assert info.tier == tier
                assert_states_equal(state, states[s])
    finally:
        store.close()


def test_a_save_below_another_threads_step_is_refused_before_anything_is_written(shm_dir, tmp_path):
    states = {s: model_state(s, plain_keys=True) for s in range(6)}
    with TieredStore(tiers(shm_dir, tmp_path / "obj")) as store:
        other = threading.Thread(target=lambda: [store.save(s, states[s]) for s in (1, 3)])
        other.start()
        other.join()
        assert store.save(4, states[4])
        with pytest.raises(ArgumentError) as e:  # it would remove the other thread's 3 (and this one's 4)
            store.save(2, states[2])
        assert_clear(e.value, ArgumentError, "step 2", "[3]", "another thread saved", "increasing order")
        store.wait_until_finished()
        assert sorted(store.steps()) == [1, 3, 4]
        assert_states_equal(store.restore(3)[0], states[3])
        # the job going back on purpose: a restore (or resume_from) says where it goes on from
        store.restore(1)
        assert store.save(2, states[2])  # the timeline rule: 3 and 4, from the run gone back from, are removed
        store.wait_until_finished()
        assert sorted(store.steps()) == [1, 2]
        assert_states_equal(store.restore(2)[0], states[2])


def test_a_thread_going_back_over_its_own_steps_follows_the_timeline_rule(shm_dir, tmp_path):
    states = {s: model_state(s, plain_keys=True) for s in range(6)}
    with TieredStore(tiers(shm_dir, tmp_path / "obj")) as store:
        other = threading.Thread(target=lambda: store.save(1, states[1]))
        other.start()
        other.join()
        for s in (2, 5, 3):  # this thread's own step 5 is superseded by its save of 3; the other's 1 stays
            assert store.save(s, states[s])
        store.wait_until_finished()
        assert sorted(store.steps()) == [1, 2, 3]
        for s in (1, 2, 3):
            assert_states_equal(store.restore(s)[0], states[s])


def test_close_while_another_thread_restores_does_not_hang(shm_dir, tmp_path):
    mgr = CheckpointManager(tiers(shm_dir, tmp_path / "obj"))
    state = model_state(0, plain_keys=False)
    assert mgr.save(0, state)
    first, outcome = threading.Event(), []

    def restorer() -> None:
        while True:
            try:
                got = mgr.restore()
            except TierfsError as e:
                outcome.append(str(e))
                break
            try:
                assert_states_equal(got, state)
            except AssertionError as e:
                outcome.append(f"restored wrong: {e}")
                break
            first.set()
        first.set()

    t = threading.Thread(target=restorer)
    t.start()
    first.wait()
    mgr.close()  # waits for the restore in progress, then closes: the restorer's next call is refused
    t.join()
    assert outcome and "closed" in outcome[0], outcome
