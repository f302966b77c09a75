"""Saved, committed, durable: how long after ``save`` returns a step survives each kind of failure.

    .venv/bin/python benchmarks/bench_durable.py [--width 768] [--layers 6] [--saves 5] [--warmup 2]

A real model (``torch.nn.TransformerEncoder`` with a token embedding and an output head) trained with
AdamW, so the checkpoint is the model's and AdamW's state (a few hundred MB). ``CheckpointManager`` with
a RAM tier and a ``file://`` object tier on disk, both taking every save, the default path (torch state
through DCP, ``save`` asynchronous). For each save, measured from the call:

- *returns*: ``save`` gives the training thread back (the state is copied into the RAM tier's buffers);
- *committed*: ``store.wait_until_committed()`` returns (checksums, manifest and marker in RAM: the step
  survives the process being killed);
- *durable*: ``wait_until_finished()`` returns (the object tier holds the step, marker last: it survives
  the node).

Three conditions: the training thread waits (nothing else runs), at the default background bandwidth
cap (256 MB/s) and without a cap; and training goes on right after ``save`` returns (the default cap):
training steps of the same model (small batches, so that a step is short next to the commit) on every
core, while a watcher thread times the commit and the copy. The training steps
that finish before the step is committed (durable) are what a SIGKILL (a lost node) at that moment
would cost on top of the save interval.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(__file__))
from _common import GB, Scratch, log, machine_note  # noqa: E402


def build(width: int, layers: int, vocab: int, seed: int = 0):
    import torch

    torch.manual_seed(seed)
    layer = torch.nn.TransformerEncoderLayer(d_model=width, nhead=max(1, width // 64), dim_feedforward=4 * width,
                                             batch_first=True, dropout=0.0)
    model = torch.nn.ModuleDict({
        "embed": torch.nn.Embedding(vocab, width),
        "encoder": torch.nn.TransformerEncoder(layer, num_layers=layers, enable_nested_tensor=False),
        "head": torch.nn.Linear(width, vocab),
    })
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, opt


def train_step(model, opt, step: int, batch: int, seq: int, vocab: int) -> float:
    import torch

    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    h = model["encoder"](model["embed"](tokens[:, :-1]))
    loss = torch.nn.functional.cross_entropy(model["head"](h).flatten(0, 1), tokens[:, 1:].flatten())
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.item()


def checkpoint_state(model, opt):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, opt)
    return {"model": model_sd, "optim": optim_sd}


def nbytes_of(state) -> int:
    import torch

    total = 0

    def walk(x):
        nonlocal total
        if isinstance(x, torch.Tensor):
            total += x.nelement() * x.element_size()
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)

    walk(state)
    return total


class CopyLines(logging.Handler):
    """Keeps the store's INFO lines (logger ``tierfs``) with the time they were emitted."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[tuple[float, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append((time.perf_counter(), record.getMessage()))


def run_condition(label: str, model, opt, scratch: Scratch, disk: str, args, bandwidth, training: bool,
                  lines: CopyLines) -> list[dict]:
    from tierfs import CheckpointManager
    from tierfs.policies import FixedIntervalPolicy, LatestN
    from tierfs.tiers import MemoryTier, ObjectTier

    ram = scratch.fresh(f"ram-{label}")
    obj = os.path.join(disk, f"object-{label}")
    options = {} if bandwidth == "default" else {"background_bandwidth": None}
    rows = []
    step = 0
    with CheckpointManager([
        MemoryTier(ram, save=FixedIntervalPolicy(1), keep=LatestN(2)),
        ObjectTier(f"file://{obj}", save=FixedIntervalPolicy(1), keep=LatestN(2)),
    ], **options) as mgr:
        for i in range(args.warmup + args.saves):
            step += 1
            train_step(model, opt, 10_000 + step, args.batch, args.seq, args.vocab)
            state = checkpoint_state(model, opt)
            lines.lines.clear()
            marks: dict[str, float] = {}

            def watch() -> None:
                mgr.store.wait_until_committed()
                marks["committed"] = time.perf_counter()
                mgr.wait_until_finished()
                marks["durable"] = time.perf_counter()

            t0 = time.perf_counter()
            assert mgr.save(step, state)
            t_ret = time.perf_counter()
            ends: list[float] = []
            if training:
                w = threading.Thread(target=watch, name="bench-watch")
                w.start()
                while w.is_alive():  # training goes on; a save in the loop would follow its own interval
                    train_step(model, opt, 20_000 + step * 100 + len(ends), args.batch, args.seq, args.vocab)
                    ends.append(time.perf_counter())
                w.join()
            else:
                watch()
            assert step in mgr.all_steps()
            copied = [(t, m) for t, m in lines.lines if f"step {step} copied" in m]
            row = {"step": step, "returns": t_ret - t0, "committed": marks["committed"] - t0,
                   "durable": marks["durable"] - t0, "log_at": copied[0][0] - t0 if copied else float("nan"),
                   "log": copied[0][1] if copied else "",
                   "steps_to_commit": sum(1 for e in ends if e <= marks["committed"]),
                   "steps_to_durable": sum(1 for e in ends if e <= marks["durable"]),
                   "steps": len(ends), "train_s": statistics.median(
                       [b - a for a, b in zip([t_ret] + ends, ends)]) if ends else float("nan")}
            if i >= args.warmup:
                rows.append(row)
            log(f"{label} step {step}: returns {row['returns']:.3f} s, committed {row['committed']:.3f} s, "
                f"durable {row['durable']:.3f} s" + (f", {len(ends)} training steps" if training else ""))
    scratch.remove(f"ram-{label}")
    shutil.rmtree(obj, ignore_errors=True)
    return rows


def med(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=1, help="sequences per training step")
    ap.add_argument("--seq", type=int, default=32, help="tokens per sequence (short steps, next to the commit)")
    ap.add_argument("--saves", type=int, default=5, help="measured saves per condition")
    ap.add_argument("--warmup", type=int, default=2, help="saves before the measured ones, per condition")
    ap.add_argument("--disk", default=tempfile.gettempdir(), help="where the file:// object tier goes")
    args = ap.parse_args()

    import torch

    print(f"machine: {machine_note()}; load average at the start {os.getloadavg()[0]:.1f}\n")
    model, opt = build(args.width, args.layers, args.vocab)
    train_step(model, opt, 0, args.batch, args.seq, args.vocab)  # AdamW's state exists from here on
    state_nbytes = nbytes_of(checkpoint_state(model, opt))
    params = sum(p.numel() for p in model.parameters())
    log(f"model: {params / 1e6:.1f} M parameters; checkpoint (model + AdamW) {state_nbytes / GB:.3f} GB")

    lines = CopyLines()
    tierfs_log = logging.getLogger("tierfs")
    tierfs_log.addHandler(lines)
    tierfs_log.setLevel(logging.INFO)
    scratch = Scratch("tierfs-bench-durable-")
    disk = tempfile.mkdtemp(dir=args.disk, prefix="tierfs-bench-durable-")
    conditions = [("waiting", "default", False), ("waiting-uncapped", None, False), ("training", "default", True)]
    results = {}
    try:
        for label, bandwidth, training in conditions:
            log(f"condition {label}")
            results[label] = run_condition(label, model, opt, scratch, disk, args, bandwidth, training, lines)
    finally:
        tierfs_log.removeHandler(lines)
        scratch.cleanup()
        shutil.rmtree(disk, ignore_errors=True)

    print(f"### Saved, committed, durable: {params / 1e6:.1f} M parameters + AdamW, "
          f"{state_nbytes / GB:.3f} GB per checkpoint\n")
    print(f"TransformerEncoder width {args.width}, {args.layers} layers, vocab {args.vocab}; CheckpointManager: "
          f"RAM tier (/dev/shm) + file:// object tier on {args.disk}, both every save; {args.warmup} warm-up "
          f"and {args.saves} measured saves per condition; medians, seconds from the call to save.\n")
    print("| condition | returns | committed in RAM | durable on the object tier | committed / returns | "
          "durable / returns | durable - committed |")
    print("|---|---|---|---|---|---|---|")
    describe = {"waiting": "training waits, default cap (256 MB/s)", "waiting-uncapped": "training waits, no cap",
                "training": "training goes on, default cap"}
    for label, _, _ in conditions:
        rows = results[label]
        r, c, d = med(rows, "returns"), med(rows, "committed"), med(rows, "durable")
        print(f"| {describe[label]} | {r:.3f} | {c:.3f} | {d:.3f} | {c / r:.1f}x | {d / r:.1f}x | {d - c:.3f} |")
    rows = results["training"]
    print(f"\nWhile training goes on (batch {args.batch} x {args.seq} tokens; one training step "
          f"{med(rows, 'train_s'):.3f} s median, "
          f"{torch.get_num_threads()} torch threads): training steps finished before the step was committed "
          f"{[r['steps_to_commit'] for r in rows]}, before it was durable {[r['steps_to_durable'] for r in rows]}.\n")
    print("### Every measured save (s from the call)\n")
    print("| condition | step | returns | committed | durable | copy logged | training steps to commit; "
          "to durable |")
    print("|---|---|---|---|---|---|---|")
    for label, _, training in conditions:
        for r in results[label]:
            steps = f"{r['steps_to_commit']}; {r['steps_to_durable']}" if training else "-"
            print(f"| {label} | {r['step']} | {r['returns']:.3f} | {r['committed']:.3f} | {r['durable']:.3f} | "
                  f"{r['log_at']:.3f} | {steps} |")
    example = next((r["log"] for rs in results.values() for r in rs if r["log"]), "")
    print(f"\nLoad average at the end: {os.getloadavg()[0]:.1f} (1 min), {os.getloadavg()[1]:.1f} (5 min).")
    print(f"\nThe store's line when a step is durable on the object tier (logger `tierfs`, INFO): `{example}`")


if __name__ == "__main__":
    main()
