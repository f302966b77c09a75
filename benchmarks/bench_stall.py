"""Save stall of real-model-shaped states: how long a save holds the training thread, against the floor.

    .venv/bin/python benchmarks/bench_stall.py [--states gpt,small,mixed] [--repeats 5] [--warmup 3]
        [--layers 24] [--width 768] [--vocab 8192] [--context 1024] [--wait-quiet 120] [--quick]

States (``--states``, comma-separated):
- ``gpt``: a GPT-style ``torch.nn`` transformer written here (token and position embeddings; per block
  LayerNorm, qkv Linear, out-proj Linear, LayerNorm, MLP Linear 4x, Linear back, all with bias; final
  LayerNorm; lm head without bias) and its ``torch.optim.AdamW`` state after one real optimizer step
  (``exp_avg``, ``exp_avg_sq`` and 0-d ``step`` tensors). State = ``{"model": model.state_dict(),
  "optim": optimizer.state_dict()}``: the optimizer's state is keyed by int and its ``param_groups`` is a
  list of dicts. At the defaults (24 layers, width 768, vocab 8192, context 1024): 1,172 tensors, 2.2 GB.
- ``small``: 4,000 fp32 tensors of 4 KiB (flat dict, 16 MB).
- ``mixed``: 180 fp32 tensors, 40 x 16 MiB, 40 x 4 MiB, 100 x 64 KiB (0.85 GB).

The tierfs rows that store the state as it is (``TieredStore``, ``CheckpointManager(use_dcp=False)``)
try the raw state first (int keys; older tierfs versions took string keys only); if that raises,
they get the same tensors with the optimizer state keyed by parameter FQN
(``torch.distributed.checkpoint.state_dict.get_state_dict(model, optim)``; a plain ``str(key)``
conversion if that fails). Which one was used, and what the raw state raised, is printed per row.

Saves, per state, each method in turn (steady state: ``--warmup`` saves first, so buffers are pooled and
DCP's plans cached; then ``--repeats`` timed saves, each after the previous one fully finished):
- floor: a ``copy_`` loop (walking the nested state, tensors only) into preallocated, already-faulted
  tensors of the same shapes; one floor sample is taken right before every timed save or restore (so the
  floor sees the same minutes of this shared, noisy machine as the methods), and every row's ratio and
  per-tensor overhead are against the median of all of them; the median of the samples next to each row
  is shown beside it;
- ``TieredStore([MemoryTier(shm, keep=LatestN(2))]).save(step, state, blocking=False)``: returns (the
  stall) and ``wait_until_committed()`` returns;
- ``CheckpointManager([MemoryTier(shm, keep=LatestN(2))]).save(step, state)``: default (torch state goes
  through DCP with tierfs's TieredWriter) and ``use_dcp=False``; returns, and committed
  (``mgr.store.wait_until_committed()``);
- ``dcp.async_save(state, storage_writer=FileSystemWriter(shm/step), planner=DefaultSavePlanner(
  enable_plan_caching=True))`` (thread executor, gloo group of one process): with the writer as the stager
  (DCP's default when no ``async_stager`` is given: a fresh copy per save, in the call); with a reused
  ``DefaultStager`` staging synchronously (its staging buffers are cached across saves); and with a reused
  ``DefaultStager`` staging in its thread (``async_save`` returns an ``AsyncSaveResponse``: the real stall
  is until ``staging_completion`` is done, when training may touch its tensors again). Rows: returns,
  staged (async staging only), complete (``upload_completion`` / the future's result). The two newest
  checkpoint directories are kept, as LatestN(2) does.

Restores in place, per state (one untimed restore into zeroed tensors first, checked bit-exact, then
``--repeats`` timed): floor ``copy_`` loop; ``TieredStore.restore_into``; ``CheckpointManager.restore``
(DCP path, and ``use_dcp=False``); ``dcp.load(state, storage_reader=FileSystemReader(dir))``.

Columns: median seconds, its ratio to the floor's median, the overhead per tensor in microseconds
((median - floor median) / tensors), the median of the floor samples taken next to the row, how many CPUs
other processes kept busy while the row was timed (this 2-core machine is shared: with another process
on a CPU, each ``copy_`` big enough for torch's two intra-op threads waits for a time slice, which can
make the floor 5-100x slower), and every repeat. Before each timed section the benchmark waits up to
``--wait-quiet`` seconds for other processes to use under 0.25 CPUs. Markdown tables go to stdout,
progress to stderr; the whole output (with the machine and the command line) is also written to
``benchmarks/results/bench_stall-<timestamp>.md`` (``-quick`` appended for ``--quick``). Scratch directories
under /dev/shm are removed at the end, also on failure.
"""

from __future__ import annotations

import argparse
import copy
import gc
import os
import shlex
import statistics
import sys
import time
import traceback
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import GB, GiB, MiB, Scratch, log, machine_note, mem_available, nested_like, prefault, tensors  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


# -- output ---------------------------------------------------------------------------------------------
class Out:
    """Lines for stdout, kept to be written to the results file as well."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def __call__(self, text: str = "") -> None:
        print(text, flush=True)
        self.lines.append(text)

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


def cpu_use() -> tuple[float, float, float]:
    """``(CPU seconds the whole machine was busy, CPU seconds of this process, wall clock)``."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:9]]
    t = os.times()
    return (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK"), t.user + t.system, time.monotonic()


def others_cpus(since: tuple[float, float, float]) -> float:
    """CPUs (on average) that other processes kept busy since ``since`` (a :func:`cpu_use`)."""
    now = cpu_use()
    wall = now[2] - since[2]
    return max(0.0, (now[0] - since[0]) - (now[1] - since[1])) / wall if wall > 0 else float("nan")


def wait_quiet(max_s: float, below: float = 0.25, window: float = 2.0) -> tuple[float, float]:
    """Wait (up to ``max_s``) until other processes keep fewer than ``below`` CPUs busy over ``window``
    seconds (this machine is shared). Returns ``(seconds waited, CPUs the others used in the last window)``."""
    t0 = time.monotonic()
    while True:
        since = cpu_use()
        time.sleep(window)
        busy = others_cpus(since)
        waited = time.monotonic() - t0
        if busy < below or waited >= max_s:
            return waited, busy
        log(f"other processes keep {busy:.2f} CPUs busy; waiting for a quiet machine "
            f"({waited:.0f} of {max_s:.0f} s)")


# -- nested states --------------------------------------------------------------------------------------
def is_tensor(x: Any) -> bool:
    import torch

    return isinstance(x, torch.Tensor)


def copy_nested(dst: Any, src: Any) -> None:
    """The floor: walk ``dst`` and ``src`` together, ``dst.copy_(src)`` for every tensor."""
    if isinstance(dst, dict):
        for k, v in dst.items():
            copy_nested(v, src[k])
    elif isinstance(dst, (list, tuple)):
        for d, s in zip(dst, src):
            copy_nested(d, s)
    elif is_tensor(dst):
        dst.copy_(src)


def zero_nested(state: Any) -> None:
    for t in tensors(state):
        t.zero_()


def equal_nested(a: Any, b: Any) -> bool:
    import torch

    ta, tb = list(tensors(a)), list(tensors(b))
    return len(ta) == len(tb) and all(torch.equal(x, y) for x, y in zip(ta, tb))


def str_keys(state: Any) -> Any:
    """The same leaves, every dict key turned into a string."""
    if isinstance(state, dict):
        return {str(k): str_keys(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(str_keys(v) for v in state)
    return state


def _tkey(t: Any) -> tuple:
    return (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype)


def remap(structure: Any, src: Any, dst: Any) -> Any:
    """``structure``'s layout, each of its tensors replaced by the tensor of ``dst`` that sits where the
    same tensor (same memory and shape) sits in ``src`` (two views of one state's tensors, one target)."""
    lookup = {_tkey(s): d for s, d in zip(tensors(src), tensors(dst))}

    def walk(x: Any) -> Any:
        if isinstance(x, dict):
            return {k: walk(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return type(x)(walk(v) for v in x)
        if is_tensor(x):
            return lookup[_tkey(x)]
        return copy.deepcopy(x)

    return walk(structure)


def count_bytes(state: Any) -> tuple[int, int]:
    n = b = 0
    for t in tensors(state):
        n += 1
        b += t.nelement() * t.element_size()
    return n, b


# -- states ---------------------------------------------------------------------------------------------
def gpt_model(layers: int, width: int, vocab: int, context: int):
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.heads = max(1, width // 64)
            self.ln1 = nn.LayerNorm(width)
            self.qkv = nn.Linear(width, 3 * width, bias=True)
            self.proj = nn.Linear(width, width, bias=True)
            self.ln2 = nn.LayerNorm(width)
            self.fc = nn.Linear(width, 4 * width, bias=True)
            self.fc_out = nn.Linear(4 * width, width, bias=True)

        def forward(self, x):
            b, t, c = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
            q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
            x = x + self.proj(y)
            return x + self.fc_out(F.gelu(self.fc(self.ln2(x))))

    class GPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok_emb = nn.Embedding(vocab, width)
            self.pos_emb = nn.Embedding(context, width)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.ln_f = nn.LayerNorm(width)
            self.lm_head = nn.Linear(width, vocab, bias=False)

        def forward(self, idx):
            pos = torch.arange(idx.shape[1])
            x = self.tok_emb(idx) + self.pos_emb(pos)
            for blk in self.blocks:
                x = blk(x)
            return self.lm_head(self.ln_f(x))

    return GPT()


def gpt_bytes(layers: int, width: int, vocab: int, context: int) -> int:
    """Bytes of the gpt state (fp32 parameters, exp_avg and exp_avg_sq, a 0-d step per parameter)."""
    w = width
    per_block = 4 * w + (3 * w * w + 3 * w) + (w * w + w) + (4 * w * w + 4 * w) + (4 * w * w + w)
    params = vocab * w + context * w + layers * per_block + 2 * w + vocab * w
    n_params = 2 + layers * 12 + 3
    return 4 * (3 * params + n_params)


def gpt_state(layers: int, width: int, vocab: int, context: int) -> tuple[dict, dict, str, Any]:
    """``(raw state, string-keyed state with the same tensors, how the keys were converted, keep-alive)``
    after one AdamW step on random tokens."""
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    model = gpt_model(layers, width, vocab, context)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    t = min(context, 64)
    idx = torch.randint(0, vocab, (2, t + 1))
    logits = model(idx[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, vocab), idx[:, 1:].reshape(-1))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    raw = {"model": model.state_dict(), "optim": opt.state_dict()}
    how = "get_state_dict(model, optim) (optimizer state keyed by parameter FQN)"
    try:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(model, opt)
        keyed = {"model": msd, "optim": osd}
        same_memory = {_tkey(x) for x in tensors(raw)} == {_tkey(x) for x in tensors(keyed)}
        if not same_memory or count_bytes(keyed) != count_bytes(raw) or not _all_str_keys(keyed):
            raise ValueError("get_state_dict did not give the same tensors under string keys")
    except Exception as e:  # noqa: BLE001 - fall back to a plain conversion, and say so
        log(f"get_state_dict: {type(e).__name__}: {e}; using str(key)")
        keyed = str_keys(raw)
        how = f"str(key) conversion (get_state_dict failed: {type(e).__name__}: {e})"
    return raw, keyed, how, (model, opt)


def _all_str_keys(state: Any) -> bool:
    if isinstance(state, dict):
        return all(isinstance(k, str) and _all_str_keys(v) for k, v in state.items())
    if isinstance(state, (list, tuple)):
        return all(_all_str_keys(v) for v in state)
    return True


def flat_state(sizes: list[tuple[int, int]], seed: int = 0) -> dict:
    """``[(count, bytes per tensor), ...]`` fp32 tensors in one flat dict, filled from a fixed seed."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out, i = {}, 0
    for count, nbytes in sizes:
        for _ in range(count):
            out[f"t{i:05d}"] = torch.empty(nbytes // 4, dtype=torch.float32).normal_(generator=g)
            i += 1
    return out


# -- measurements ---------------------------------------------------------------------------------------
@dataclass
class Row:
    name: str
    times: list[float] = field(default_factory=list)
    floor: list[float] = field(default_factory=list)  # floor samples taken next to these times
    note: str = ""
    others: float = float("nan")  # CPUs other processes kept busy while these times were taken

    @property
    def median(self) -> float:
        return statistics.median(self.times) if self.times else float("nan")


@dataclass
class Ctx:
    """One state under test and what every method needs."""

    label: str
    raw: Any  # the state as the model and optimizer give it (int keys in the optimizer state)
    keyed: Any  # the same tensors under string keys (TieredStore needs them)
    dst_raw: Any  # preallocated target, raw layout (the floor's destination, restores go here)
    dst_keyed: Any  # the same target tensors, string-keyed layout
    scratch: Scratch
    repeats: int
    warmup: int
    n_tensors: int
    nbytes: int
    wait_quiet: float = 0.0
    notes: list[str] = field(default_factory=list)
    min_free: float = float("inf")  # lowest MemAvailable seen at the checkpoints (bytes)
    floor_save: Row = field(default_factory=lambda: Row("floor: copy_ loop into preallocated tensors"))
    floor_restore: Row = field(default_factory=lambda: Row("floor: copy_ loop from one state into another"))

    def floor_sample(self, which: Row) -> float:
        gc.collect()
        t0 = time.perf_counter()
        copy_nested(self.dst_raw, self.raw)
        dt = time.perf_counter() - t0
        which.times.append(dt)
        return dt

    def quiet(self, what: str) -> None:
        """Before a timed section: wait (up to ``wait_quiet`` s) for other processes to leave the CPUs."""
        if self.wait_quiet > 0:
            waited, busy = wait_quiet(self.wait_quiet)
            if waited > 4:
                msg = f"{what}: waited {waited:.0f} s for other processes to quieten (then {busy:.2f} CPUs)"
                log(msg)
                self.notes.append(msg)

    def memory(self) -> None:
        self.min_free = min(self.min_free, mem_available())


def settle() -> None:
    gc.collect()


def _raw_or_keyed(ctx: Ctx, what: str, attempt: Callable[[Any], Any]) -> tuple[Any, Any, str]:
    """Try ``attempt(raw state)``; when it raises, note it and go on with the string-keyed state.
    Returns ``(state, restore target, note)``."""
    if ctx.raw is ctx.keyed:
        return ctx.raw, ctx.dst_raw, ""
    try:
        attempt(ctx.raw)
        return ctx.raw, ctx.dst_raw, "raw state"
    except Exception as e:  # noqa: BLE001 - reported in the output
        msg = f"{what} with the raw state (int keys) raised {type(e).__name__}: {e}"
        log(msg)
        ctx.notes.append(msg + " -> used the string-keyed state")
        return ctx.keyed, ctx.dst_keyed, "string keys"


def bench_tierfs(ctx: Ctx, kind: str) -> tuple[list[Row], list[Row]]:
    """``kind``: "store" (TieredStore.save blocking=False), "mgr" (CheckpointManager default), "mgr-nodcp"."""
    from tierfs import CheckpointManager, TieredStore
    from tierfs.policies import LatestN
    from tierfs.tiers import MemoryTier

    d = ctx.scratch.fresh(f"ram-{kind}")
    tier = MemoryTier(d, keep=LatestN(2))
    if kind == "store":
        obj = TieredStore([tier])
        store = obj
        label = "TieredStore.save(blocking=False)"
        rlabel = "TieredStore.restore_into"
        save = lambda step, state: store.save(step, state, blocking=False)  # noqa: E731
        restore = lambda target, step: store.restore_into(target, step)  # noqa: E731
    else:
        obj = CheckpointManager([tier], use_dcp=None if kind == "mgr" else False)
        store = obj.store
        label = "CheckpointManager.save" + (" (DCP, default)" if kind == "mgr" else " (use_dcp=False)")
        rlabel = "CheckpointManager.restore" + (" (DCP, default)" if kind == "mgr" else " (use_dcp=False)")
        save = lambda step, state: obj.save(step, state)  # noqa: E731
        restore = lambda target, step: obj.restore(target, step)  # noqa: E731
    try:
        step = 1
        if kind == "mgr":
            state, target, how = ctx.raw, ctx.dst_raw, ("raw state" if ctx.raw is not ctx.keyed else "")
        else:
            state, target, how = _raw_or_keyed(ctx, label, lambda s: save(0, s))
        stall, committed = Row(f"{label}: returns (stall)", note=how), Row(f"{label}: committed", note=how)
        for _ in range(ctx.warmup):
            save(step, state)
            store.wait_until_finished()
            step += 1
        ctx.memory()
        ctx.quiet(label)
        since = cpu_use()
        for _ in range(ctx.repeats):
            f = ctx.floor_sample(ctx.floor_save)
            settle()
            t0 = time.perf_counter()
            ok = save(step, state)
            t1 = time.perf_counter()
            store.wait_until_committed()
            t2 = time.perf_counter()
            store.wait_until_finished()
            if ok is False:
                raise RuntimeError(f"{label} did not save step {step}")
            stall.times.append(t1 - t0)
            committed.times.append(t2 - t0)
            stall.floor.append(f)
            committed.floor.append(f)
            step += 1
        stall.others = committed.others = others_cpus(since)
        ctx.memory()
        last = step - 1
        log(f"  {label}: stall {stall.median:.4f} s, committed {committed.median:.4f} s "
            f"(floor {statistics.median(stall.floor):.4f} s)")

        rrow = Row(rlabel, note=how)
        zero_nested(target)
        restore(target, last)  # warm-up, checked
        if not equal_nested(target, state):
            raise RuntimeError(f"{rlabel}: restored tensors differ from the saved state")
        ctx.quiet(rlabel)
        since = cpu_use()
        for _ in range(ctx.repeats):
            f = ctx.floor_sample(ctx.floor_restore)
            settle()
            t0 = time.perf_counter()
            restore(target, last)
            rrow.times.append(time.perf_counter() - t0)
            rrow.floor.append(f)
        rrow.others = others_cpus(since)
        log(f"  {rlabel}: {rrow.median:.4f} s")
        return [stall, committed], [rrow]
    finally:
        obj.close()
        ctx.scratch.remove(f"ram-{kind}")
        settle()


def bench_dcp(ctx: Ctx) -> tuple[list[Row], list[Row]]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    rows: list[Row] = []
    configs: list[tuple[str, Callable[[], Any] | None]] = [
        ("FileSystemWriter stages (default)", None),
        ("DefaultStager, sync staging", lambda: DefaultStager(StagingOptions(
            use_pinned_memory=False, use_shared_memory=False, use_async_staging=False, use_non_blocking_copy=False))),
        ("DefaultStager, async staging", lambda: DefaultStager(StagingOptions(
            use_pinned_memory=False, use_shared_memory=False, use_async_staging=True, use_non_blocking_copy=False))),
    ]
    last_dir = None
    for ci, (label, make_stager) in enumerate(configs):
        stager = make_stager() if make_stager else None
        name = f"dcp.async_save, {label}"
        ret, staged, done = Row(f"{name}: returns"), Row(f"{name}: staged"), Row(f"{name}: complete")
        dirs: list[str] = []
        try:
            for i in range(ctx.warmup + ctx.repeats):
                timed = i >= ctx.warmup
                if i == ctx.warmup:
                    ctx.memory()
                    ctx.quiet(name)
                    since = cpu_use()
                f = ctx.floor_sample(ctx.floor_save) if timed else 0.0
                d = ctx.scratch.fresh(f"dcp-{ci}-{i}")
                kw = {"async_stager": stager} if stager is not None else {}
                settle()
                t0 = time.perf_counter()
                res = dcp.async_save(ctx.raw, storage_writer=FileSystemWriter(d),
                                     planner=DefaultSavePlanner(enable_plan_caching=True), **kw)
                t1 = time.perf_counter()
                staging = getattr(res, "staging_completion", None)
                if staging is not None:
                    staging.result()
                t2 = time.perf_counter()
                getattr(res, "upload_completion", res).result()
                t3 = time.perf_counter()
                if timed:
                    ret.times.append(t1 - t0)
                    done.times.append(t3 - t0)
                    ret.floor.append(f)
                    done.floor.append(f)
                    if staging is not None:
                        staged.times.append(t2 - t0)
                        staged.floor.append(f)
                dirs.append(d)
                while len(dirs) > 2:  # keep the newest two, as LatestN(2)
                    ctx.scratch.remove(os.path.basename(dirs.pop(0)))
            ret.others = staged.others = done.others = others_cpus(since)
            ctx.memory()
        finally:
            if stager is not None:
                stager.close()
        rows += [ret] + ([staged] if staged.times else []) + [done]
        log(f"  {name}: returns {ret.median:.4f} s"
            + (f", staged {staged.median:.4f} s" if staged.times else "") + f", complete {done.median:.4f} s")
        if ci < len(configs) - 1:
            for d in dirs:
                ctx.scratch.remove(os.path.basename(d))
        else:
            last_dir = dirs[-1]
            for d in dirs[:-1]:
                ctx.scratch.remove(os.path.basename(d))
        settle()

    rrow = Row("dcp.load, FileSystemReader")
    assert last_dir is not None
    zero_nested(ctx.dst_raw)
    dcp.load(ctx.dst_raw, storage_reader=FileSystemReader(last_dir))
    if not equal_nested(ctx.dst_raw, ctx.raw):
        raise RuntimeError("dcp.load: loaded tensors differ from the saved state")
    ctx.quiet(rrow.name)
    since = cpu_use()
    for _ in range(ctx.repeats):
        f = ctx.floor_sample(ctx.floor_restore)
        settle()
        t0 = time.perf_counter()
        dcp.load(ctx.dst_raw, storage_reader=FileSystemReader(last_dir))
        rrow.times.append(time.perf_counter() - t0)
        rrow.floor.append(f)
    rrow.others = others_cpus(since)
    log(f"  dcp.load: {rrow.median:.4f} s")
    ctx.scratch.remove(os.path.basename(last_dir))
    settle()
    return rows, [rrow]


# -- tables -------------------------------------------------------------------------------------------
def table(title: str, floor: Row, rows: list[Row], n_tensors: int) -> str:
    """Ratio and overhead per tensor against the median of every floor sample of the state (robust to a
    burst of contention in one method's minute); the floor samples taken next to each row, and how many
    CPUs other processes kept busy meanwhile, are shown beside it."""
    head = (f"| {'operation':<70} | median s | x floor | µs/tensor over floor | floor next to it (s) | "
            "others' CPUs | repeats (s) |")
    lines = [f"### {title}", "", head, "|---|---:|---:|---:|---:|---:|---|"]
    fmed = floor.median
    lines.append(f"| {floor.name + ' (all samples)':<70} | {fmed:8.4f} | {1:7.2f} | {0:20.1f} | {'-':>20} | "
                 f"{'-':>12} | {' '.join(f'{t:.4f}' for t in floor.times)} |")
    for r in rows:
        near = f"{statistics.median(r.floor):.4f}" if r.floor else "-"
        name = r.name + (f" [{r.note}]" if r.note else "")
        over = (r.median - fmed) / n_tensors * 1e6
        lines.append(f"| {name:<70} | {r.median:8.4f} | {r.median / fmed:7.2f} | {over:20.1f} | {near:>20} | "
                     f"{r.others:12.2f} | {' '.join(f'{t:.4f}' for t in r.times)} |")
    return "\n".join(lines) + "\n"


def run_state(ctx: Ctx, out: Out) -> None:
    since = cpu_use()
    save_rows: list[Row] = []
    restore_rows: list[Row] = []
    for kind in ("store", "mgr", "mgr-nodcp"):
        log(f"{ctx.label}: tierfs {kind} (free memory {mem_available() / GB:.1f} GB)")
        s, r = bench_tierfs(ctx, kind)
        save_rows += s
        restore_rows += r
    log(f"{ctx.label}: DCP async_save (free memory {mem_available() / GB:.1f} GB)")
    s, r = bench_dcp(ctx)
    save_rows += s
    restore_rows += r
    out(table(f"{ctx.label}: save stall ({ctx.n_tensors} tensors, {ctx.nbytes / GB:.3f} GB)",
              ctx.floor_save, save_rows, ctx.n_tensors))
    out(table(f"{ctx.label}: restore in place ({ctx.n_tensors} tensors, {ctx.nbytes / GB:.3f} GB)",
              ctx.floor_restore, restore_rows, ctx.n_tensors))
    busy = others_cpus(since)
    ctx.notes.append(f"other processes kept {busy:.2f} of {os.cpu_count()} CPUs busy on average while this state "
                     "was measured (per row: \"others' CPUs\"; above ~0.2, a copy_ of a tensor big enough for "
                     "torch's intra-op threads waits for a CPU, which slows the floor and every method)")
    ctx.notes.append(f"lowest free memory (MemAvailable) seen with a method's buffers full: "
                     f"{ctx.min_free / GB:.1f} GB; state {ctx.nbytes / GB:.2f} GB")
    for n in ctx.notes:
        out(f"- {n}")
    out()


def tierfs_note() -> str:
    """Where tierfs was imported from and, for this checkout, its commit and uncommitted files under tierfs/
    (the tree may change while this runs)."""
    import subprocess

    import tierfs

    where = os.path.dirname(os.path.abspath(tierfs.__file__))
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if os.path.dirname(where) != repo:
        return f"imported from {where} (not this checkout)"
    try:
        rev = subprocess.run(["git", "-C", repo, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", repo, "status", "--porcelain", "--", "tierfs"], capture_output=True,
                               text=True, check=True).stdout.splitlines()
    except (OSError, subprocess.CalledProcessError) as e:
        return f"imported from {where} (git: {e})"
    return f"this checkout, commit {rev}" + (f", {len(dirty)} uncommitted file(s) under tierfs/" if dirty else "")


def init_group() -> None:
    import socket

    import torch.distributed as dist

    if dist.is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--states", default="gpt,small,mixed", help="comma-separated: gpt, small, mixed")
    ap.add_argument("--repeats", type=int, default=5, help="timed saves/restores per method")
    ap.add_argument("--warmup", type=int, default=3, help="untimed saves per method before the timed ones")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--quick", action="store_true",
                    help="a smoke run: gpt 2 layers width 128 vocab 1024 context 128, small 500 tensors, "
                         "mixed 1/16 the size, 2 repeats, 1 warm-up")
    ap.add_argument("--prefault-gib", type=float, default=-1,
                    help="touch and free this much fresh memory first so the VM backs it (default: about 6x the "
                         "largest state, capped by free memory; 0 = off); see _common.prefault")
    ap.add_argument("--wait-quiet", type=float, default=120,
                    help="before each timed section (a method's saves, its restores), wait up to this many "
                         "seconds for other processes to use under 0.25 CPUs (0: don't); what they used is "
                         "reported per row either way")
    ap.add_argument("--note", default="", help="a line of text for the results (e.g. which tierfs this is)")
    ap.add_argument("--out-dir", default=RESULTS, help="where the results file goes")
    args = ap.parse_args()
    states = [s.strip() for s in args.states.split(",") if s.strip()]
    bad = [s for s in states if s not in ("gpt", "small", "mixed")]
    if bad:
        ap.error(f"unknown state(s) {bad}; choose from gpt, small, mixed")
    small_n, mixed_div = 4000, 1
    if args.quick:
        args.layers, args.width, args.vocab, args.context = 2, 128, 1024, 128
        args.repeats, args.warmup = min(args.repeats, 2), min(args.warmup, 1)
        small_n, mixed_div = 500, 16
    mixed_sizes = [(40, 16 * MiB // mixed_div), (40, 4 * MiB // mixed_div), (100, 64 * 1024 // mixed_div)]

    warnings.filterwarnings("ignore", category=FutureWarning)
    out = Out()
    exe = os.path.relpath(sys.executable) if not os.path.relpath(sys.executable).startswith("..") else sys.executable
    cmd = " ".join(shlex.quote(a) for a in [exe, *sys.argv])
    if os.environ.get("PYTHONPATH"):
        cmd = f"PYTHONPATH={shlex.quote(os.environ['PYTHONPATH'])} {cmd}"
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out(f"# Save stall of real-model-shaped states ({time.strftime('%Y-%m-%d %H:%M:%S')})")
    out()
    out(f"- command: `{cmd}`")
    out(f"- machine: {machine_note()}")
    out(f"- tierfs: {tierfs_note()}")
    if args.note:
        out(f"- note: {args.note}")
    out(f"- repeats {args.repeats} (median reported), warm-up saves {args.warmup} per method; "
        "gloo process group of one process (tierfs and DCP both use it)")
    largest = max(gpt_bytes(args.layers, args.width, args.vocab, args.context) if "gpt" in states else 0,
                  sum(c * b for c, b in mixed_sizes) if "mixed" in states else 0,
                  small_n * 4096 if "small" in states else 0)
    pf = int(args.prefault_gib * GiB) if args.prefault_gib >= 0 else min(6 * largest, mem_available() - 4 * GiB)
    if pf >= GiB:
        log(f"pre-faulting {pf / GiB:.1f} GiB of fresh memory (VM first touch)")
        out(f"- {pf // GiB} GiB of fresh memory touched and freed first at {prefault(pf):.2f} GB/s "
            "(VM first touch; see _common.prefault)")
    out()
    scratch = Scratch("tierfs-bench-stall-")
    failed = None
    try:
        init_group()
        for label in states:
            log(f"building state {label}")
            keep = None
            if label == "gpt":
                raw, keyed, how, keep = gpt_state(args.layers, args.width, args.vocab, args.context)
                desc = (f"GPT: {args.layers} layers, width {args.width}, vocab {args.vocab}, context "
                        f"{args.context}, + AdamW state after one step")
            elif label == "small":
                raw = keyed = flat_state([(small_n, 4096)])
                how, desc = "", f"{small_n} fp32 tensors x 4 KiB"
            else:
                raw = keyed = flat_state(mixed_sizes)
                how = ""
                desc = "180 fp32 tensors: " + ", ".join(f"{c} x {b / 1024:g} KiB" for c, b in mixed_sizes)
            n, nbytes = count_bytes(raw)
            dst_raw = nested_like(raw)
            dst_keyed = dst_raw if keyed is raw else remap(keyed, raw, dst_raw)
            out(f"## {label}: {desc}")
            out()
            out(f"- {n} tensors, {nbytes} bytes ({nbytes / GB:.3f} GB)")
            if label == "gpt":
                n_model, b_model = count_bytes(raw["model"])
                out(f"- model: {n_model} tensors ({b_model / GB:.3f} GB); optimizer: {n - n_model} tensors "
                    f"({(nbytes - b_model) / GB:.3f} GB), {len(raw['optim']['param_groups'])} param group(s) "
                    "(non-tensor leaves: not counted, not copied by the floor)")
                out(f"- string-keyed fallback for the tierfs rows, used only where the raw state raises: {how}")
            out()
            log(f"{label}: {n} tensors, {nbytes / GB:.3f} GB")
            ctx = Ctx(label, raw, keyed, dst_raw, dst_keyed, scratch, args.repeats, args.warmup, n, nbytes,
                      wait_quiet=args.wait_quiet)
            for _ in range(2):  # the floor, warm
                copy_nested(dst_raw, raw)
            run_state(ctx, out)
            del ctx, raw, keyed, dst_raw, dst_keyed, keep
            settle()
    except BaseException as e:
        failed = e
        out(f"\n**run failed**: {type(e).__name__}: {e}\n\n```\n{traceback.format_exc()}```")
        raise
    finally:
        scratch.cleanup()
        try:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass
        os.makedirs(args.out_dir, exist_ok=True)
        path = os.path.join(args.out_dir, f"bench_stall-{stamp}{'-quick' if args.quick else ''}"
                            f"{'-failed' if failed is not None else ''}.md")
        with open(path, "w") as f:
            f.write(out.text())
        log(f"wrote {path}")


if __name__ == "__main__":
    main()
