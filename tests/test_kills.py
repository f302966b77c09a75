"""SIGKILL at random times of a process saving continuously through CheckpointManager, thirty times over.

``kill_child.py`` imports torch once and forks every process of the run (see its docstring): each one
checks the tiers as the killed one left them, opens the store, verifies and restores the newest step, and
saves on until it is killed. This test reads the one JSON line per round it prints and checks, after
every kill:

- as the killed process left them, every step with a marker verifies on both tiers (``tierfs verify``'s
  check): the object tier never holds a committed step with a file missing or damaged, the RAM tier
  neither;
- once the next store opened: no partial step and no stray file is left on either tier, every committed
  step verifies, and the newest RAM step restores bit-exact (``assert_states_equal`` against the state
  the step number determines);
- no step goes backwards: the restored step is at least the newest step the killed process had seen
  committed (its marker on the RAM tier), and the object tier's newest step never decreases;
- the next process's saves succeed (it commits new steps before it is killed; the last one is not killed,
  puts a step on the object tier, and that copy restores bit-exact too).

The seed is fixed and printed with every round's plan (set TIERFS_KILL_SEED to try another).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tierfs import TieredStore
from tierfs.format import step_dirname
from tierfs.tiers import MemoryTier, ObjectTier

HERE = Path(__file__).parent
CHILDREN = HERE / "children"
SEED = int(os.environ.get("TIERFS_KILL_SEED", "20250611"))
ROUNDS = 30


def events(rec: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    return [e for e in rec["events"] if e["ev"] == kind]


def one(rec: dict[str, Any], kind: str) -> dict[str, Any]:
    found = events(rec, kind)
    assert len(found) == 1, f"round {rec['round']}: expected one {kind!r} event, got {rec['events']}"
    return found[0]


def describe(rec: dict[str, Any]) -> str:
    """One line per round for the test output: the plan, what the next process found, what it reported."""
    plan = rec["plan"]
    how = {"hook": lambda: f"self-kill at {plan['point']} hook call {plan['k']}",
           "timer": lambda: f"parent kill {plan['delay'] * 1000:.0f} ms after commit #{plan['after_commits']}",
           "final": lambda: "not killed"}[plan["mode"]]()
    raw = events(rec, "raw")
    restored = events(rec, "restored")
    commits = [e["step"] for e in events(rec, "committed")]
    found = (f"found ram {raw[0]['ram']['committed']} partial {raw[0]['ram']['partial']}, "
             f"object {raw[0]['file']['committed']} partial {raw[0]['file']['partial']}") if raw else "-"
    got = f"restored {restored[0]['restored']}" if restored else "-"
    return (f"round {rec['round']:2d}: {how:<38} | {found} | {got} | committed {commits[:3]}"
            f"{'...' if len(commits) > 3 else ''}{commits[-1:] if len(commits) > 3 else ''} | "
            f"signal {rec['signal']} exit {rec['exit']}")


@pytest.mark.slow
@pytest.mark.parametrize("seed", [SEED], ids=lambda s: f"seed={s}")
def test_thirty_random_sigkills_while_saving(seed, shm_dir, tmp_path):
    pytest.importorskip("torch")  # the saving processes hold a torch model's and optimizer's state
    obj = tmp_path / "obj"
    obj.mkdir()
    proc = subprocess.run([sys.executable, str(CHILDREN / "kill_child.py"), shm_dir, str(obj), str(seed), str(ROUNDS)],
                          capture_output=True, text=True, timeout=280)
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    print(f"seed {seed}: {len(records)} rounds")
    for rec in records:
        print(describe(rec))
    assert proc.returncode == 0, f"seed {seed}: the driver failed:\n{proc.stderr[-4000:]}"
    assert len(records) == ROUNDS + 1

    last_committed = -1  # newest step a killed process saw committed on the RAM tier
    newest_object = -1
    for rec in records:
        where = f"seed {seed} round {rec['round']} ({rec['plan']})"
        errors = events(rec, "error")
        assert not errors, f"{where}: the process failed:\n{errors[0]['msg']}"
        assert not rec["hung"], f"{where}: the process hung"
        raw, found = one(rec, "raw"), one(rec, "restored")

        # as the killed process left the tiers: every marker stands for a complete, verified step
        for tier in ("ram", "file"):
            assert raw[tier]["bad"] == {}, f"{where}: committed steps on {tier} that do not verify: {raw[tier]['bad']}"
        if raw["file"]["committed"]:
            assert max(raw["file"]["committed"]) >= newest_object, f"{where}: the object tier went backwards"
            newest_object = max(raw["file"]["committed"])

        # once the store opened: clean tiers, everything verifies, the newest step restores bit-exact
        assert found["partial_after_open"] == [], f"{where}: partial steps left after open"
        # nothing left over: not a stray file, not an empty step directory of a deletion cut short
        assert found["junk"] == {"ram": [], "file": []}, f"{where}: stray files left after open: {found['junk']}"
        assert found["bad"] == {}, f"{where}: committed steps that do not verify: {found['bad']}"
        if last_committed >= 0:
            assert found["ram"], f"{where}: no committed step on the RAM tier, yet {last_committed} was committed"
        if found["ram"]:
            assert found["restored"] == max(found["ram"]) and found["tier"] == "ram", f"{where}: {found}"
            assert found["exact"] is True, f"{where}: step {found['restored']} restored wrong: {found['exact']}"
        assert (found["restored"] if found["restored"] is not None else -1) >= last_committed, \
            f"{where}: restored step {found['restored']} but step {last_committed} was committed before the kill"

        # the process saved on
        commits = [e["step"] for e in events(rec, "committed")]
        if rec["plan"]["mode"] == "timer":
            assert len(commits) >= rec["plan"]["after_commits"], f"{where}: saves stopped committing: {commits}"
        last_committed = max([last_committed, *commits])
        if rec["plan"]["mode"] == "final":
            assert rec["exit"] == 0
            done = one(rec, "finished")
            assert done["saved_to"] == last_committed and done["saved_to"] in done["on_object"], f"{where}: {done}"
            assert done["object_restored"] == done["saved_to"] and done["object_tier"] == "file", f"{where}: {done}"
            assert done["object_exact"] is True, f"{where}: object copy restored wrong: {done['object_exact']}"
        else:
            assert rec["signal"] == 9, f"{where}: the process was not killed: {rec}"
    left = [one(rec, "raw") for rec in records[1:]]  # what each kill left, as the next process found it
    print(f"{ROUNDS} kills: {sum(bool(r['ram']['partial']) for r in left)} left a partial step on the RAM tier, "
          f"{sum(bool(r['file']['partial']) for r in left)} on the object tier")


def test_empty_step_directory_on_file_object_tier_is_removed_when_a_store_opens(shm_dir, tmp_path):
    """A kill between the last unlink and the rmdir of a step's deletion leaves an empty step directory:
    it is a partial step, removed when a store opens."""
    obj = tmp_path / "obj"
    (obj / step_dirname(5)).mkdir(parents=True)  # what the kill leaves: the files gone, the directory not
    store = TieredStore([MemoryTier(shm_dir), ObjectTier(f"file://{obj}")])
    try:
        assert not (obj / step_dirname(5)).exists(), "the interrupted deletion was not finished at open"
    finally:
        store.close()
