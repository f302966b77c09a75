"""GPU state on a real CUDA device (``make gpu-check``): every test here is marked ``gpu`` and skipped
without a CUDA device; tests/test_device.py checks what the CPU shows of the same paths.

What is checked, bit-exact (the bytes of every tensor, several dtypes, bfloat16 among them):

* a model's and AdamW's state saved from the device and restored to the device (``restore(device=)``),
  to the host, and in place into fresh CUDA tensors (``restore_into``); CPU and GPU tensors mixed;
  non-contiguous and empty tensors;
* the RAM tier's buffers and their page-locks are made once and reused by later saves, and released
  when the store closes; a save of a known structure allocates no host memory;
* a save copies what the current stream produced (it waits for that stream, on the device), and waits
  for its own copies only, never for the whole device; a restore into tensors copies after what the
  current stream queued;
* ``overlap=``: an optimizer step and a forward pass racing the copies change nothing saved; through
  ``CheckpointManager`` and DCP too; DTensors on a one-rank process group;
* a failed page-lock warns once (RLIMIT_MEMLOCK) and copies through pageable memory, still bit-exact;
* ``restore(device=)``'s argument errors; a device out of memory for a non-contiguous tensor's copy, or for
  a restored tensor, is a :class:`~tierfs.errors.DeviceError`, and the store goes on.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tierfs import ArgumentError, CheckpointManager, DeviceError, TieredStore  # noqa: E402
from tierfs.device import copies as _device  # noqa: E402
from tierfs.policies import LatestN  # noqa: E402
from tierfs.testing import hooks  # noqa: E402
from tierfs.tiers import MemoryTier  # noqa: E402

from _copygate import Gate  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="needs a CUDA device (torch.cuda.is_available() is False): make gpu-check on a GPU"),
]

DEV = "cuda"
HERE = Path(__file__).resolve().parent
CHILDREN = HERE / "children"
#: cycles of torch.cuda._sleep that keep a stream busy for about half a second (SM clocks of 1.5-2 GHz)
SLEEP = 1_000_000_000
#: free space in /dev/shm the RAM tiers of these tests need (a few sets of buffers of up to a few hundred MiB)
NEED_SHM = 1 << 30


@pytest.fixture
def ram_dir(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """The RAM tier's directory: a fresh private directory in /dev/shm (conftest's ``shm_dir``), tmpfs, whose
    mappings can be page-locked; where /dev/shm is too small (a container's default), one under ``tmp_path``
    (then page-locking may be refused, and the test that checks it skips)."""
    try:
        vfs = os.statvfs("/dev/shm")
        free = vfs.f_bavail * vfs.f_frsize
    except OSError:
        free = 0
    if free >= NEED_SHM:
        return str(request.getfixturevalue("shm_dir"))
    path = tmp_path / "ram"
    path.mkdir()
    return str(path)


def is_tmpfs(path: str) -> bool:
    """Whether ``path`` is on a tmpfs (the mount point with the longest prefix of it, in /proc/mounts)."""
    path = os.path.realpath(path)
    best, fstype = "", ""
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 3:
                    mnt = parts[1].replace("\\040", " ")
                    if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) > len(best):
                        best, fstype = mnt, parts[2]
    except OSError:
        return False
    return fstype == "tmpfs"


def pin_off() -> str | None:
    """Why page-locking is off in this process (None: it is on)."""
    mod = sys.modules.get("tierfs.device.pinning", _device)
    return getattr(mod, "_pin_off", None)


# -- states and comparisons --------------------------------------------------------------------------------
class TinyTransformer(torch.nn.Module):
    """Embedding, two encoder layers, a norm and a head: about 0.5 M parameters (2 MiB; 6 MiB with AdamW)."""

    def __init__(self, vocab: int = 512, d: int = 128, layers: int = 2) -> None:
        super().__init__()
        self.vocab = vocab
        self.embed = torch.nn.Embedding(vocab, d)
        self.blocks = torch.nn.ModuleList([torch.nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.0, batch_first=True)
                                           for _ in range(layers)])
        self.norm = torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(d, vocab, bias=False)

    def forward(self, x: Any) -> Any:
        h = self.embed(x)
        for b in self.blocks:
            h = b(h)
        return self.head(self.norm(h))


def transformer(seed: int) -> tuple[Any, Any]:
    """A TinyTransformer on the device and its AdamW, after one training step (AdamW's state exists: its
    ``exp_avg``/``exp_avg_sq`` on the device, its ``step`` counters on the host)."""
    torch.manual_seed(seed)
    m = TinyTransformer().to(DEV)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    x = torch.randint(0, m.vocab, (4, 32), device=DEV)
    y = torch.randint(0, m.vocab, (4, 32), device=DEV)
    torch.nn.functional.cross_entropy(m(x).reshape(-1, m.vocab), y.reshape(-1)).backward()
    opt.step()
    opt.zero_grad()
    return m, opt


def batchnorm_model(seed: int) -> tuple[Any, Any]:
    """A small model with BatchNorm (state that forward changes) on the device, AdamW after one step."""
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.BatchNorm1d(128), torch.nn.ReLU(),
                            torch.nn.Linear(128, 8)).to(DEV)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    train_step(m, opt, 64)
    return m, opt


def train_step(m: Any, opt: Any, width: int) -> None:
    m.train()
    m(torch.randn(32, width, device=DEV)).square().mean().backward()
    opt.step()
    opt.zero_grad()


def dtypes(device: str, seed: int) -> dict[str, Any]:
    """NaN-free random tensors of several dtypes."""
    g = torch.Generator(device=device).manual_seed(seed)
    out = {str(dt).removeprefix("torch."): torch.randn(257, 3, generator=g, device=device, dtype=dt)
           for dt in (torch.float32, torch.float16, torch.bfloat16, torch.float64)}
    for dt in (torch.int8, torch.int32, torch.int64):
        out[str(dt).removeprefix("torch.")] = torch.randint(-100, 100, (1000,), generator=g, device=device, dtype=dt)
    out["uint8"] = torch.randint(0, 256, (33, 7), generator=g, device=device, dtype=torch.uint8)
    out["bool"] = torch.rand(999, generator=g, device=device) > 0.5
    out["scalar"] = torch.randn((), generator=g, device=device, dtype=torch.bfloat16)
    return out


def mixed_state(seed: int) -> tuple[dict[str, Any], Any, Any]:
    """A transformer's and AdamW's state (on the device, AdamW's step counters on the host), tensors of
    every dtype on the device and on the host, a numpy array and JSON values."""
    m, opt = transformer(seed)
    state = {"model": m.state_dict(), "optim": opt.state_dict(), "gpu": dtypes(DEV, seed), "cpu": dtypes("cpu", seed),
             "np": np.random.default_rng(seed).standard_normal(100).astype(np.float32), "epoch": seed}
    return state, m, opt


def snapshot(state: Any) -> Any:
    """Copies of every tensor and array of ``state`` (the values a save must store), on their devices."""
    if isinstance(state, Mapping):
        return {k: snapshot(v) for k, v in state.items()}
    if isinstance(state, torch.Tensor):
        return state.detach().clone()
    if isinstance(state, np.ndarray):
        return state.copy()
    return copy.deepcopy(state)


def fresh(state: Any, device: str | None = None) -> Any:
    """The structure of ``state`` with new, contiguous tensors of zeros (on ``device``, else each on its own)
    and arrays of zeros; other values copied."""
    if isinstance(state, Mapping):
        return {k: fresh(v, device) for k, v in state.items()}
    if isinstance(state, torch.Tensor):
        return torch.zeros(state.shape, dtype=state.dtype, device=device or state.device)
    if isinstance(state, np.ndarray):
        return np.zeros_like(state)
    return copy.deepcopy(state)


def as_bytes(t: Any) -> Any:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_bitexact(got: Any, want: Any, key: str) -> None:
    assert isinstance(got, torch.Tensor), (key, type(got))
    assert got.dtype == want.dtype and tuple(got.shape) == tuple(want.shape), (key, got.dtype, got.shape, want.dtype,
                                                                               want.shape)
    g, w = as_bytes(got), as_bytes(want)
    if g.device != w.device:
        g, w = g.cpu(), w.cpu()
    assert torch.equal(g, w), f"{key}: the bytes differ"


def assert_same(got: Mapping[Any, Any], want: Mapping[Any, Any], device: str | None = None, where: str = "") -> int:
    """Every tensor and array of ``want`` is in ``got`` (a restore's keys are strings) with the same bytes;
    with ``device``, each torch tensor of ``got`` is on a device of that type. Returns the tensors compared."""
    n = 0
    for k, v in want.items():
        key = f"{where}/{k}"
        assert k in got or str(k) in got, f"{key} is missing"
        g = got[k] if k in got else got[str(k)]
        if isinstance(v, Mapping):
            n += assert_same(g, v, device, key)
        elif isinstance(v, torch.Tensor):
            if device is not None:
                assert g.device.type == torch.device(device).type, (key, g.device)
            assert_bitexact(g, v, key)
            n += 1
        elif isinstance(v, np.ndarray):
            assert isinstance(g, np.ndarray) and g.dtype == v.dtype and np.array_equal(g, v), key
    return n


def tensors(state: Any) -> list[Any]:
    if isinstance(state, Mapping):
        return [t for v in state.values() for t in tensors(v)]
    return [state] if isinstance(state, torch.Tensor) else []



# -- save and restore, bit-exact ---------------------------------------------------------------------------
def test_a_model_and_adamw_state_round_trips_bit_exact(ram_dir: str) -> None:
    state, m, opt = mixed_state(1)
    assert any(t.device.type == "cpu" for t in tensors(state["optim"]))  # AdamW's step counters: a mixed state
    want = snapshot(state)
    with TieredStore([MemoryTier(ram_dir)]) as store:
        assert store.save(1, state)
        assert store.copies is not None and store.copies.done()  # save returned once its copies were complete

        got, info = store.restore(1, device=DEV)  # every torch tensor to the device, numpy stays on the host
        assert info.step == 1
        assert assert_same(got, want, device=DEV) > 50
        assert isinstance(got["np"], np.ndarray) and got["epoch"] == 1

        got, _ = store.restore(1)  # to the host
        assert_same(got, want, device="cpu")

        for device in (DEV, None):  # fresh CUDA tensors for everything; then each on the device it was saved from
            target = fresh(want, device)
            kept = tensors(target)
            store.restore_into(target, 1)
            assert_same(target, want)
            assert all(a is b for a, b in zip(tensors(target), kept))  # in place

        m2, opt2 = transformer(2)  # a new model and optimizer of the same shapes, restored in place
        target = {"model": m2.state_dict(), "optim": opt2.state_dict(), "gpu": fresh(want["gpu"]),
                  "cpu": fresh(want["cpu"]), "np": np.zeros(100, np.float32), "epoch": 0}
        store.restore_into(target, 1)
        assert_same(m2.state_dict(), want["model"])
        assert_same(opt2.state_dict()["state"], want["optim"]["state"])
        for p, q in zip(m2.parameters(), m.parameters()):
            assert p.device.type == torch.device(DEV).type and torch.equal(as_bytes(p), as_bytes(q))


def test_non_contiguous_and_empty_tensors_round_trip(ram_dir: str) -> None:
    torch.manual_seed(3)
    base = torch.randn(64, 48, device=DEV)
    wide = torch.randn(1024, 512, device=DEV)  # 2 MiB: restored block by block, not with the small ones
    half = torch.randn(96, 40, device=DEV, dtype=torch.bfloat16)
    state = {
        "transposed": base.t(), "stepped": base[:, ::3], "offset": base[5:9], "expanded": base[0:1].expand(7, 48),
        "wide_t": wide.t(), "bf16_t": half.t(), "bf16_stepped": half[::2, 1::3],
        "empty": torch.empty(0, 16, device=DEV, dtype=torch.bfloat16), "empty_f32": torch.empty(0, device=DEV),
        "scalar": torch.tensor(2.5, device=DEV), "base": base,
    }
    assert not any(state[k].is_contiguous() for k in ("transposed", "stepped", "expanded", "wide_t", "bf16_t"))
    want = snapshot(state)
    with TieredStore([MemoryTier(ram_dir)]) as store:
        for step in (1, 2):  # the second into the structure's known layout
            assert store.save(step, state)
            got, _ = store.restore(step, device=DEV)
            assert_same(got, want, device=DEV)
            assert all(t.is_contiguous() for t in tensors(got))
            target = fresh(want, DEV)
            store.restore_into(target, step)
            assert_same(target, want)
        # in place into non-contiguous CUDA tensors (a small one and one over 1 MiB)
        target = {k: torch.zeros_like(v) for k, v in want.items()}
        target["transposed"] = torch.zeros(64, 48, device=DEV).t()  # shape (48, 64), strides (1, 48)
        target["wide_t"] = torch.zeros(1024, 512, device=DEV).t()
        target["bf16_t"] = torch.zeros(96, 40, device=DEV, dtype=torch.bfloat16).t()
        assert not any(target[k].is_contiguous() for k in ("transposed", "wide_t", "bf16_t"))
        kept = dict(target)
        store.restore_into(target, 2)
        assert_same(target, want)
        assert all(target[k] is kept[k] for k in target)


def test_buffers_and_their_page_locks_are_made_once_and_reused(ram_dir: str) -> None:
    if not is_tmpfs(ram_dir):
        pytest.skip(f"the RAM tier's directory {ram_dir} is not on a tmpfs (/dev/shm is too small): its pages may "
                    "not be page-lockable")
    base = _device.pinned_bytes()
    torch.manual_seed(4)
    state = {"w": torch.randn(1 << 20, device=DEV), "h": torch.randn(4096, device=DEV, dtype=torch.bfloat16),
             "c": torch.arange(100)}
    on_device = sum(t.nbytes for t in state.values() if t.device.type == "cuda")
    registered: list[int] = []
    pinned: list[int] = []
    counts: list[int] = []
    with hooks.on("pin", lambda nbytes: registered.append(nbytes)):  # before each cudaHostRegister
        with TieredStore([MemoryTier(ram_dir, keep=LatestN(1))]) as store:
            for step in range(1, 8):
                state["w"].add_(1)
                assert store.save(step, state)
                pinned.append(_device.pinned_bytes() - base)
                counts.append(len(registered))
            assert pinned[0] >= on_device, ("the first save page-locked nothing", pinned, pin_off())
            # the buffers of the first saves (the step kept and the one being saved) are reused from then on,
            # their page-locks too: no registration after the first few saves, the bytes held stay the same
            assert counts[-3:] == [counts[-3]] * 3, counts
            assert pinned[-3:] == [pinned[-3]] * 3, pinned
            assert pinned[-1] <= 3 * pinned[0], pinned  # a few sets of buffers, not one per save
            assert pinned[-1] <= sum(registered), (pinned, registered)
            got, _ = store.restore(7, device=DEV)
            assert_same(got, state)
            assert _device.pinned_bytes() - base == pinned[-1]  # the restore read through the same page-locked mapping
    assert _device.pinned_bytes() == base  # every page-lock released before its buffer was unmapped


def host_allocations(prof: Any) -> int:
    """Bytes of host memory torch allocated while ``prof`` ran (each allocation, not net of frees), on the
    thread that ran the profiler."""
    results = getattr(prof.profiler, "kineto_results", None)
    if results is not None and hasattr(torch.autograd, "DeviceType"):
        return sum(ev.nbytes() for ev in results.events()
                   if ev.name() == "[memory]" and ev.device_type() == torch.autograd.DeviceType.CPU and ev.nbytes() > 0)
    return sum(e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0)


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def peak_rss_growth(fn: Callable[[], Any]) -> int | None:
    """How far the process's resident memory rose above where it was while ``fn`` ran, whatever thread
    allocated (the peak is reset through /proc/self/clear_refs; None where that is not allowed)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        before = _status_bytes("VmRSS")
    except (OSError, KeyError):
        return None
    fn()
    return _status_bytes("VmHWM") - before


def test_a_save_of_a_known_structure_makes_no_host_copy(ram_dir: str) -> None:
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(5)
    layers = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 1024)).to(DEV)
    opt = torch.optim.AdamW(layers.parameters())
    train_step(layers, opt, 1024)
    big = torch.randn(10 << 20, device=DEV)  # 40 MiB: a host copy of it would be its own mapping (glibc: over 32 MiB)
    state = {"model": layers.state_dict(), "optim": opt.state_dict(), "big": big}
    nbytes = sum(t.nbytes for t in tensors(state))
    assert nbytes > 60 << 20
    with TieredStore([MemoryTier(ram_dir, keep=LatestN(1))]) as store:
        store.save(1, state)  # a new structure: its layout, buffers and page-locks are made here
        store.wait_until_finished()
        pinned_host = torch.cuda.host_memory_stats() if hasattr(torch.cuda, "host_memory_stats") else {}
        for step, kwargs in ((2, {}), (3, {}), (4, {"blocking": False, "overlap": opt})):
            with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                store.save(step, state, **kwargs)
                store.copies.wait()
            allocated = host_allocations(prof)
            assert allocated < 1 << 20, (step, allocated, nbytes)  # on the caller's thread
            store.wait_until_finished()
        growth = peak_rss_growth(lambda: (store.save(5, state), store.copies.wait()))  # on any thread
        if growth is not None:
            assert growth < big.nbytes // 2, (growth, big.nbytes)
        store.wait_until_finished()
        target = fresh(state, DEV)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            store.restore_into(target, 5)  # from the RAM tier's pages straight into the device's tensors
        assert host_allocations(prof) < 1 << 20
        assert_same(target, state)
        after = torch.cuda.host_memory_stats() if pinned_host else {}
        for k in ("num_host_alloc", "active_requests.allocated"):  # torch's own page-locked buffers: none used
            if k in pinned_host and k in after:
                assert after[k] == pinned_host[k], (k, pinned_host[k], after[k])


# -- streams -----------------------------------------------------------------------------------------------
def test_a_save_copies_what_the_current_stream_produced(ram_dir: str) -> None:
    with TieredStore([MemoryTier(ram_dir)]) as store:
        for step, stream in ((1, torch.cuda.Stream()), (2, None), (3, torch.cuda.Stream())):
            torch.manual_seed(step)
            t = torch.randn(1 << 20, device=DEV)
            h = torch.randn(1000, 3, device=DEV, dtype=torch.bfloat16)
            want = {"t": t * 2, "h": (h * 2).t()}
            torch.cuda.synchronize()
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                current = torch.cuda.current_stream()
                torch.cuda._sleep(SLEEP)  # the producer is busy...
                t.mul_(2)  # ...and these come after it, on the same stream
                h.mul_(2)
                assert not current.query(), "the stream finished before save was called: raise SLEEP"
                assert store.save(step, {"t": t, "h": h.t()})
                # save returned once its copies were complete, and they came after the producer's work
                assert current.query()
            got, _ = store.restore(step, device=DEV)
            assert_same(got, want, device=DEV)


def test_a_save_waits_for_its_own_copies_not_for_the_whole_device(ram_dir: str) -> None:
    torch.manual_seed(6)
    state = {"t": torch.randn(1 << 20, device=DEV), "h": torch.randn(999, device=DEV, dtype=torch.bfloat16)}
    want = snapshot(state)
    other = torch.cuda.Stream()
    with TieredStore([MemoryTier(ram_dir, keep=LatestN(1))]) as store:
        store.save(1, state)  # both sets of buffers made and page-locked: the save below reuses one
        store.save(2, state)
        torch.cuda.synchronize()
        with torch.cuda.stream(other):
            torch.cuda._sleep(4 * SLEEP)  # about two seconds of work the state does not depend on
        try:
            assert store.save(3, state)
            busy = not other.query()
        finally:
            other.synchronize()
        assert busy, "save waited for work on another stream"
        got, _ = store.restore(3, device=DEV)
        assert_same(got, want)


def test_restore_into_comes_after_what_the_current_stream_queued(ram_dir: str) -> None:
    torch.manual_seed(7)
    want = torch.randn(8 << 20, device=DEV)  # 32 MiB: several blocks, verified (and copied) on several threads
    with TieredStore([MemoryTier(ram_dir)]) as store:
        store.save(1, {"w": want})
        target = torch.empty_like(want)
        s = torch.cuda.Stream()
        torch.cuda.synchronize()
        with torch.cuda.stream(s):
            torch.cuda._sleep(SLEEP)
            target.fill_(-1.0)  # the loop's last write to the target, still queued when the restore starts
            assert not s.query(), "the stream finished before the restore: raise SLEEP"
            store.restore_into({"w": target}, 1)
            exact = torch.equal(as_bytes(target), as_bytes(want))  # on the current stream, after the restore
        torch.cuda.synchronize()
        assert exact, "the restore's copies ran before the work queued on the current stream (or its fill_ after them)"
        assert torch.equal(as_bytes(target), as_bytes(want))


# -- overlap: the loop goes on while the copies run ---------------------------------------------------------
def test_an_optimizer_step_racing_the_copies_changes_nothing_saved(ram_dir: str) -> None:
    torch.manual_seed(8)
    m = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.GELU()) for _ in range(6)]
                            ).to(DEV)  # 6.3 M parameters: 25 MiB, 75 MiB with AdamW's state
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    train_step(m, opt, 1024)
    raced = []
    with TieredStore([MemoryTier(ram_dir)]) as store:
        for step in (1, 2, 3):
            loss = m(torch.randn(64, 1024, device=DEV)).square().mean()  # forward before the save
            state = {"model": m.state_dict(), "optim": opt.state_dict()}
            want = snapshot(state)
            assert store.save(step, state, blocking=False, overlap=opt)
            copies = store.copies
            raced.append(not copies.done())
            loss.backward()  # right away: the gradients are no part of the state
            opt.step()  # tierfs's pre-hook waits for the copies first
            opt.zero_grad()
            assert copies.done()
            live = m.state_dict()
            assert all(not torch.equal(live[k], want["model"][k]) for k in live), "the step changed no parameter"
            got, _ = store.restore(step, device=DEV)
            assert assert_same(got, want, device=DEV) == len(tensors(want))
    print(f"copies still running when save returned: {raced}")


def test_overlap_forward_and_step_while_the_optimizer_copies_are_held(ram_dir: str) -> None:
    m, opt = batchnorm_model(9)
    state = {"model": m.state_dict(), "optim": opt.state_dict()}
    want = snapshot(state)
    bn = m[1]
    gate = Gate()
    with TieredStore([MemoryTier(ram_dir)]) as store:
        with hooks.on("copy", gate):
            assert store.save(1, state, blocking=False, overlap=opt)
            copies = store.copies
            assert copies is not None and not copies.done()  # the parameters' and AdamW's copies are held back
            # forward in train mode changes BatchNorm's statistics: they were copied before save returned
            m.train()
            loss = m(torch.randn(32, 64, device=DEV)).square().mean()
            assert not torch.equal(bn.running_mean, want["model"]["1.running_mean"])
            assert int(bn.num_batches_tracked) == int(want["model"]["1.num_batches_tracked"]) + 1
            seen: list[bool] = []
            hook = opt.register_step_pre_hook(lambda *_: seen.append(copies.done()))  # runs after tierfs's
            loss.backward()
            opener = threading.Timer(0.3, gate.open.set)
            opener.start()
            opt.step()  # waits in tierfs's pre-hook until the gate opens and the copies are complete
            opener.join()
            hook.remove()
        assert seen == [True] and gate.held >= 1
        assert not torch.equal(m[0].weight, want["model"]["0.weight"])
        got, _ = store.restore(1, device=DEV)
        assert assert_same(got, want, device=DEV) == len(tensors(want))


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
def test_overlap_through_the_manager_and_dcp(ram_dir: str) -> None:
    m, opt = batchnorm_model(10)
    state = {"model": m.state_dict(), "optim": opt.state_dict()}
    with CheckpointManager([MemoryTier(ram_dir)], overlap=opt) as mgr:
        for step in (1, 2):  # the second save replays DCP's plan through the store
            want = snapshot(state)
            assert mgr.save(step, state)
            train_step(m, opt, 64)  # right away: the step waits for the copies in tierfs's pre-hook
            assert mgr.store.copies.done()
            mgr.wait_until_finished()
            m2, opt2 = batchnorm_model(11)
            target = {"model": m2.state_dict(), "optim": opt2.state_dict()}
            assert mgr.restore(target, step) == step
            assert_same(m2.state_dict(), want["model"])
            assert_same(target["optim"]["state"], want["optim"]["state"])
            assert all(p.device.type == torch.device(DEV).type for p in m2.parameters())


# -- DTensor -----------------------------------------------------------------------------------------------
@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
def test_dtensors_on_one_rank_through_the_manager(ram_dir: str, tmp_path: Path) -> None:
    import torch.distributed as dist

    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    assert not dist.is_initialized()
    torch.cuda.set_device(0)
    nccl = dist.is_nccl_available()
    dist.init_process_group("cpu:gloo,cuda:nccl" if nccl else "gloo", store=dist.FileStore(str(tmp_path / "pg"), 1),
                            rank=0, world_size=1)
    try:
        mesh = DeviceMesh("cuda", [0])

        def sharded(t: Any) -> Any:  # (gloo scatters no CUDA tensors: then the one shard is the whole tensor)
            return distribute_tensor(t, mesh, [Shard(0)]) if nccl else DTensor.from_local(t, mesh, [Shard(0)],
                                                                                         run_check=False)

        torch.manual_seed(12)
        state = {"w": sharded(torch.randn(64, 32, device=DEV, dtype=torch.bfloat16)),
                 "b": sharded(torch.randn(40, device=DEV)), "plain": torch.randn(17, 3, device=DEV),
                 "host": torch.arange(7)}
        local = {k: v.to_local() if isinstance(v, DTensor) else v for k, v in state.items()}
        with CheckpointManager([MemoryTier(ram_dir)]) as mgr:
            for step in (1, 2):  # the second save replays DCP's plan through the store (the local shards)
                want = snapshot(local)
                assert mgr.save(step, state)
                mgr.wait_until_finished()
                target = {"w": sharded(torch.zeros(64, 32, device=DEV, dtype=torch.bfloat16)),
                          "b": sharded(torch.zeros(40, device=DEV)), "plain": torch.zeros(17, 3, device=DEV),
                          "host": torch.zeros(7, dtype=torch.int64)}
                kept = dict(target)
                assert mgr.restore(target, step) == step
                for k, v in want.items():
                    got = target[k]
                    assert got is kept[k], k  # in place
                    if k in ("w", "b"):
                        assert isinstance(got, DTensor) and tuple(got.placements) == (Shard(0),)
                        assert got.to_local().device.type == torch.device(DEV).type
                        got = got.to_local()
                    assert_bitexact(got, v, k)
                for t in local.values():  # the next step saves other values
                    t.add_(1)
    finally:
        dist.destroy_process_group()


# -- a failed page-lock ------------------------------------------------------------------------------------
def test_a_failed_page_lock_warns_once_and_copies_through_pageable_memory(ram_dir: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TIERFS_PIN"}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent), str(CHILDREN), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, str(CHILDREN / "gpu_pin_child.py"), ram_dir], capture_output=True, text=True,
                          timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert lines, (proc.stdout[-2000:], proc.stderr[-2000:])
    out = json.loads(lines[-1])
    assert out["refused"] == 1, out  # page-locking was tried once: the process remembers it failed
    assert len(out["memlock_warnings"]) == 1, out
    msg = out["memlock_warnings"][0]
    assert "RLIMIT_MEMLOCK" in msg and "ulimit -l" in msg and "refused by the test" in msg, msg
    assert out["pinned_bytes"] == 0, out
    assert out["pin_off"] and "refused by the test" in out["pin_off"], out
    assert out["exact"] == {"1 to the device": True, "2 to the device": True, "2 to the host": True,
                            "2 in place": True}, out


# -- arguments -----------------------------------------------------------------------------------------------
def test_restore_to_a_device_checks_its_arguments(ram_dir: str) -> None:
    want = {"w": torch.randn(8, 8, device=DEV, dtype=torch.bfloat16)}
    with TieredStore([MemoryTier(ram_dir)]) as store:
        store.save(1, want)
        with pytest.raises(ArgumentError, match="cuda:99"):
            store.restore(1, device="cuda:99")
        for device in ("cuda:0", torch.device("cuda"), "cuda"):
            with pytest.raises(ArgumentError, match="zero_copy"):
                store.restore(1, device=device, zero_copy=True)
        got, _ = store.restore(1, device=torch.device("cuda", 0))  # the store goes on
        assert got["w"].device == torch.device("cuda", 0)
        assert_same(got, want)


# -- out of device memory (last: it fills the device for a moment) --------------------------------------------
def test_no_device_memory_for_a_non_contiguous_copy_is_a_device_error(ram_dir: str) -> None:
    torch.manual_seed(13)
    base = torch.randn(8192, 16384, device=DEV)  # 512 MiB
    view = base[:, ::2]  # 256 MiB, not contiguous: its copy to the host needs as much on the device first
    small = torch.randn(1000, device=DEV)
    state = {"v": view, "s": small}
    want = snapshot(state)
    with TieredStore([MemoryTier(ram_dir, keep=LatestN(1))]) as store:
        # both sets of buffers made and page-locked while the device has room: the failing save reuses one
        store.save(1, state)
        store.save(2, state)
        store.wait_until_finished()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # no cached block may serve the copy's temporary
        margin = 64 << 20
        blob = None
        for _ in range(4):
            free, _total = torch.cuda.mem_get_info()
            try:
                blob = torch.empty(max(free - margin, 0), dtype=torch.uint8, device=DEV)
                break
            except torch.OutOfMemoryError:
                margin *= 2
        if blob is None:
            pytest.skip("could not fill the device's memory")
        try:
            free, _total = torch.cuda.mem_get_info()
            if free >= view.nbytes:
                pytest.skip(f"{free >> 20} MiB of device memory stayed free")
            with pytest.raises(DeviceError, match="not contiguous"):
                store.save(3, state)
            assert not store.has_step(3)
            # a restore to the full device: a DeviceError naming the tensor (the copy itself is good)
            with pytest.raises(DeviceError, match="does not fit"):
                store.restore(2, device=DEV)
        finally:
            del blob
            torch.cuda.empty_cache()
        assert store.save(4, state)  # the store goes on
        got, _ = store.restore(4, device=DEV)
        assert_same(got, want, device=DEV)
