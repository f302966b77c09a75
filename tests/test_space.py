"""Running out of space: a RAM tier on a small tmpfs that fills before, during or after staging a save,
and a RAM tier whose ``budget=`` the next step exceeds.

Each test mounts its own tmpfs (``mount -t tmpfs``; skipped, saying why, where mounting is not
permitted: the budget variant needs no mount) and fills it with a ballast file at a chosen moment, through
the documented hooks (``tierfs.testing.hooks``) where the moment is inside a save. Every test shows:

- the save fails with one ``CapacityError`` line naming the tier and what to do (a blocking save raises
  it; an asynchronous one raises it, as the cause of a ``BackgroundError``, on the next call), never a
  SIGBUS (buffers are reserved before the copy into them);
- the failed step is not committed and leaves nothing behind (no directory, no files holding space);
- earlier steps stay committed, verify and restore bit-exact;
- once the ballast is gone, later saves succeed, and the object tier behind the RAM tier takes the later
  steps its save policy chooses (and they restore bit-exact from it).
"""

from __future__ import annotations

import os
import subprocess
import threading
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import pytest

from tierfs import BackgroundError, CapacityError, TieredStore, TierfsError
from tierfs.format import plan_files, step_dirname
from tierfs.policies import FixedIntervalPolicy, LatestN
from tierfs.testing import assert_states_equal, hooks
from tierfs.tiers import MemoryTier, ObjectTier

PAGE = os.sysconf("SC_PAGE_SIZE")


def state_for(step: int, scale: int = 12) -> dict[str, Any]:
    """Four float32 arrays of ``scale`` pages and 64 bytes each (a shard file per array, each ending in a
    page of its own), and the step number."""
    rng = np.random.default_rng(step)
    n = (scale * PAGE + 64) // 4
    return {f"w{i}": rng.standard_normal(n).astype(np.float32) for i in range(4)} | {"step": step}


def free_bytes(root: Path) -> int:
    sv = os.statvfs(root)
    return sv.f_bavail * sv.f_frsize


class Tmpfs:
    """A tmpfs mounted for one test, and a ballast file that fills it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.ballast = root / "ballast"

    def fill(self, leave: int = 0) -> None:
        """Take all free space but ``leave`` bytes (rounded down to pages)."""
        size = free_bytes(self.root) - leave // PAGE * PAGE
        fd = os.open(self.ballast, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            if size > 0:
                os.posix_fallocate(fd, os.fstat(fd).st_size, size)
        finally:
            os.close(fd)

    def use_inodes(self, leave: int) -> None:
        """Take all free inodes but ``leave``, with empty files."""
        (self.root / "inodes").mkdir(exist_ok=True)
        for i in range(os.statvfs(self.root).f_favail - leave):
            (self.root / "inodes" / str(i)).touch()

    def free(self) -> None:
        self.ballast.unlink(missing_ok=True)
        for p in (self.root / "inodes").glob("*"):
            p.unlink()


@pytest.fixture
def tmpfs(tmp_path) -> Iterator[Callable[..., Tmpfs]]:
    """``tmpfs(size, nr_inodes=None)``: a fresh tmpfs mounted under ``tmp_path``; unmounted afterwards."""
    mounted: list[Path] = []

    def mount(size: int, nr_inodes: int | None = None) -> Tmpfs:
        root = tmp_path / f"tmpfs{len(mounted)}"
        root.mkdir()
        opts = f"size={size},mode=0700" + (f",nr_inodes={nr_inodes}" if nr_inodes else "")
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tierfs-test", str(root)], capture_output=True,
                              text=True)
        if proc.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here (needs root or CAP_SYS_ADMIN): {proc.stderr.strip()}; "
                        "test_budget_exceeded_by_the_next_step covers the RAM tier's budget instead")
        mounted.append(root)
        return Tmpfs(root)
    yield mount
    for root in mounted:
        if subprocess.run(["umount", str(root)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(root)], check=True)  # a mapping still open: detach


def make_store(ram: Path, obj: Path, budget: int | None = None) -> TieredStore:
    return TieredStore([MemoryTier(ram, keep=LatestN(2), budget=budget),
                        ObjectTier(f"file://{obj}", save=FixedIntervalPolicy(2), keep=LatestN(2))],
                       file_size=PAGE, block_size=16 << 10)


def save_steps(store: TieredStore, steps: range, scale: int = 12) -> None:
    for s in steps:
        store.save(s, state_for(s, scale))
    store.wait_until_finished()


def check_clean_failure(err: BaseException, store: TieredStore, ram: Path, failed: int) -> None:
    """One line naming the tier and what to do; the failed step neither committed nor left behind."""
    assert isinstance(err, CapacityError) or (isinstance(err, BackgroundError)
                                              and isinstance(err.__cause__, CapacityError)), repr(err)
    msg = str(err)
    assert "\n" not in msg and str(ram) in msg, msg
    assert "keep fewer steps" in msg or "budget" in msg, f"no advice on what to do: {msg}"
    assert failed not in store.steps()
    assert not (ram / step_dirname(failed)).exists(), \
        f"the failed step left {sorted(p.name for p in (ram / step_dirname(failed)).iterdir())}"


def check_intact(store: TieredStore, scales: dict[int, int]) -> None:
    """Every committed step verifies on every tier; each restores bit-exact from each tier holding it."""
    for step, names in store.steps().items():
        for name in names:
            store.verify(step, name)
            got, info = store.restore(step, tiers=[name])
            assert info.step == step and info.tier == name
            assert_states_equal(got, state_for(step, scales.get(step, 12)))


def finish_after_freeing(store: TieredStore, fs: Tmpfs, failed: int, scale: int) -> None:
    """Free the ballast: the failed step saves now, then two more; the object tier takes the even ones."""
    fs.free()
    save_steps(store, range(failed, failed + 3), scale)
    steps = store.steps()
    assert steps[failed + 2] == ["ram"] + (["file"] if (failed + 2) % 2 == 0 else [])
    last_object = max(s for s, names in steps.items() if "file" in names)
    assert last_object >= failed + 1, f"the object tier got no step after the failure: {steps}"
    check_intact(store, {s: scale for s in range(failed, failed + 3)})


def test_full_tmpfs_fails_the_next_step_before_anything_is_written(tmpfs, tmp_path):
    fs = tmpfs(4 << 20)
    ram = fs.root / "ram"
    store = make_store(ram, tmp_path / "obj")
    try:
        save_steps(store, range(4))
        fs.fill(leave=PAGE * 8)  # another process takes the memory: a larger step 4 cannot fit
        with pytest.raises(TierfsError) as e:
            store.save(4, state_for(4, scale=24))
        check_clean_failure(e.value, store, ram, 4)
        check_intact(store, {})
        finish_after_freeing(store, fs, 4, scale=24)
    finally:
        store.close()


@pytest.mark.parametrize("short_of", ["pages", "inodes", "inode-for-the-step-directory"])
def test_tmpfs_full_midway_through_staging(short_of, tmpfs, tmp_path):
    """The capacity check passes but reserving the buffers runs out: the last file's pages (the check adds
    up bytes, the tmpfs allocates whole pages), the last files' inodes, or the step directory's inode."""
    fs = tmpfs(4 << 20, nr_inodes=None if short_of == "pages" else 100)
    ram = fs.root / "ram"
    store = make_store(ram, tmp_path / "obj")
    try:
        save_steps(store, range(4))
        big = state_for(4, scale=24)  # larger files: no pooled buffer fits, all four are new
        if short_of == "pages":
            fs.fill(leave=sum(v.nbytes for k, v in big.items() if k != "step") + PAGE)  # < the pages needed
        else:
            fs.use_inodes(leave=2 if short_of == "inodes" else 0)
        with pytest.raises(TierfsError) as e:
            store.save(4, big)
        check_clean_failure(e.value, store, ram, 4)
        check_intact(store, {})
        finish_after_freeing(store, fs, 4, scale=24)
    finally:
        store.close()


def fill_at(fs: Tmpfs, point: str, stage: str | None) -> Callable[..., None]:
    """A hook that fills the tmpfs once: at the first call of ``point``, or of stage ``stage`` of the RAM
    tier when ``point`` is ``"stage"``."""
    done = threading.Event()

    def hook(**info: Any) -> None:
        if done.is_set() or (point == "stage" and (info["stage"], info["tier"]) != (stage, "ram")):
            return
        done.set()
        fs.fill()
    return hook


# where the tmpfs fills: (hook point, stage, blocking save)
FILLS = {
    # every buffer of the step reserved, at the first block copied into them: the copy completes (no
    # SIGBUS) and the manifest finds no room
    "copy": ("block", None, True),
    # staged, the manifest next: it finds no room (an asynchronous save fails in the commit worker)
    "manifest": ("stage", "manifest", True),
    "manifest-async": ("stage", "manifest", False),
    # the manifest written, the marker next: it finds no room
    "marker": ("stage", "marker", True),
}


@pytest.mark.parametrize("where", ["copy", "manifest", "manifest-async", "marker"])
def test_tmpfs_fills_between_staging_and_commit(where, tmpfs, tmp_path):
    fs = tmpfs(4 << 20)
    ram = fs.root / "ram"
    store = make_store(ram, tmp_path / "obj")
    try:
        save_steps(store, range(4))
        point, stage, blocking = FILLS[where]
        held = store.tier("ram").capacity().used  # steps 2 and 3, and a spare set of buffers in the pool
        with hooks.on(point, fill_at(fs, point, stage)):
            with pytest.raises(TierfsError) as e:
                store.save(4, state_for(4), blocking=blocking)
                store.wait_until_finished()  # an asynchronous save's failure is raised here
        check_clean_failure(e.value, store, ram, 4)
        assert store.tier("ram").capacity().used == held, "the failed step's buffers did not go back to the pool"
        check_intact(store, {})
        finish_after_freeing(store, fs, 4, scale=12)
    finally:
        store.close()


def test_prepare_out_of_inodes_does_not_fail_the_next_save(tmpfs, tmp_path):
    """Pre-faulting spare buffers after a commit is best effort: a tmpfs without a free inode for the
    pool's directory skips it, and the next save goes on."""
    fs = tmpfs(4 << 20, nr_inodes=100)
    ram = fs.root / "ram"
    store = make_store(ram, tmp_path / "obj")
    try:
        arrays = [v.nbytes for k, v in state_for(0).items() if k != "step"]
        files = len(plan_files(arrays, 0, PAGE)[1])
        fs.use_inodes(leave=1 + files + 2)  # the step directory, its files, the manifest, the marker: no more
        save_steps(store, range(1))
        fs.free()
        save_steps(store, range(1, 4))
        check_intact(store, {})
    finally:
        store.close()


def test_budget_exceeded_by_the_next_step(shm_dir, tmp_path):
    """No mount needed: the RAM tier's ``budget=`` is the limit, checked before anything is written."""
    step_bytes = 4 * (12 * PAGE + 64)
    ram = Path(shm_dir) / "ram"
    store = make_store(ram, tmp_path / "obj", budget=int(4.5 * step_bytes))
    try:
        save_steps(store, range(4))
        with pytest.raises(TierfsError) as e:
            store.save(4, state_for(4, scale=36))  # three times larger: 2 kept steps + this > the budget
        check_clean_failure(e.value, store, ram, 4)
        assert "raise budget=" in str(e.value)
        check_intact(store, {})
        save_steps(store, range(4, 7))  # steps of the usual size still fit
        steps = store.steps()
        assert steps[6] == ["ram", "file"] and steps[4] == ["file"], steps
        check_intact(store, {})
    finally:
        store.close()
