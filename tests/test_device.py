"""The copy path of GPU state, as far as the CPU shows it: an overlapped save (its copies on tierfs's copy
thread, an optimizer's step waiting for them, the handle a loop waits on), the arguments, no host copy
during a save of a known structure, a copy that fails, the page-lock's lifetime (held while a buffer is
reused, let go before it is unmapped), and no CUDA state made by a CPU job. On a GPU, tests/test_gpu.py
(``make gpu-check``) checks the device side."""

from __future__ import annotations

import subprocess
import sys
import threading

import numpy as np
import pytest
import torch

import tierfs
from tierfs import ArgumentError, CheckpointManager, DeviceError, TieredStore, TierfsError
from tierfs.policies import LatestN
from tierfs.testing import hooks
from tierfs.tiers import MemoryTier

from _copygate import Gate


def model_and_optimizer(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A small model with BatchNorm (state that forward changes) and AdamW state after one step."""
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32), torch.nn.ReLU(),
                            torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(m.parameters(), lr=0.1)
    train_step(m, opt)
    return m, opt


def train_step(m: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    m.train()
    m(torch.randn(8, 16)).square().sum().backward()
    opt.step()
    opt.zero_grad()


def state_of(m: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
    return {"model": m.state_dict(), "optim": opt.state_dict()}


def snapshot(state: dict) -> dict:
    """Copies of every tensor of ``state`` (the values a save must store)."""
    return {k: snapshot(v) if isinstance(v, dict) else v.clone() if isinstance(v, torch.Tensor) else v
            for k, v in state.items()}


def assert_same(got: dict, want: dict, where: str = "") -> None:
    for k, v in want.items():
        key = f"{where}/{k}"
        if isinstance(v, dict):
            assert_same(got[str(k)] if str(k) in got else got[k], v, key)
        elif isinstance(v, torch.Tensor):
            g = got[str(k)] if str(k) in got else got[k]
            assert g.dtype == v.dtype and g.shape == v.shape, key
            assert torch.equal(g.reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8)), key  # bit-exact


def test_overlap_save_returns_before_the_optimizer_copies_and_step_waits_for_them(shm_dir: str) -> None:
    m, opt = model_and_optimizer()
    state = state_of(m, opt)
    want = snapshot(state)
    gate = Gate()
    with TieredStore([MemoryTier(shm_dir)]) as store, hooks.on("copy", gate):
        assert store.save(1, state, blocking=False, overlap=opt)
        copies = store.copies
        assert copies is not None and not copies.done()  # the parameters' and AdamW's copies are held back
        # forward changes BatchNorm's statistics: they were copied before save returned
        m.train()
        loss = m(torch.randn(8, 16)).square().sum()
        assert not torch.equal(m[1].running_mean, want["model"]["1.running_mean"])
        seen: list[bool] = []
        opt.register_step_pre_hook(lambda *_: seen.append(copies.done()))  # runs after tierfs's hook
        loss.backward()
        stepping = threading.Thread(target=opt.step)
        stepping.start()
        gate.open.set()
        stepping.join()
        assert seen == [True]  # the step waited for the copies before it changed anything
        assert gate.held >= 1
        assert not torch.equal(m[0].weight, want["model"]["0.weight"])
        got, _ = store.restore(1)
    assert_same(got, want)


def test_overlap_without_an_optimizer_gives_a_handle_to_wait_on(shm_dir: str) -> None:
    m, opt = model_and_optimizer(1)
    state = {"model": m.state_dict()}
    want = snapshot(state)
    gate = Gate()
    with TieredStore([MemoryTier(shm_dir)]) as store:
        with hooks.on("copy", gate):
            store.save(1, state, blocking=False, overlap=m.parameters())
            copies = store.copies
            assert copies is not None and not copies.done()
            gate.open.set()
            copies.wait()
            assert copies.done()
        train_step(m, opt)
        got, _ = store.restore(1)
        assert_same(got, want)
        store.save(2, state)  # nothing left running: no handle
        assert store.copies is None


def test_overlap_through_the_manager_and_dcp(shm_dir: str) -> None:
    m, opt = model_and_optimizer(2)
    state = state_of(m, opt)
    gate = Gate()
    with CheckpointManager([MemoryTier(shm_dir)], overlap=opt) as mgr:
        for step in (1, 2):  # the second save replays DCP's plan: the store's path
            want = snapshot(state)
            with hooks.on("copy", gate):
                assert mgr.save(step, state)
                assert not mgr.store.copies.done()
                gate.open.set()
                train_step(m, opt)  # waits for the copies in tierfs's pre-hook
            gate.open.clear()
            m2, opt2 = model_and_optimizer(5)
            target = state_of(m2, opt2)
            mgr.wait_until_finished()
            mgr.restore(target, step)
            assert_same(m2.state_dict(), want["model"])


@pytest.mark.parametrize("overlap", [True, "params", [1], object(), iter([])])
def test_overlap_arguments_are_checked(shm_dir: str, overlap: object) -> None:
    m, opt = model_and_optimizer()
    with TieredStore([MemoryTier(shm_dir)]) as store:
        with pytest.raises(ArgumentError, match="overlap="):
            store.save(1, state_of(m, opt), overlap=overlap)
        assert not store.has_step(1)
        assert store.save(1, state_of(m, opt), overlap=[opt])  # a list of optimizers
    with pytest.raises(ArgumentError, match="overlap="):
        CheckpointManager([MemoryTier(shm_dir)], overlap=True)


def test_the_manager_keeps_a_generator_of_parameters_for_every_save(shm_dir: str) -> None:
    m, opt = model_and_optimizer(4)
    gate = Gate()
    with CheckpointManager([MemoryTier(shm_dir)], overlap=m.parameters(), use_dcp=False) as mgr:
        for step in (1, 2):
            with hooks.on("copy", gate):
                mgr.save(step, {"model": m.state_dict()})
                assert mgr.store.copies is not None and not mgr.store.copies.done()
                gate.open.set()
                mgr.store.copies.wait()
            gate.open.clear()


def test_a_failed_copy_is_a_device_error_and_the_step_is_not_committed(shm_dir: str) -> None:
    m, opt = model_and_optimizer(3)
    state = state_of(m, opt)

    def fail(step: int, nbytes: int, later: bool) -> None:
        raise RuntimeError("copy engine fault")

    with TieredStore([MemoryTier(shm_dir)]) as store:
        with hooks.on("copy", fail), pytest.raises(TierfsError, match="copy engine fault"):
            store.save(1, state, overlap=opt)
        assert not store.has_step(1)
        gate = threading.Event()

        def fail_later(step: int, nbytes: int, later: bool) -> None:
            gate.wait()
            fail(step, nbytes, later)

        with hooks.on("copy", fail_later):
            store.save(2, state, blocking=False, overlap=opt)  # returns: the parameters' copies are still to come
            gate.set()
            with pytest.raises(DeviceError, match="step 2: copying the state from the device failed"):
                store.copies.wait()
            with pytest.raises(TierfsError):
                opt.step()  # tierfs's pre-hook raises rather than let the loop go on unsaved
        with pytest.raises(TierfsError):
            store.wait_until_finished()  # the commit that needed the copies failed, and says so
        want = snapshot(state)
        assert store.save(3, state)  # the store goes on
        got, _ = store.restore(3)
    assert_same(got, want)


def test_a_save_of_a_known_structure_makes_no_host_copy(shm_dir: str) -> None:
    torch.manual_seed(0)
    layers = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(16)])
    opt = torch.optim.AdamW(layers.parameters())
    train_step_ = lambda: (layers(torch.randn(4, 256)).sum().backward(), opt.step(), opt.zero_grad())  # noqa: E731
    train_step_()
    state = {"model": layers.state_dict(), "optim": opt.state_dict()}
    nbytes = sum(t.nbytes for t in layers.state_dict().values()) * 3
    with TieredStore([MemoryTier(shm_dir)]) as store:
        store.save(1, state)
        for step, kwargs in ((2, {}), (3, {"blocking": False, "overlap": opt})):
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
                store.save(step, state, **kwargs)
                if store.copies is not None:
                    store.copies.wait()
            allocated = sum(e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0)
            assert allocated < nbytes // 100, (step, allocated, nbytes)
        store.wait_until_finished()


def test_a_page_lock_is_held_while_the_buffer_is_reused_and_let_go_before_it_is_unmapped(shm_dir: str) -> None:
    state = {"a": torch.arange(1 << 16, dtype=torch.float32), "b": np.arange(1000)}
    tier = MemoryTier(shm_dir, keep=LatestN(1))  # step 1's buffers go to the pool, then into a later step
    released: list[bool] = []
    with TieredStore([tier]) as store:
        store.save(1, state)
        memos = [tier.buffer_memo(1, name) for name in tier.file_sizes(1)]
        memos = [m for m in memos if m is not None]
        assert memos
        for memo in memos:  # as tierfs.device.copies.pin keeps a registration
            memo.held["page-locked"] = lambda: released.append(True)
        for step in (2, 3, 4):
            store.save(step, state)
            assert released == []  # held: the buffers are reused, not unmapped
        assert tier.stats()["reused"] >= len(memos)  # (step 1's buffers did go into later steps)
    # every buffer is unmapped once the store closes: each registration was let go first, once
    assert len(released) == len(memos)


def test_restore_to_a_device_checks_the_device(shm_dir: str) -> None:
    state = {"w": torch.randn(64, dtype=torch.bfloat16), "n": np.arange(5)}
    with TieredStore([MemoryTier(shm_dir)]) as store:
        store.save(1, state)
        got, _ = store.restore(1, device="cpu")
        assert torch.equal(got["w"], state["w"]) and np.array_equal(got["n"], state["n"])
        for bad, match in (("nonsense", "not a torch device"), ("meta", "CUDA device or the CPU"), (3.5, "not a torch device")):
            with pytest.raises(ArgumentError, match=match):
                store.restore(1, device=bad)
        if not torch.cuda.is_available():
            with pytest.raises(ArgumentError, match="sees no CUDA device"):
                store.restore(1, device="cuda:0")


def test_a_cpu_job_makes_no_cuda_state() -> None:
    code = """
import tempfile, torch, tierfs
from tierfs.policies import LatestN
from tierfs.tiers import MemoryTier
m = torch.nn.Linear(4, 4); opt = torch.optim.SGD(m.parameters(), lr=1)
with tempfile.TemporaryDirectory(dir='/dev/shm') as d, tierfs.TieredStore([MemoryTier(d)]) as s:
    s.save(1, {'m': m.state_dict()}); s.save(2, {'m': m.state_dict()}, blocking=False, overlap=opt)
    s.restore(1); s.restore_into({'m': m.state_dict()}, 2)
print(torch.cuda.is_initialized())
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_an_optimizer_loaded_again_is_read_again(shm_dir: str) -> None:
    """What an overlapped save leaves running is found by address; a load of the optimizer's state makes new
    state tensors, whose copies must still be left running (and nothing else)."""
    from tierfs.device.copies import Overlap

    m, opt = model_and_optimizer(6)
    before = Overlap.of(opt)
    opt.load_state_dict(snapshot(opt.state_dict()))  # new exp_avg / exp_avg_sq tensors
    after = Overlap.of(opt)
    assert all(after.later(v) for s in opt.state.values() for v in s.values() if v.numel())
    assert all(after.later(p.detach()) for p in m.parameters())
    assert not after.later(m[1].running_mean) and not before.later(m[1].running_mean)
