"""tierfs demo: a training job crashes, restarts from RAM; a node is lost, the job restarts from storage.

A small MLP learns a synthetic regression task with Adam (CPU, fixed seeds, 60 steps). Its state (model
weights, Adam's moments and step counts, the step number) is saved every step to a RAM tier (a private
directory under /dev/shm, keeping the latest 2) and every 10th step, in the background, to an object
tier (here a local directory through a file:// URL; s3:// or gs:// work the same way).

Scenario 1, process crash: a training subprocess SIGKILLs itself at step 37, with no clean shutdown.
A new process opens the same tiers, restores step 37 from RAM and trains on to step 60.

Scenario 2, node loss: the same crash, then the RAM copy is damaged by one flipped bit (the restore
skips it and says why), then the RAM directory is wiped entirely: the restore comes from the object
tier (step 30) and training repeats steps 31-37.

Both runs must end with weights bitwise equal to an uninterrupted run: restores are exact, not close.

    python examples/demo.py              (what `make demo` runs; about 10 s, cleans up after itself)
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import torch

from tierfs import RestoreInfo, TieredStore, cli
from tierfs.policies import FixedIntervalPolicy, LatestN
from tierfs.tiers import MemoryTier, ObjectTier

TOTAL_STEPS = 60
CRASH_AT = 37
OBJECT_EVERY = 10
PRINT_EVERY = 5
BATCH = 256

torch.set_num_threads(1)  # small model: one thread is fastest, and results are bitwise reproducible


# -- the training job -------------------------------------------------------------------------------

def make_data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(4096, 32, generator=g)
    w1, w2 = torch.randn(32, 16, generator=g), torch.randn(16, 1, generator=g) / 4
    y = torch.tanh(x @ w1) @ w2 + 0.05 * torch.randn(4096, 1, generator=g)
    return x, y


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                torch.nn.ReLU(), torch.nn.Linear(256, 1))
    return model, torch.optim.Adam(model.parameters(), lr=2e-3)


def train_step(model, opt, data, step: int) -> float:
    """One step on a minibatch chosen by the step number alone, so a resumed run sees the same data."""
    x, y = data
    idx = torch.randint(0, len(x), (BATCH,), generator=torch.Generator().manual_seed(100_000 + step))
    loss = torch.nn.functional.mse_loss(model(x[idx]), y[idx])
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return loss.item()


def checkpoint_state(model, opt, step: int) -> dict:
    """What is saved: tensors and JSON values only (no pickle). Adam's per-parameter state is keyed by
    parameter index; the keys become strings and param_groups (floats, lists) are stored as JSON."""
    sd = opt.state_dict()
    return {
        "model": model.state_dict(),
        "optim": {"state": {str(i): dict(s) for i, s in sd["state"].items()},
                  "param_groups": sd["param_groups"]},
        "step": step,
    }


def restore_template(model, opt) -> dict:
    """A state of the right shapes for ``restore_into``: Adam creates its state lazily on the first
    step, so give a fresh optimizer zeroed moments; the restore overwrites them in place."""
    for group in opt.param_groups:
        for p in group["params"]:
            opt.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                            "exp_avg_sq": torch.zeros_like(p)}
    return checkpoint_state(model, opt, -1)


def load_restored(model, opt, state: dict) -> int:
    """Hand the restored tensors back to torch; return the step they belong to."""
    model.load_state_dict(state["model"])  # already in place; this also checks every key matched
    opt.load_state_dict({"state": {int(i): s for i, s in state["optim"]["state"].items()},
                         "param_groups": state["optim"]["param_groups"]})
    return int(state["step"])


def open_store(ram_dir: str, object_url: str) -> TieredStore:
    return TieredStore([
        MemoryTier(ram_dir, keep=LatestN(2), name="ram"),
        ObjectTier(object_url, save=FixedIntervalPolicy(OBJECT_EVERY), keep=LatestN(2), name="object"),
    ])


def run_steps(store: TieredStore, model, opt, data, first: int, last: int, tag: str,
              losses: dict[int, float], crash_at: int | None = None) -> list[float]:
    """Train steps ``first..last``, saving each; return the save times (seconds)."""
    times = []
    for step in range(first, last + 1):
        loss = train_step(model, opt, data, step)
        losses[step] = loss
        t0 = time.perf_counter()
        store.save(step, checkpoint_state(model, opt, step))
        times.append(time.perf_counter() - t0)
        if step % PRINT_EVERY == 0 or step in (first, crash_at):
            print(f"{tag} step {step:3d}  loss {loss:.4f}", flush=True)
        if step == crash_at:
            return times
            print(f"{tag} step {step:3d}  loss {loss:.4f}", flush=True)
    return times


def save_summary(times: list[float]) -> str:
    ms = [t * 1e3 for t in times]
    return f"{len(ms)} saves, median {statistics.median(ms):.2f} ms, max {max(ms):.2f} ms"


def phase_train(args: argparse.Namespace) -> None:
    """The subprocess: train from scratch and die on purpose at ``--crash-at``."""
    tag = f"  [train pid {os.getpid()}]"
    model, opt = build()
    store = open_store(args.ram, args.object)
    times = run_steps(store, model, opt, make_data(), 1, TOTAL_STEPS, tag, {}, args.crash_at)
    print(f"{tag} save times: {save_summary(times)} (save returns once RAM holds the step; object "
          "copies run in the background)", flush=True)
    # Only so the demo prints the same every run: the step-30 upload finished long ago in practice.
    store.wait_until_finished()
    print(f"{tag} crashing now: SIGKILL, no close()", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # a crash: no close(), mappings and threads just vanish


# -- the driver -------------------------------------------------------------------------------------

def fresh_dirs() -> tuple[str, str, str]:
    """(RAM dir on tmpfs, object tier URL, the object tier's parent dir to remove at the end)."""
    shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    ram = tempfile.mkdtemp(prefix="tierfs-demo-", dir=shm)
    base = tempfile.mkdtemp(prefix="tierfs-demo-")
    return ram, f"file://{base}/object", base


def crash_training(ram: str, url: str) -> None:
    cmd = [sys.executable, os.path.abspath(__file__), "--phase", "train", "--crash-at", str(CRASH_AT),
           "--ram", ram, "--object", url]
    r = subprocess.run(cmd, timeout=300)
    if r.returncode != -signal.SIGKILL:
        raise SystemExit(f"demo: the training subprocess exited with {r.returncode}, expected SIGKILL")
    print(f"  training process died (SIGKILL) at step {CRASH_AT}")


def show_tiers(store: TieredStore, when: str) -> None:
    held = {t.name: [] for t in store.tiers}
    for step, names in store.steps().items():
        for n in names:
            held[n].append(step)
    print(f"  {when}: " + ", ".join(f"{n} holds {v or 'nothing'}" for n, v in held.items()))


def show_restore(info: RestoreInfo) -> None:
    print(f"  restored step {info.step} from tier {info.tier!r}: {info.nbytes / 1e6:.2f} MB in "
          f"{info.seconds * 1e3:.2f} ms ({info.gbps:.2f} GB/s)")
    for tier, step, why in info.skipped:
        print(f"    skipped tier {tier!r} step {step}: {why}")
    if not info.skipped:
        print("    nothing skipped")


def restore_and_finish(store: TieredStore, data, losses: dict[int, float], tag: str) -> tuple[torch.nn.Module, list[float]]:
    model, opt = build()  # fresh weights: everything must come from the checkpoint
    state = restore_template(model, opt)
    info = store.restore_into(state)
    show_restore(info)
    step = load_restored(model, opt, state)
    assert step == info.step
    times = run_steps(store, model, opt, data, step + 1, TOTAL_STEPS, tag, losses)
    return model, times


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def flip_first_byte(ram: str, step: int) -> None:
    shard = Path(ram) / f"step_{step:012d}" / "rank_00000.0000.bin"
    with open(shard, "r+b") as f:
        b = f.read(1)
        f.seek(0)
        f.write(bytes([b[0] ^ 0x10]))



def resume_and_compare(store, data, losses, ref_model, ref_losses, note: str | None = None) -> bool:
    """Restore, train to the end, and compare with an uninterrupted run; print the outcome."""
    model, times = restore_and_finish(store, data, losses, "  [resumed]")
    note = note or f"final loss {losses[TOTAL_STEPS]:.4f}"
    print(f"  save times after the restart: {save_summary(times)}")
    same = same_weights(model, ref_model) and all(losses[s] == ref_losses[s] for s in losses)
    print(f"  final weights {'are bitwise equal to' if same else 'DIFFER from'} an uninterrupted run's ({note})")
    return same


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--phase", choices=["demo", "train"], default="demo")
    ap.add_argument("--crash-at", type=int, default=CRASH_AT)
    ap.add_argument("--ram")
    ap.add_argument("--object")
    args = ap.parse_args()
    if args.phase == "train":
        phase_train(args)
        return 1  # not reached

    t_start = time.perf_counter()
    # tierfs logs a warning when a restore skips a damaged copy; show it in line with the rest.
    logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="  (tierfs log) %(message)s")
    data = make_data()
    # The run the crashed ones must match: 60 steps, no interruption, no checkpoints.
    ref_model, ref_opt = build()
    ref_losses = {s: train_step(ref_model, ref_opt, data, s) for s in range(1, TOTAL_STEPS + 1)}
    cleanup: list[str] = []
    ok = True
    try:
        print(f"== Scenario 1: the training process crashes at step {CRASH_AT}, restarts on the same node ==")
        ram, url, base = fresh_dirs()
        cleanup += [ram, base]
        print(f"  RAM tier {ram} (every step, keep 2); object tier {url} (every {OBJECT_EVERY}, keep 2)")
        crash_training(ram, url)
        losses: dict[int, float] = {}
        print("  what the tiers hold after the crash (`tierfs ls`, read-only):")
        for target in (ram, url):
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                cli.main(["ls", target])
            print(textwrap.indent(out.getvalue(), "    "), end="")
        with open_store(ram, url) as store:
            ok &= resume_and_compare(store, data, losses, ref_model, ref_losses)

        print()
        print("== Scenario 2: the same crash, then the node's RAM is lost ==")
        ram, url, base = fresh_dirs()
        cleanup += [ram, base]
        crash_training(ram, url)
        print(f"  a bit flips in the RAM copy of step {CRASH_AT}:")
        flip_first_byte(ram, CRASH_AT)
        with open_store(ram, url) as store:
            model, opt = build()
            show_restore(store.restore_into(restore_template(model, opt)))
        shutil.rmtree(ram)
        print(f"  the node is lost: RAM directory {ram} wiped; a new node starts the job:")
        losses = {}
        with open_store(ram, url) as store:
            show_tiers(store, "on the new node")
            ok &= resume_and_compare(store, data, losses, ref_model, ref_losses,
                                     f"steps 31-{CRASH_AT} were trained twice")
    finally:
        for d in cleanup:
            shutil.rmtree(d, ignore_errors=True)
    print()
    print(f"demo {'passed' if ok else 'FAILED'} in {time.perf_counter() - t_start:.1f} s; temporary "
          "directories removed")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
