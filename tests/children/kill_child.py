"""Run by test_kills.py: rounds of a saving process SIGKILLed at a random time, each followed by a fresh one.

``python kill_child.py SHM OBJ SEED ROUNDS`` imports torch once, then for each round forks a child that
checks what the killed one left, restores the newest step, and saves on through ``CheckpointManager``
(a RAM tier and an object tier on ``file://``, asynchronous saves, the default) until it is killed:

- ``timer`` rounds: this process SIGKILLs the child a random delay after it reported its n-th commit;
- ``hook`` rounds: the child SIGKILLs itself at its k-th call of one test hook point (``block``,
  ``rename``, ``stage`` or ``transfer``, on whichever thread gets there: staging, the commit worker or the
  upload), k within about its first four saves.

The last round is not killed: it saves until a step reaches the object tier, waits and closes. Every round
prints one JSON line (its plan, how the child ended, what it reported); the test checks them. The child
reports through a pipe, one ``write`` of less than ``PIPE_BUF`` bytes per event, so an event is there
whole or not at all when the child dies. A step is reported committed only once this process sees its
marker on the RAM tier, so "the next process restores at least that step" is a sound check with
asynchronous saves.

Randomness comes from ``random.Random(SEED)``: the plans are reproducible; where a timer kill lands within
the child's work depends on scheduling.
"""

from __future__ import annotations

import ctypes
import itertools
import json
import os
import random
import signal
import sys
import time
import traceback
from typing import Any, Callable

import torch

from tierfs import CheckpointManager
from tierfs.cli.inspect import verify_step
from tierfs.format import MARKER, Marker, parse_step_dirname, step_dirname
from tierfs.format.keys import key
from tierfs.policies import FixedIntervalPolicy, LatestN, RestorePolicy
from tierfs.testing import assert_states_equal, hooks
from tierfs.tiers import MemoryTier, ObjectTier

OBJECT_EVERY = 3  # the object tier takes every 3rd step
MAX_SAVES = 400  # a round that saves this many steps without being killed fails the test
CALLS_PER_SAVE = {"block": 110, "rename": 5, "stage": 6, "transfer": 18}  # about, measured; others: 20
ROUND_LIMIT = 60  # seconds: a round that takes longer is reported as hung (a guard, not a measurement)
PR_SET_PDEATHSIG = 1


def state_for(step: int) -> dict[str, Any]:
    """A small model's and its AdamW optimizer's state after one training step: a function of ``step``."""
    torch.manual_seed(step)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                torch.nn.ReLU(), torch.nn.Linear(256, 16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(8, 64)).square().mean().backward()
    opt.step()
    return {"model": model.state_dict(), "optim": opt.state_dict(), "step": step}


def tiers(shm: str, obj: str) -> list[Any]:
    return [MemoryTier(shm, keep=LatestN(2)),
            ObjectTier(f"file://{obj}", save=FixedIntervalPolicy(OBJECT_EVERY), keep=LatestN(2))]


def manager(shm: str, obj: str) -> CheckpointManager:
    return CheckpointManager(tiers(shm, obj), file_size=256 << 10, block_size=32 << 10)


# -- the child ----------------------------------------------------------------------------------------

def inspect_raw(shm: str, obj: str) -> dict[str, Any]:
    """The tiers as the killed process left them (before a store opens and cleans up): committed and
    partial steps, and every committed step that does not verify (``tierfs verify``'s check)."""
    out = {}
    for t in tiers(shm, obj):
        t.open()
        try:
            steps = t.list_steps()
            bad = {}
            for s in sorted(s for s, ok in steps.items() if ok):
                try:
                    verify_step(t, s)
                except Exception as e:  # noqa: BLE001 - reported, the test fails on it
                    bad[s] = f"{type(e).__name__}: {e}"[:300]
            out[t.name] = {"committed": sorted(s for s, ok in steps.items() if ok),
                           "partial": sorted(s for s, ok in steps.items() if not ok), "bad": bad}
        finally:
            t.close()
    return out


def junk(root: str, allowed_top: set[str], spread: bool = False) -> list[str]:
    """Files and empty folders under a tier's root that are neither a committed step's nor under
    ``allowed_top``; ``spread``: an object tier's layout (each rank's files under its bucket)."""
    def where(step: int, name: str) -> str:
        return key(step, name) if spread else os.path.join(step_dirname(step), name)
    expected = set()
    for name in os.listdir(root):
        step = parse_step_dirname(name)
        if step is None or not os.path.isfile(os.path.join(root, where(step, MARKER))):
            continue
        with open(os.path.join(root, where(step, MARKER)), "rb") as f:
            manifests = set(Marker.from_bytes(f.read()).manifests)
        expected |= {where(step, n) for n in [MARKER, *manifests]}
        for m in manifests:
            with open(os.path.join(root, where(step, m)), "rb") as f:
                expected |= {where(step, n) for n in json.load(f)["files"]}
    found = []
    for folder, dirs, files in os.walk(root):
        rel = os.path.relpath(folder, root)
        if rel.split(os.sep)[0] in allowed_top:
            continue
        if rel != "." and not dirs and not files and not (spread and rel.split(os.sep)[0] == "ranks"
                                                           and rel.count(os.sep) <= 1):  # the buckets stay
            found.append(f"{rel}/ (empty)")
        found += [p for p in (os.path.normpath(os.path.join(rel, f)) for f in files) if p not in expected]
    return sorted(found)


def check_and_restore(mgr: CheckpointManager, shm: str, obj: str) -> dict[str, Any]:
    """After the store opened and copied on what the killed process had not (catch-up): listings,
    verification of every committed step, the newest restored."""
    s = mgr.store
    mgr.wait_until_finished()
    listed = {t.name: t.list_steps() for t in s.tiers}
    bad = {}
    for name, steps in listed.items():
        for step in sorted(st for st, ok in steps.items() if ok):
            try:
                s.verify(step, name)
            except Exception as e:  # noqa: BLE001 - reported, the test fails on it
                bad[f"{name}:{step}"] = f"{type(e).__name__}: {e}"[:300]
    out: dict[str, Any] = {
        "ram": sorted(st for st, ok in listed["ram"].items() if ok),
        "file": sorted(st for st, ok in listed["file"].items() if ok),
        "partial_after_open": sorted(f"{n}:{st}" for n, steps in listed.items() for st, ok in steps.items()
                                     if not ok),
        "junk": {"ram": junk(shm, {f".pool.{os.getpid()}"}), "file": junk(obj, set(), spread=True)}, "bad": bad,
        "restored": None, "tier": None, "exact": None}
    got = mgr.restore()
    if got is not None:
        info = mgr.last_restore_info
        assert info is not None
        out["restored"], out["tier"] = info.step, info.tier
        try:
            assert_states_equal(got, state_for(info.step))
            out["exact"] = True
        except AssertionError as e:
            out["exact"] = str(e)[:300]
    return out


def kill_at_hook_call(point: str, k: int) -> None:
    """SIGKILL this process at its k-th call of hook ``point``, on whichever thread makes it."""
    calls = itertools.count(1)

    def hook(**_info: Any) -> None:
        if next(calls) == k:
            os.kill(os.getpid(), signal.SIGKILL)
    hooks.add(point, hook)


def newest_on_ram(mgr: CheckpointManager) -> int:
    return max((s for s, names in mgr.store.steps().items() if "ram" in names), default=-1)


def child(say: Callable[..., None], shm: str, obj: str, plan: dict[str, Any]) -> None:
    torch.set_num_threads(1)
    say(ev="raw", **inspect_raw(shm, obj))
    mgr = manager(shm, obj)
    found = check_and_restore(mgr, shm, obj)
    say(ev="restored", **found)
    if plan["mode"] == "hook":
        kill_at_hook_call(plan["point"], plan["k"])
    step = 0 if found["restored"] is None else found["restored"] + 1
    newest = -1 if found["restored"] is None else found["restored"]
    for saved in range(1, MAX_SAVES + 1):
        mgr.save(step, state_for(step), metrics={"loss": 1.0 / (step + 1)})
        c = newest_on_ram(mgr)
        if c > newest:
            say(ev="committed", step=c)
            newest = c
        if plan["mode"] == "final" and saved >= 2 and step % OBJECT_EVERY == 0:
            break
        step += 1
    mgr.wait_until_finished()
    say(ev="committed", step=newest_on_ram(mgr))
    on_object = sorted(s for s, names in mgr.store.steps().items() if "file" in names)
    mgr.restore_policy = RestorePolicy(forbid=["ram"])  # the durable copy, read back
    got = mgr.restore()
    info = mgr.last_restore_info
    assert got is not None and info is not None
    try:
        assert_states_equal(got, state_for(info.step))
        exact: bool | str = True
    except AssertionError as e:
        exact = str(e)[:300]
    mgr.close()
    say(ev="finished", saved_to=step, on_object=on_object, object_restored=info.step, object_tier=info.tier,
        object_exact=exact)


def run_child(wfd: int, shm: str, obj: str, plan: dict[str, Any]) -> None:
    """The forked child: never returns."""
    code = 0
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # dies with its parent

        def say(**event: Any) -> None:
            data = json.dumps(event).encode() + b"\n"
            assert len(data) < 4096, "an event must fit in one atomic pipe write"
            os.write(wfd, data)
        child(say, shm, obj, plan)
    except BaseException:  # noqa: BLE001 - reported to the parent
        msg = traceback.format_exc()
        while len(data := json.dumps({"ev": "error", "msg": msg}).encode()) >= 4000:
            msg = msg[len(msg) // 4:]  # the end of a traceback says most
        os.write(wfd, data + b"\n")
        code = 1
    finally:
        os._exit(code)


# -- the parent -----------------------------------------------------------------------------------------

class Hung(Exception):
    pass


def draw(rng: random.Random) -> dict[str, Any]:
    """This round's kill: a hook call to die at, or a commit count and a delay after it."""
    if rng.random() < 0.5:
        # the points this job's saves reach (no GPU: nothing is page-locked or copied on tierfs's copy thread)
        point = rng.choice(sorted(set(hooks.POINTS) - {"copy", "pin"}))
        return {"mode": "hook", "point": point, "k": rng.randint(1, 4 * CALLS_PER_SAVE.get(point, 20))}
    return {"mode": "timer", "after_commits": rng.randint(1, 6), "delay": round(rng.uniform(0.0, 0.06), 4)}


def run_round(shm: str, obj: str, plan: dict[str, Any]) -> dict[str, Any]:
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(rfd)
        run_child(wfd, shm, obj, plan)
    os.close(wfd)
    events: list[dict[str, Any]] = []
    commits, killed_by_parent, hung = 0, False, False

    def on_alarm(*_: Any) -> None:
        raise Hung()
    signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(ROUND_LIMIT)
    try:
        with os.fdopen(rfd, "rb") as f:
            for line in f:
                events.append(json.loads(line))
                commits += events[-1]["ev"] == "committed"
                if plan["mode"] == "timer" and commits == plan["after_commits"] and not killed_by_parent:
                    time.sleep(plan["delay"])  # the random moment of the kill, not a synchronisation
                    os.kill(pid, signal.SIGKILL)
                    killed_by_parent = True
    except Hung:
        hung = True
        os.kill(pid, signal.SIGKILL)
    finally:
        signal.alarm(0)
    _, status = os.waitpid(pid, 0)
    return {"plan": plan, "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
            "exit": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None, "hung": hung, "events": events}


def main() -> None:
    shm, obj, seed, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    torch.set_num_threads(1)  # deterministic CPU results, and no thread pool to fork
    state_for(0)  # torch's lazy set-up, once, before forking
    rng = random.Random(seed)
    for r in range(rounds + 1):
        plan = draw(rng) if r < rounds else {"mode": "final"}
        print(json.dumps({"round": r, **run_round(shm, obj, plan)}), flush=True)


if __name__ == "__main__":
    main()
