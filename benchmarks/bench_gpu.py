"""GPU state: save stall, overlap stall, commit and restore of tierfs against the pinned-copy floors.

    python3 benchmarks/bench_gpu.py [--out DIR] [--states small,2gb,8gb] [--repeats 5] [--slow-repeats 3]
        [--warmup 3] [--shm /dev/shm] [--time-limit 280] [--cpu-dry-run]

States (``--states``), built on the GPU from real ``torch.nn`` layers, each after one real AdamW step so the
optimizer's state exists; state = ``{"model": model.state_dict(), "optim": opt.state_dict()}``:

- ``small``: 1,000 small parameters (1-16 KiB each, an ``nn.ParameterList``) and their AdamW state
  (``exp_avg``, ``exp_avg_sq`` on the device, a 0-d ``step`` on the host, as AdamW keeps it by default):
  4,000 tensors, about 19 MB.
- ``2gb``, ``8gb``: GPT-shaped models (token and position ``nn.Embedding``, pre-norm
  ``nn.TransformerEncoderLayer`` blocks: attention with in/out projections, MLP 4x, two ``nn.LayerNorm``;
  final ``nn.LayerNorm``; untied ``nn.Linear`` head), width 1024 and 2048, vocab 32768, with as many
  blocks as make about 2 GB and 8 GB of fp32 parameters plus AdamW state.

Per state, each timed operation starts with the device idle (``torch.cuda.synchronize()``); medians of
``--repeats`` runs (``--slow-repeats`` for DCP, ``torch.save`` and ``restore(device=)``):

- floor, device to host: ``copy_(non_blocking=True)`` of every tensor into page-locked host tensors allocated
  beforehand (views of one ``torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)``), then a CUDA event
  wait;
- floor, host to device: the same bytes back, ``copy_(non_blocking=True)`` from those page-locked tensors into
  the state's device tensors, then an event wait;
- tierfs (``TieredStore([MemoryTier(<shm>, keep=LatestN(2))])``, after ``--warmup`` saves so every buffer
  is pooled and page-locked): ``save(step, state, blocking=False)`` until it returns (the default stall:
  every device-to-host copy complete) and until committed (``wait_until_committed()``);
  ``save(step, state, blocking=False, overlap=opt)`` until it returns (the overlap stall), until its copies
  are done (``store.copies.wait()``) and until committed; ``restore_into(state, step)`` (in place, into the
  state's own device tensors; checked bit-exact once into zeroed tensors first) and
  ``restore(step, device=...)`` (new device tensors);
- ``torch.distributed.checkpoint.async_save(state, checkpoint_id=<shm dir>, async_stager=DefaultStager(
  StagingOptions(use_pinned_memory=True, use_shared_memory=False, use_async_staging=True,
  use_non_blocking_copy=True)), planner=DefaultSavePlanner(enable_plan_caching=True))``, one stager reused
  (its pinned buffers cached), a gloo group of one process: until it returns, until staged
  (``staging_completion``: when the loop may change the state again, its real stall) and complete
  (``upload_completion``);
- ``torch.save(state, <shm>/torch.pt)``.

The targets (docs/performance.md#gpu): default stall at most 1.1x the device-to-host floor; overlap stall at
most 5 ms + 1 µs per tensor; restore at least 0.9x the host-to-device floor's speed. Missing one is printed
as MISSED; the exit code is 1 when a measurement failed (an exception: tierfs, DCP or torch.save), else 0.

Room: each state is skipped, with a line saying why, unless the shm directory's free space, the host's free
memory and the device's free memory hold about 4x the state (the RAM tier keeps 2 steps and a spare set;
DCP's newest checkpoint and the one being written; the verify target and ``restore(device=)``'s tensors on
the device). Page-locked memory is freed between cases. ``--time-limit`` (seconds): a case that would start
after it is skipped with a note (the 8 GB state is skipped when the 2 GB one suggests it would not fit).
Results, markdown and json, go to ``--out`` (``bench_gpu-<timestamp>.md`` and ``.json``), rewritten after
each state so a run cut short keeps what it measured.

``--cpu-dry-run``: tiny states (about 2 MB and 8 MB; the small state as above) on the CPU, to check this
script end to end on a machine without CUDA: the CUDA-only measurements (page-locked floors, event waits,
DCP's pinned staging) are replaced by CPU stand-ins or skipped, each with a printed note, and the targets
are printed but not judged.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import GB, log, mem_available, nested_like, tensors  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")
TARGET_STALL = 1.1  # default stall / device-to-host floor, at most
TARGET_OVERLAP_MS, TARGET_OVERLAP_US_PER_TENSOR = 5.0, 1.0  # overlap stall, at most
TARGET_RESTORE = 0.9  # restore speed / host-to-device floor speed, at least
ROOM = 4.0  # free shm, host memory and device memory needed, in multiples of the state's bytes


# -- output ---------------------------------------------------------------------------------------------
class Out:
    """Lines for stdout, kept for the markdown file."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def __call__(self, text: str = "") -> None:
        print(text, flush=True)
        self.lines.append(text)

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


@dataclass
class Row:
    name: str
    kind: str  # "save" (against the device-to-host floor) or "restore" (against the host-to-device floor)
    times: list[float] = field(default_factory=list)
    note: str = ""

    @property
    def median(self) -> float:
        return statistics.median(self.times) if self.times else float("nan")


@dataclass
class Check:
    what: str
    value: float | None  # None: not measured (its section failed or was skipped)
    target: str
    met: bool | None  # None: not judged (a dry run, or not measured)


@dataclass
class Case:
    label: str
    title: str
    state: dict
    keep: Any  # model and optimizer
    opt: Any
    n_tensors: int
    nbytes: int
    rows: list[Row] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    seconds: float = 0.0


class Env:
    """What every measurement needs: device, repeats, deadline, scratch directory."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch

        self.dry = args.cpu_dry_run
        self.cuda = not self.dry
        self.device = torch.device("cpu") if self.dry else torch.device("cuda", torch.cuda.current_device())
        self.repeats, self.slow, self.warmup = args.repeats, args.slow_repeats, args.warmup
        self.t0 = time.monotonic()
        self.limit = args.time_limit
        self.root = tempfile.mkdtemp(dir=args.shm, prefix="tierfs-bench-gpu-")

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def left(self) -> float:
        return self.limit - self.elapsed()

    def fresh(self, name: str) -> str:
        p = os.path.join(self.root, name)
        shutil.rmtree(p, ignore_errors=True)
        os.makedirs(p, mode=0o700)
        return p

    def remove(self, name: str) -> None:
        p = os.path.join(self.root, name)
        if os.path.isdir(p):
            shutil.rmtree(p, ignore_errors=True)
        elif os.path.exists(p):
            os.unlink(p)

    def sync(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize()

    def release(self) -> None:
        """Give back freed device memory and page-locked host memory (the caching allocators keep both)."""
        gc.collect()
        if not self.cuda:
            return
        import torch

        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        for fn in (getattr(torch._C, "_accelerator_emptyHostCache", None), getattr(torch._C, "_host_emptyCache", None)):
            if fn is not None:
                try:
                    fn()
                    break
                except Exception:  # noqa: BLE001 - only an optimisation
                    pass

    def cleanup(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


# -- nested states --------------------------------------------------------------------------------------
def equal_nested(a: Any, b: Any) -> bool:
    import torch

    ta, tb = list(tensors(a)), list(tensors(b))
    return len(ta) == len(tb) and all(x.device == y.device and torch.equal(x, y) for x, y in zip(ta, tb))


# -- states ---------------------------------------------------------------------------------------------
def gpt(width: int, layers: int, vocab: int, context: int) -> Any:
    import torch
    from torch import nn

    class GPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok_emb = nn.Embedding(vocab, width)
            self.pos_emb = nn.Embedding(context, width)
            self.blocks = nn.ModuleList(
                nn.TransformerEncoderLayer(width, max(1, width // 64), dim_feedforward=4 * width, dropout=0.0,
                                           activation="gelu", batch_first=True, norm_first=True)
                for _ in range(layers))
            self.ln_f = nn.LayerNorm(width)
            self.lm_head = nn.Linear(width, vocab, bias=False)

        def forward(self, idx: Any) -> Any:
            t = idx.shape[1]
            x = self.tok_emb(idx) + self.pos_emb(torch.arange(t, device=idx.device))
            mask = nn.Transformer.generate_square_subsequent_mask(t, device=idx.device)
            for blk in self.blocks:
                x = blk(x, src_mask=mask, is_causal=True)
            return self.lm_head(self.ln_f(x))

    return GPT()


def gpt_params(width: int, layers: int, vocab: int, context: int) -> int:
    w = width
    block = (3 * w * w + 3 * w) + (w * w + w) + (4 * w * w + 4 * w) + (4 * w * w + w) + 4 * w
    return vocab * w + context * w + layers * block + 2 * w + vocab * w


def gpt_layers(target_bytes: int, width: int, vocab: int, context: int) -> int:
    """Blocks that make about ``target_bytes`` of fp32 parameters, exp_avg and exp_avg_sq."""
    per = gpt_params(width, 1, vocab, context) - gpt_params(width, 0, vocab, context)
    fixed = gpt_params(width, 0, vocab, context)
    return max(1, round((target_bytes / 12 - fixed) / per))


def one_step(model: Any, opt: Any, loss: Any) -> None:
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def gpt_case(label: str, target_bytes: int, width: int, vocab: int, context: int, env: Env) -> Case:
    import torch
    import torch.nn.functional as F

    layers = gpt_layers(target_bytes, width, vocab, context)
    torch.manual_seed(0)
    with torch.device(env.device):
        model = gpt(width, layers, vocab, context)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    idx = torch.randint(0, vocab, (2, min(context, 64) + 1), device=env.device)
    logits = model(idx[:, :-1])
    one_step(model, opt, F.cross_entropy(logits.reshape(-1, vocab), idx[:, 1:].reshape(-1)))
    del logits
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    n, b = count(state)
    title = (f"GPT, width {width}, {layers} blocks, vocab {vocab}, context {context}: "
             f"{millions(gpt_params(width, layers, vocab, context))} fp32 parameters with AdamW state")
    return Case(label, title, state, model, opt, n, b)


def millions(n: int) -> str:
    return f"{n / 1e6:.0f}M" if n >= 10**7 else f"{n / 1e6:.2f}M"


def small_case(env: Env, params: int = 1000) -> Case:
    import torch
    from torch import nn

    torch.manual_seed(0)
    sizes = [256, 512, 1024, 2048, 4096]  # fp32 elements: 1-16 KiB
    with torch.device(env.device):
        model = nn.ParameterList(nn.Parameter(torch.randn(sizes[i % len(sizes)])) for i in range(params))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    one_step(model, opt, sum(p.square().sum() for p in model))
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    n, b = count(state)
    steps = [t for t in tensors(state) if t.dim() == 0]
    where = sorted({t.device.type for t in steps})
    title = (f"{params} small parameters (1-16 KiB) with AdamW state: {n} tensors "
             f"({len(steps)} of them AdamW's 0-d steps, on {', '.join(where) or '-'})")
    return Case("small", title, state, model, opt, n, b)


def count(state: Any) -> tuple[int, int]:
    n = b = 0
    for t in tensors(state):
        n += 1
        b += t.nelement() * t.element_size()
    return n, b


# -- measurements ---------------------------------------------------------------------------------------
def timed(env: Env, fn: Callable[[], Any], after: Callable[[], Any] | None = None) -> float:
    """Seconds ``fn()`` takes, started with the device idle; ``after()`` (untimed) follows."""
    gc.collect()
    env.sync()
    t0 = time.perf_counter()
    fn()
    dt = time.perf_counter() - t0
    if after is not None:
        after()
    return dt


def floors(case: Case, env: Env) -> tuple[Row, Row]:
    """Device-to-host into page-locked tensors allocated beforehand, and back (event waits)."""
    import torch

    src = list(tensors(case.state))
    if env.cuda:
        d2h = Row("floor: copy_(non_blocking) into pinned host tensors, event wait", "save")
        h2d = Row("floor: copy_(non_blocking) from pinned host tensors, event wait", "restore")
        # one page-locked allocation, viewed as a tensor per device tensor (64-byte aligned): exactly the
        # state's bytes, where a pinned tensor each would be rounded up to a power of two by torch's
        # caching host allocator (up to 2x)
        sizes = [t.nelement() * t.element_size() if t.device.type == "cuda" else 0 for t in src]
        buf = torch.empty(sum(-(-n // 64) * 64 for n in sizes), dtype=torch.uint8, pin_memory=True)
        host, off = [], 0
        for t, n in zip(src, sizes):
            if t.device.type == "cuda":
                host.append(buf[off:off + n].view(t.dtype).view(t.shape))
                off += -(-n // 64) * 64
            else:  # AdamW's 0-d steps stay on the host: a plain copy, as any checkpoint makes
                host.append(torch.empty_like(t))
        del buf
    else:
        d2h = Row("floor: copy_ into preallocated host tensors", "save", note="CPU stand-in: no pinned memory")
        h2d = Row("floor: copy_ from preallocated host tensors", "restore", note="CPU stand-in")
        host = [torch.empty_like(t) for t in src]
    for h in host:
        h.zero_()  # pages faulted in

    def down() -> None:
        for h, t in zip(host, src):
            h.copy_(t, non_blocking=True)
        if env.cuda:
            ev = torch.cuda.Event()
            ev.record()
            ev.synchronize()

    def up() -> None:
        for h, t in zip(host, src):
            t.copy_(h, non_blocking=True)
        if env.cuda:
            ev = torch.cuda.Event()
            ev.record()
            ev.synchronize()

    with torch.no_grad():
        down()
        up()  # warm-up, and the same values back
        for _ in range(env.repeats):
            d2h.times.append(timed(env, down))
        for _ in range(env.repeats):
            h2d.times.append(timed(env, up))
    del host
    env.release()
    return d2h, h2d


def bench_tierfs(case: Case, env: Env) -> None:
    from tierfs import TieredStore
    from tierfs.policies import LatestN
    from tierfs.tiers import MemoryTier

    state, dev = case.state, env.device
    rows = {k: Row(name, kind) for k, name, kind in [
        ("stall", "tierfs save(blocking=False): returns (default stall)", "save"),
        ("committed", "tierfs save(blocking=False): committed", "save"),
        ("ostall", "tierfs save(blocking=False, overlap=opt): returns (overlap stall)", "save"),
        ("ocopied", "tierfs save(blocking=False, overlap=opt): copies done (store.copies.wait())", "save"),
        ("ocommitted", "tierfs save(blocking=False, overlap=opt): committed", "save"),
        ("rinto", "tierfs restore_into(state, step) (in place)", "restore"),
        ("rdev", f"tierfs restore(step, device={str(dev)!r}) (new tensors)", "restore"),
    ]}
    case.rows += rows.values()  # filled in as measured: a failure keeps what was measured before it
    d = env.fresh("tierfs")
    store = TieredStore([MemoryTier(d, keep=LatestN(2))])
    try:
        step = 1
        for _ in range(env.warmup):  # every buffer set of LatestN(2) (kept 2 + spare) pooled and page-locked
            store.save(step, state, blocking=False)
            store.wait_until_finished()
            step += 1
        if env.cuda:
            from tierfs.device import copies as _device

            locked = _device.pinned_bytes()
            case.notes.append(f"tierfs holds {locked / GB:.2f} GB of the RAM tier's buffers page-locked after "
                              f"{env.warmup} saves" + ("" if locked else ": NOT page-locked, so its copies ran at "
                                                       "pageable speed (see tierfs's warning in the log)"))
        for _ in range(env.repeats):
            rows["stall"].times.append(timed(env, lambda: store.save(step, state, blocking=False)))
            t0 = time.perf_counter()
            store.wait_until_committed()
            rows["committed"].times.append(rows["stall"].times[-1] + time.perf_counter() - t0)
            store.wait_until_finished()
            step += 1
        log(f"  {case.label}: tierfs default stall {rows['stall'].median * 1e3:.2f} ms, "
            f"committed {rows['committed'].median * 1e3:.1f} ms")

        store.save(step, state, blocking=False, overlap=case.opt)  # warm-up of the overlapped path
        store.wait_until_finished()
        step += 1
        for _ in range(env.repeats):
            gc.collect()
            env.sync()
            t0 = time.perf_counter()
            store.save(step, state, blocking=False, overlap=case.opt)
            t1 = time.perf_counter()
            copies = store.copies
            if copies is not None:
                copies.wait()
            t2 = time.perf_counter()
            store.wait_until_committed()
            t3 = time.perf_counter()
            store.wait_until_finished()
            rows["ostall"].times.append(t1 - t0)
            rows["ocopied"].times.append(t2 - t0)
            rows["ocommitted"].times.append(t3 - t0)
            if copies is None:
                rows["ocopied"].note = "store.copies was None"
            step += 1
        log(f"  {case.label}: tierfs overlap stall {rows['ostall'].median * 1e3:.2f} ms, "
            f"copies done {rows['ocopied'].median * 1e3:.1f} ms")
        last = step - 1

        target = nested_like(state)  # checked once, bit-exact, into zeroed tensors
        store.restore_into(target, last)
        env.sync()
        if not equal_nested(target, state):
            raise RuntimeError("restore_into: the restored tensors differ from the saved state")
        del target
        env.release()

        def restore_in_place() -> None:
            store.restore_into(state, last)
            env.sync()  # restore_into made the current stream wait for its copies: include that wait
        for _ in range(env.repeats):
            rows["rinto"].times.append(timed(env, restore_in_place))
        log(f"  {case.label}: tierfs restore_into {rows['rinto'].median * 1e3:.1f} ms")

        got: list[Any] = []

        def restore_new() -> None:
            new, _info = store.restore(last, device=dev)
            env.sync()
            got.append(new)
        for i in range(env.slow):
            rows["rdev"].times.append(timed(env, restore_new))
            back = list(tensors(got.pop()))
            if i == 0 and (len(back) != case.n_tensors or any(t.device.type != dev.type for t in back)):
                rows["rdev"].note = f"not every tensor came back on {dev}"
            del back
        env.release()
    finally:
        store.close()
        env.remove("tierfs")


def init_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)


def bench_dcp(case: Case, env: Env) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    init_group()
    pinned = env.cuda
    opts = StagingOptions(use_pinned_memory=pinned, use_shared_memory=False, use_async_staging=True,
                          use_non_blocking_copy=pinned)
    note = "" if pinned else "CPU dry run: use_pinned_memory=False, use_non_blocking_copy=False"
    name = "dcp.async_save, DefaultStager(pinned, async staging), plan caching"
    ret, staged, done = Row(f"{name}: returns", "save", note=note), Row(f"{name}: staged (its stall)", "save"), \
        Row(f"{name}: complete", "save")
    case.rows += [ret, staged, done]
    stager = DefaultStager(opts)
    dirs: list[str] = []
    try:
        for i in range(1 + env.slow):
            d = env.fresh(f"dcp-{i}")
            env.sync()
            gc.collect()
            t0 = time.perf_counter()
            res = dcp.async_save(case.state, checkpoint_id=d, async_stager=stager,
                                 planner=DefaultSavePlanner(enable_plan_caching=True))
            t1 = time.perf_counter()
            staging = getattr(res, "staging_completion", None)
            if staging is not None:
                staging.result()
            t2 = time.perf_counter()
            upload: Any = getattr(res, "upload_completion", res)
            upload.result()
            t3 = time.perf_counter()
            if i:  # the first is a warm-up (plans cached, pinned buffers made)
                ret.times.append(t1 - t0)
                staged.times.append(t2 - t0)
                done.times.append(t3 - t0)
            if staging is None:
                staged.note = "no staging_completion: staged when it returned"
            dirs.append(d)
            while len(dirs) > 1:  # the newest only (the next one is written beside it)
                env.remove(os.path.basename(dirs.pop(0)))
    finally:
        stager.close()
        for d in dirs:
            env.remove(os.path.basename(d))
        env.release()
    log(f"  {case.label}: dcp.async_save returns {ret.median * 1e3:.1f} ms, staged {staged.median * 1e3:.1f} ms, "
        f"complete {done.median * 1e3:.0f} ms")


def bench_torch_save(case: Case, env: Env) -> None:
    import torch

    row = Row("torch.save(state, <shm>/torch.pt)", "save")
    case.rows.append(row)
    path = os.path.join(env.root, "torch.pt")
    try:
        for _ in range(env.slow):
            row.times.append(timed(env, lambda: torch.save(case.state, path)))
    finally:
        env.remove("torch.pt")
    log(f"  {case.label}: torch.save {row.median * 1e3:.0f} ms")


# -- one state --------------------------------------------------------------------------------------------
def size(n: float) -> str:
    return f"{n / GB:.1f} GB" if n >= GB else f"{n / 1e6:.0f} MB"


def room(nbytes: int, env: Env, shm: str) -> str | None:
    """Why a state of ``nbytes`` does not fit (shm, host memory, device memory), or None."""
    need = ROOM * nbytes
    free_shm = shutil.disk_usage(shm).free
    if free_shm < need:
        return f"{shm} has {size(free_shm)} free, the state needs about {size(need)} there (--shm: elsewhere)"
    avail = mem_available()
    if avail and avail < need:
        return f"the host has {size(avail)} of memory available, the state needs about {size(need)}"
    if env.cuda:
        import torch

        free_dev, _ = torch.cuda.mem_get_info()
        if free_dev < need:
            return f"the device has {size(free_dev)} free, the state needs about {size(need)}"
    return None


def run_case(case: Case, env: Env) -> None:
    t0 = time.monotonic()
    log(f"{case.label}: {case.n_tensors} tensors, {case.nbytes / GB:.3f} GB")
    d2h, h2d = floors(case, env)
    if env.dry:
        case.notes.append("CPU dry run: the floors are plain copy_ loops between CPU tensors (no page-locked "
                          "memory, no CUDA events); the targets are printed, not judged")
    case.rows += [d2h, h2d]
    log(f"  {case.label}: floors: device-to-host {d2h.median * 1e3:.2f} ms, host-to-device {h2d.median * 1e3:.2f} ms")
    sections: list[tuple[str, Callable[[Case, Env], None]]] = [
        ("tierfs", bench_tierfs), ("dcp.async_save", bench_dcp), ("torch.save", bench_torch_save)]
    for what, fn in sections:
        if env.left() <= 0:
            msg = f"{what}: skipped, the time limit ({env.limit:.0f} s) is spent"
            log(f"  {case.label}: {msg}")
            case.notes.append(msg)
            continue
        try:
            fn(case, env)
        except Exception as e:  # noqa: BLE001 - reported; the other sections still run
            msg = f"{what} failed: {type(e).__name__}: {e}"
            log(f"  {case.label}: {msg}\n{traceback.format_exc()}")
            case.notes.append(msg)
            case.failures.append(msg)
        env.release()
    case.seconds = time.monotonic() - t0
    judge(case, env)


def judge(case: Case, env: Env) -> None:
    """The targets: a check whose row was not measured is listed as such (value None)."""

    def find(prefix: str) -> Row | None:
        return next((r for r in case.rows if r.name.startswith(prefix) and r.times), None)

    def check(what: str, target: str, row: Row | None, value: Callable[[Row], float],
              ok: Callable[[float], bool]) -> None:
        if row is None:
            case.checks.append(Check(what, None, target, None))
            return
        v = value(row)
        case.checks.append(Check(what, v, target, None if env.dry else ok(v)))

    d2h, h2d = case.rows[0], case.rows[1]
    check("default stall / device-to-host floor", f"<= {TARGET_STALL}",
          find("tierfs save(blocking=False): returns"), lambda r: r.median / d2h.median,
          lambda v: v <= TARGET_STALL)
    limit = TARGET_OVERLAP_MS + TARGET_OVERLAP_US_PER_TENSOR * case.n_tensors / 1e3
    check(f"overlap stall (ms), {case.n_tensors} tensors", f"<= {limit:.2f} (5 ms + 1 µs x {case.n_tensors})",
          find("tierfs save(blocking=False, overlap=opt): returns"), lambda r: r.median * 1e3,
          lambda v: v <= limit)
    for prefix, what in [("tierfs restore_into", "restore_into speed / host-to-device floor"),
                         ("tierfs restore(step, device", "restore(device=) speed / host-to-device floor")]:
        check(what, f">= {TARGET_RESTORE}", find(prefix), lambda r: h2d.median / r.median,
              lambda v: v >= TARGET_RESTORE)


def table(case: Case) -> str:
    d2h, h2d = case.rows[0], case.rows[1]
    lines = [f"| {'operation':<92} | median ms | GB/s | vs floor | repeats (ms) |", "|---|---:|---:|---:|---|"]
    for r in case.rows:
        if not r.times:
            continue
        if r.kind == "save":
            ratio = f"{r.median / d2h.median:.2f}x time"
        else:
            ratio = f"{h2d.median / r.median:.2f}x speed"
        name = r.name + (f" [{r.note}]" if r.note else "")
        lines.append(f"| {name:<92} | {r.median * 1e3:9.2f} | {case.nbytes / r.median / GB:6.2f} | {ratio:>8} | "
                     f"{' '.join(f'{t * 1e3:.2f}' for t in r.times)} |")
    lines += ["", "Save rows: time ÷ the device-to-host floor's time; restore rows: speed ÷ the host-to-device "
                  "floor's speed."]
    return "\n".join(lines)


def checks_table(cases: list[Case]) -> str:
    lines = ["| state | check | value | target | verdict |", "|---|---|---:|---|---|"]
    for c in cases:
        for k in c.checks:
            if k.value is None:
                value, verdict = "-", "NOT MEASURED"
            else:
                value = f"{k.value:.3f}"
                verdict = "not judged (dry run)" if k.met is None else ("MET" if k.met else "MISSED")
            lines.append(f"| {c.label} | {k.what} | {value} | {k.target} | {verdict} |")
    return "\n".join(lines)


# -- the run ----------------------------------------------------------------------------------------------
def meta(args: argparse.Namespace, env: Env) -> dict:
    import torch

    m: dict[str, Any] = {
        "command": " ".join(shlex.quote(a) for a in [os.path.relpath(sys.executable)
                                                     if not os.path.relpath(sys.executable).startswith("..")
                                                     else sys.executable, *sys.argv]),
        "python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
        "cpus": os.cpu_count(), "host_memory_gb": round(mem_total() / GB, 1),
        "shm": args.shm, "shm_free_gb": round(shutil.disk_usage(args.shm).free / GB, 1),
        "dry_run": env.dry, "repeats": env.repeats, "slow_repeats": env.slow, "warmup": env.warmup,
        "tierfs": tierfs_note(),
    }
    if env.cuda:
        p = torch.cuda.get_device_properties(env.device)
        m["device"] = f"{p.name}, {p.total_memory / (1 << 30):.0f} GiB"
        try:
            m["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                         capture_output=True, text=True, timeout=20).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            m["driver"] = "unknown (nvidia-smi failed)"
        try:
            import resource

            soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
            m["memlock"] = "unlimited" if soft == resource.RLIM_INFINITY else f"{soft} bytes"
        except (ImportError, OSError):
            pass
    else:
        m["device"] = "none (CPU dry run)"
    return m


def mem_total() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def tierfs_note() -> str:
    import tierfs

    where = os.path.dirname(os.path.abspath(tierfs.__file__))
    if os.path.dirname(where) != REPO:
        return f"imported from {where} (not this checkout)"
    rev = os.environ.get("GPU_CHECK_COMMIT", "")
    try:
        rev = rev or subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True,
                                    text=True, check=True, timeout=20).stdout.strip()
        dirty = subprocess.run(["git", "-C", REPO, "status", "--porcelain", "--", "tierfs"], capture_output=True,
                               text=True, check=True, timeout=20).stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        return f"this checkout, commit {rev or 'unknown (no git)'}"
    return f"this checkout, commit {rev}" + (f", {len(dirty)} uncommitted file(s) under tierfs/" if dirty else "")


def write(out_dir: str, stamp: str, out: Out, m: dict, cases: list[Case], skipped: list[str]) -> str:
    os.makedirs(out_dir, exist_ok=True)
    base = os.path.join(out_dir, f"bench_gpu-{stamp}")
    with open(base + ".md", "w") as f:
        f.write(out.text())
    doc = {"meta": m, "skipped": skipped, "states": [{
        "label": c.label, "title": c.title, "tensors": c.n_tensors, "bytes": c.nbytes, "seconds": round(c.seconds, 1),
        "rows": [{"name": r.name, "kind": r.kind, "median_s": r.median if r.times else None, "times_s": r.times,
                  "note": r.note} for r in c.rows],
        "checks": [{"what": k.what, "value": k.value, "target": k.target, "met": k.met} for k in c.checks],
        "notes": c.notes, "failures": c.failures} for c in cases]}
    with open(base + ".json", "w") as f:
        json.dump(doc, f, indent=1)
    return base


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=RESULTS, help="directory for bench_gpu-<timestamp>.md and .json")
    ap.add_argument("--states", default="small,2gb,8gb", help="comma-separated: small, 2gb, 8gb")
    ap.add_argument("--repeats", type=int, default=5, help="timed runs of the floors and tierfs's saves/restores")
    ap.add_argument("--slow-repeats", type=int, default=3,
                    help="timed runs of dcp.async_save, torch.save and restore(device=)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed tierfs saves first (LatestN(2): 3 buffer sets)")
    ap.add_argument("--shm", default="/dev/shm", help="tmpfs directory for the RAM tier, DCP and torch.save")
    ap.add_argument("--time-limit", type=float, default=280, help="seconds; later cases are skipped past it")
    ap.add_argument("--cpu-dry-run", action="store_true", help="tiny CPU states: checks this script without CUDA")
    args = ap.parse_args()
    states = [s.strip() for s in args.states.split(",") if s.strip()]
    bad = [s for s in states if s not in ("small", "2gb", "8gb")]
    if bad:
        ap.error(f"unknown state(s) {bad}; choose from small, 2gb, 8gb")
    if args.repeats < 1 or args.slow_repeats < 1:
        ap.error("--repeats and --slow-repeats must be at least 1")

    import torch

    if not args.cpu_dry_run and not torch.cuda.is_available():
        print("bench_gpu: no CUDA device (torch.cuda.is_available() is False); --cpu-dry-run checks the script "
              "on a CPU", file=sys.stderr)
        return 2
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", message=".*enable_nested_tensor.*")
    env = Env(args)
    out = Out()
    stamp = time.strftime("%Y%m%d-%H%M%S") + ("-dry" if env.dry else "")
    m = meta(args, env)
    out(f"# GPU state: tierfs against the pinned-copy floors ({time.strftime('%Y-%m-%d %H:%M:%S')})")
    out()
    for k, v in m.items():
        out(f"- {k}: {v}")
    if env.dry:
        out("- CPU DRY RUN: tiny states on the CPU; CUDA-only measurements are replaced by CPU stand-ins or "
            "skipped (see the notes); these figures say nothing about a GPU")
    out()
    scale = 1e-3 if env.dry else 1.0  # the dry run's "2gb" is 2 MB
    width = {"2gb": 1024, "8gb": 2048}
    vocab, context = (512, 128) if env.dry else (32768, 1024)
    if env.dry:
        width = {"2gb": 64, "8gb": 128}
    cases: list[Case] = []
    skipped: list[str] = []
    t_2gb: float | None = None
    try:
        for label in states:
            target = {"small": 0, "2gb": 2 * GB, "8gb": 8 * GB}[label] * scale
            if env.left() <= 0:
                skipped.append(f"{label}: the time limit ({env.limit:.0f} s) is spent")
                log(f"skipping {skipped[-1]}")
                continue
            if label == "8gb" and t_2gb is not None and not env.dry and env.elapsed() + 4.5 * t_2gb > env.limit:
                skipped.append(f"8gb: the 2 GB state took {t_2gb:.0f} s; about {4.5 * t_2gb:.0f} s more would "
                               f"pass the time limit ({env.limit:.0f} s, {env.elapsed():.0f} s spent)")
                log(f"skipping {skipped[-1]}")
                continue
            why = room(int(target) if target else 20_000_000, env, args.shm)
            if why is not None:
                skipped.append(f"{label}: {why}")
                log(f"skipping {skipped[-1]}")
                continue
            t0 = time.monotonic()
            log(f"building the {label} state on {env.device}")
            case = small_case(env) if label == "small" else gpt_case(
                label, int(target), width[label], vocab, context, env)
            try:
                run_case(case, env)
            finally:
                case.state, case.keep, case.opt = {}, None, None
                env.release()
            cases.append(case)
            if label == "2gb":
                t_2gb = time.monotonic() - t0
            out(f"## {case.label}: {case.title}")
            out()
            out(f"- {case.n_tensors} tensors, {case.nbytes / GB:.3f} GB; measured in {case.seconds:.0f} s")
            for n in case.notes:
                out(f"- {n}")
            out()
            out(table(case))
            out()
            write(args.out, stamp, so_far(out, cases, skipped), m, cases, skipped)
    finally:
        env.cleanup()
        try:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass
    out("## Targets")
    out()
    out(checks_table(cases))
    out()
    for s in skipped:
        out(f"- skipped {s}")
    out(f"- whole run: {env.elapsed():.0f} s")
    failed = [f"{c.label}: {f}" for c in cases for f in c.failures]
    for f in failed:
        out(f"- FAILED {f}")
    base = write(args.out, stamp, out, m, cases, skipped)
    log(f"results: {base}.md and {base}.json")
    return 1 if failed else 0


def so_far(out: Out, cases: list[Case], skipped: list[str]) -> Out:
    """The output so far plus the targets of the states done: what a run cut short leaves behind."""
    c = Out.__new__(Out)
    c.lines = out.lines + ["## Targets (so far)", "", checks_table(cases), ""] + [f"- skipped {s}" for s in skipped]
    return c


if __name__ == "__main__":
    sys.exit(main())
