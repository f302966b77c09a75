"""tierfs demo: a 4-node training job loses a node and gets its shard back from a peer's RAM.

Four processes run under torch.distributed (gloo on localhost); each acts as its own node with its own
RAM directory. Each rank trains its own shard of the model (here a small MLP per rank, standing in for a
model-parallel shard) with Adam, CPU, fixed seeds, 60 steps. tierfs saves:

- to the RAM tier every 2 steps (a private directory under /dev/shm, keeping the latest 2),
- to the peer tier after each RAM save, in the background: every rank's shard goes to the rank on the
  next node, which verifies every block before it acknowledges,
- to the object tier every 20 steps, in the background (a file:// URL; s3:// or gs:// work the same).

Scenario 1: at step 37 node 2 dies (SIGKILL); the job is torn down, node 2 is replaced by one with an
empty RAM directory and the job restarts. Nodes 0, 1, 3 restore step 36 from their RAM; node 2 gets its
shard from the peer that kept a copy, which also re-seeds the copy node 2 kept for node 1.

Scenario 2: the same crash, but two neighbouring nodes are lost (1 and 2). With one replica, rank 1's
only copy was on node 2: no rank can restore step 36, so every rank agrees on step 20, from the object
tier.

Every run must end with weights bitwise equal to an uninterrupted run: restores are exact, not close.

    python examples/demo.py              (what `make demo` runs; about half a minute, cleans up)
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

WORLD = 4
TOTAL_STEPS = 60
CRASH_AT = 37
VICTIM = 2
RAM_EVERY, OBJECT_EVERY = 2, 20
BATCH = 256

torch.set_num_threads(1)  # small model: one thread is fastest, and results are bitwise reproducible


# -- the training job (one rank) ----------------------------------------------------------------------

def make_data(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234 + rank)
    x = torch.randn(4096, 32, generator=g)
    w1, w2 = torch.randn(32, 16, generator=g), torch.randn(16, 1, generator=g) / 4
    y = torch.tanh(x @ w1) @ w2 + 0.05 * torch.randn(4096, 1, generator=g)
    return x, y


def build(rank: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(rank)
    model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                torch.nn.ReLU(), torch.nn.Linear(256, 1))
    return model, torch.optim.Adam(model.parameters(), lr=2e-3)


def train_step(model, opt, data, rank: int, step: int) -> float:
    """One step on a minibatch chosen by (rank, step) alone, so a resumed run sees the same data."""
    x, y = data
    g = torch.Generator().manual_seed(100_000 * (rank + 1) + step)
    idx = torch.randint(0, len(x), (BATCH,), generator=g)
    loss = torch.nn.functional.mse_loss(model(x[idx]), y[idx])
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return loss.item()


def checkpoint_state(model, opt, step: int) -> dict:
    """Tensors and JSON values only (no pickle): weights, Adam's moments and step counts, the step."""
    sd = opt.state_dict()
    return {"model": model.state_dict(),
            "optim": {"state": {str(i): dict(s) for i, s in sd["state"].items()},
                      "param_groups": sd["param_groups"]},
            "step": step}


def restore_template(model, opt) -> dict:
    """A state of the right shapes for ``restore_into`` (Adam creates its state lazily: give it zeros)."""
    for group in opt.param_groups:
        for p in group["params"]:
            opt.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                            "exp_avg_sq": torch.zeros_like(p)}
    return checkpoint_state(model, opt, -1)


def load_restored(model, opt, state: dict) -> int:
    model.load_state_dict(state["model"])
    opt.load_state_dict({"state": {int(i): s for i, s in state["optim"]["state"].items()},
                         "param_groups": state["optim"]["param_groups"]})
    return int(state["step"])


def reference_weights(rank: int) -> list[torch.Tensor]:
    """The uninterrupted run the resumed one must match."""
    model, opt = build(rank)
    data = make_data(rank)
    for step in range(1, TOTAL_STEPS + 1):
        train_step(model, opt, data, rank, step)
    return list(model.state_dict().values())


def open_store(ram_root: str, url: str):
    from tierfs import TieredStore
    from tierfs.policies import FixedIntervalPolicy, LatestN
    from tierfs.tiers import MemoryTier, ObjectTier, PeerTier

    node = os.environ["TIERFS_NODE_RANK"]
    return TieredStore([
        MemoryTier(os.path.join(ram_root, f"node{node}"), save=FixedIntervalPolicy(RAM_EVERY), keep=LatestN(2)),
        PeerTier(replicas=1),  # follows the RAM tier's policy; keeps the newest fully replicated step
        ObjectTier(url, save=FixedIntervalPolicy(OBJECT_EVERY), keep=LatestN(2), name="object"),
    ])


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    # tierfs says in its log what it skipped and why; rank 0's is enough here
    logging.basicConfig(level=logging.WARNING if rank == 0 else logging.ERROR, stream=sys.stdout,
                        format="  (tierfs log, rank 0) %(message)s")
    say = (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)  # noqa: E731
    model, opt = build(rank)
    data = make_data(rank)
    store = open_store(args.ram, args.object)
    first = 1
    if args.resume:
        state = restore_template(model, opt)
        info = store.restore_into(state)
        first = load_restored(model, opt, state) + 1
        say(f"  restored step {info.step}; where each rank's shard came from:")
        for r in info.ranks:
            src = f"{r['tier']} (sent by rank {r['peer']})" if r["peer"] is not None else r["tier"]
            say(f"    rank {r['rank']} (node {r['rank']}): {src:24s} {r['nbytes'] / 1e6:.2f} MB in "
                f"{r['seconds'] * 1e3:6.1f} ms")
        for tier, step, why in info.skipped:
            print(f"  [rank {rank}] skipped {tier} step {step}: {why}", flush=True)
        held = dist.get_world_size() * [None]
        dist.all_gather_object(held, store.tier("peer").holdings())
        say("  peer copies after the restore (node: {step: [ranks whose shard it keeps]}): "
            + ", ".join(f"{n}: {h}" for n, h in enumerate(held)))
    for step in range(first, TOTAL_STEPS + 1):
        loss = train_step(model, opt, data, rank, step)
        store.save(step, checkpoint_state(model, opt, step))  # the tiers' policies pick the steps
        if step % 10 == 0:
            say(f"  [rank 0] step {step:3d}  loss {loss:.4f}")
        if step == args.crash_at:
            store.wait_until_finished()  # only so the demo prints the same every run
            dist.barrier()
            say("  tiers at the crash: " + ", ".join(f"step {s}: {'+'.join(t)}" for s, t in store.steps().items()))
            if rank == VICTIM:
                print(f"  [rank {rank}] node {VICTIM} dies now: SIGKILL", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            dist.barrier()  # never returns: rank 2 is gone and the launcher tears the job down
    store.wait_until_finished()
    same = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), reference_weights(rank)))
    results = dist.get_world_size() * [None]
    dist.all_gather_object(results, same)
    say(f"  final weights of ranks 0-{WORLD - 1} bitwise equal to an uninterrupted run: {results}")
    store.close()
    dist.destroy_process_group()
    raise SystemExit(0 if all(results) else 1)


# -- the driver (what torchrun would be) -----------------------------------------------------------

def launch(ram: str, url: str, *extra: str, expect_crash: bool = False) -> bool:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(WORLD):
        env = os.environ | {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                            "WORLD_SIZE": str(WORLD), "LOCAL_RANK": "0", "TIERFS_NODE_RANK": str(rank)}
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), "--phase", "worker",
                                       "--ram", ram, "--object", url, *extra], env=env))
    try:
        if expect_crash:
            procs[VICTIM].wait(timeout=300)
            print(f"  launcher: rank {VICTIM} exited ({procs[VICTIM].returncode}); tearing the job down")
            return procs[VICTIM].returncode == -signal.SIGKILL
        return all(p.wait(timeout=300) == 0 for p in procs)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--phase", choices=["demo", "worker"], default="demo")
    ap.add_argument("--ram")
    ap.add_argument("--object")
    ap.add_argument("--crash-at", type=int, default=0)
    ap.add_argument("--resume", action="store_true")
    args = ap.parse_args()
    if args.phase == "worker":
        worker(args)
        return 1  # not reached

    t0 = time.perf_counter()
    shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    ram = tempfile.mkdtemp(prefix="tierfs-demo-", dir=shm)
    base = tempfile.mkdtemp(prefix="tierfs-demo-")
    url = f"file://{base}/object"
    ok = True
    try:
        print(f"== {WORLD} nodes train; node {VICTIM} dies at step {CRASH_AT} ==")
        print(f"  RAM tiers {ram}/node<N> (every {RAM_EVERY} steps, keep 2); peer tier: 1 replica on the next "
              f"node; object tier {url} (every {OBJECT_EVERY} steps)")
        ok &= launch(ram, url, "--crash-at", str(CRASH_AT), expect_crash=True)
        shutil.copytree(ram, f"{base}/ram-at-crash")
        shutil.copytree(f"{base}/object", f"{base}/object-at-crash")

        print()
        print(f"== Scenario 1: node {VICTIM} is replaced (empty RAM) and the job restarts ==")
        shutil.rmtree(Path(ram) / f"node{VICTIM}")
        ok &= launch(ram, url, "--resume")

        print()
        print(f"== Scenario 2: the same crash, but neighbouring nodes 1 and 2 are both lost ==")
        shutil.rmtree(ram)
        shutil.copytree(f"{base}/ram-at-crash", ram)
        shutil.rmtree(f"{base}/object")
        shutil.copytree(f"{base}/object-at-crash", f"{base}/object")
        for n in (1, 2):
            shutil.rmtree(Path(ram) / f"node{n}")
        ok &= launch(ram, url, "--resume")
    finally:
        shutil.rmtree(ram, ignore_errors=True)
        shutil.rmtree(base, ignore_errors=True)
    print()
    print(f"demo {'passed' if ok else 'FAILED'} in {time.perf_counter() - t0:.1f} s; temporary directories removed")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
