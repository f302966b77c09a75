"""CheckpointManager's own bad input: each is one ArgumentError in the user's terms, raised before anything
is written (the step arguments, the key reserved for the data loader's state, keys that DCP's flattened
names would merge, an empty state)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tierfs import ArgumentError, CheckpointManager
from tierfs.testing import assert_states_equal
from tierfs.tiers import MemoryTier

sys.path.insert(0, str(Path(__file__).parent))
from _badinput import assert_clear, model_state  # noqa: E402


class Counter:
    """A stateful object (what ``loader=`` takes): its state is a position."""

    def __init__(self, position: int = 0) -> None:
        self.position = position

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.position = sd["position"]


@pytest.fixture
def mgr(shm_dir):
    with CheckpointManager([MemoryTier(shm_dir)]) as m:
        yield m


def nothing_written(mgr: CheckpointManager, shm_dir: str) -> None:
    assert mgr.all_steps() == []
    assert [n for n in os.listdir(shm_dir) if n.startswith("step_")] == []


@pytest.mark.parametrize("step", ["7", float("nan"), None, -1, True, 2.0])
def test_reached_preemption_checks_its_step(mgr, step):
    with pytest.raises(ArgumentError) as e:
        mgr.reached_preemption(step)
    assert_clear(e.value, ArgumentError, "step")


def test_reached_preemption_takes_a_step(mgr):
    assert mgr.reached_preemption(7) is False


@pytest.mark.parametrize("value", [torch.zeros(2), 3])
def test_the_loader_key_is_reserved_at_save_and_restore(mgr, shm_dir, value):
    with pytest.raises(ArgumentError) as e:
        mgr.save(3, {"__stateful__": value, "w": torch.ones(2)})
    assert_clear(e.value, ArgumentError, "'__stateful__'", "reserved", "rename")
    nothing_written(mgr, shm_dir)
    assert mgr.save(3, {"w": torch.ones(2)})
    with pytest.raises(ArgumentError) as e:
        mgr.restore({"__stateful__": value, "w": torch.zeros(2)})
    assert_clear(e.value, ArgumentError, "'__stateful__'", "reserved")


@pytest.mark.parametrize("state, first, second, name", [
    ({1: torch.zeros(2), "1": torch.ones(2)}, "state[1]", "state['1']", "'1'"),
    ({"a.b": torch.zeros(2), "a": {"b": torch.ones(2)}}, "state['a.b']", "state['a']['b']", "'a.b'"),
    ({"x": [torch.zeros(1)], "x.0": torch.ones(1)}, "state['x.0']", "state['x'][0]", "'x.0'"),
])
def test_keys_dcp_would_merge_are_named_before_anything_is_written(mgr, shm_dir, state, first, second, name):
    with pytest.raises(ArgumentError) as e:
        mgr.save(1, state)
    assert_clear(e.value, ArgumentError, first, second, name, "rename one")
    nothing_written(mgr, shm_dir)


def test_a_restore_target_whose_keys_dcp_would_merge_is_named(mgr):
    assert mgr.save(1, {"a": {"b": torch.ones(2)}, "c": torch.ones(1)})
    with pytest.raises(ArgumentError) as e:
        mgr.restore({"a.b": torch.zeros(2), "a": {"b": torch.zeros(2)}, "c": torch.zeros(1)})
    assert_clear(e.value, ArgumentError, "state['a.b']", "state['a']['b']", "rename one")


def test_an_empty_state_is_refused_unless_a_loader_is_saved(mgr, shm_dir):
    with pytest.raises(ArgumentError) as e:
        mgr.save(4, {})
    assert_clear(e.value, ArgumentError, "state is empty", "nothing to save")
    nothing_written(mgr, shm_dir)
    assert mgr.save(4, {}, loader=Counter(17))
    back = Counter()
    assert mgr.restore({}, loader=back) == 4
    assert back.position == 17


def test_a_model_state_still_saves_and_restores(mgr):
    state = model_state()
    assert mgr.save(2, state)
    assert_states_equal(mgr.restore(), state)
