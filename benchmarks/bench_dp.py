"""Data-parallel checkpointing: replicas declared with ``replicated=`` stored once, against every rank storing all.

    .venv/bin/python benchmarks/bench_dp.py [--worlds 1,2,4] [--hidden 256] [--layers 12] [--saves 4]

For each data-parallel degree in ``--worlds`` one job of that many ranks (gloo on 127.0.0.1, each rank its
own node with its own RAM directory under /dev/shm; one file:// object directory under /tmp shared by all).
Every rank holds the same real model and its Adam state (a stack of ``--layers`` blocks of Linear(h, 4h),
LayerNorm, Linear(4h, h), LayerNorm with h = ``--hidden``, trained one step so Adam's moments exist; same
seed and same batches on every rank, so the replicas are bit-identical) plus a small tensor of its own
(``mine/rng``, 4 KiB). Between saves every rank trains one more step on the same batch.

Two stores are open side by side in every job, with the same tiers (RAM ``LatestN(1)``, ``PeerTier(1)``
when world > 1, object ``LatestN(1)``, unthrottled) in separate directories:

- ``replicated``: ``save(step, state, replicated=["model", "optim"])``: shared tiers store the replicated
  arrays once, peers replicate only what no other node holds;
- ``baseline``: ``save(step, state)``: every rank stores its whole state on every tier (the old behaviour).

After one warm-up save each, ``--saves`` saves per variant, the two variants taking turns (the first of
each round alternates). Per save: the bytes of the step's ``*.bin`` files on the object tier and their ratio
to the distinct bytes (model + Adam once, plus every rank's own tensor); the bytes in each rank's RAM step
directory and in its replicas for peers (``<ram>/peers``), over the rank's state bytes; the bytes each rank
sent to peers (the store's "replicated to peers" log line); the time from calling ``save`` until
``wait_until_finished`` returns (the step is on the object tier and replicated: durable) and the time
inside ``save`` (the stall; it returns once RAM holds the committed step), both the slowest rank's.

Tables show medians over saves; the launcher prints them (stdout) and progress (stderr).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
from _common import MiB, Scratch, launch_ranks, log, machine_note  # noqa: E402

VARIANTS = ("replicated", "baseline")
DECLARED = ["model", "optim"]


# -- inside each rank -------------------------------------------------------------------------------
class Sent(logging.Handler):
    """Collects the store's "step N replicated to peers: X sent in Ys" records: bytes sent per step."""

    def __init__(self) -> None:
        super().__init__()
        self.nbytes: dict[int, int] = {}

    def emit(self, record: logging.LogRecord) -> None:
        if record.msg.startswith("step %d replicated to peers"):
            step, nbytes, _secs = record.args  # type: ignore[misc]
            self.nbytes[int(step)] = int(nbytes)


def tensors(tree):
    """Every tensor leaf of a nested state (dicts with any keys, lists, tuples)."""
    import torch

    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for v in tree.values():
            yield from tensors(v)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            yield from tensors(v)


def tree_bytes(tree) -> int:
    return sum(t.numel() * t.element_size() for t in tensors(tree))


def bin_bytes(path: str, step_dir: str) -> int:
    """Bytes of the ``*.bin`` files in every directory named ``step_dir`` under ``path`` (itself included)."""
    total = 0
    for d, _, files in os.walk(path):
        if os.path.basename(d) == step_dir:
            total += sum(os.path.getsize(os.path.join(d, f)) for f in files if f.endswith(".bin"))
    return total


def build(hidden: int, layers: int):
    """The model, its Adam optimizer after one step, and the batch every rank trains on (fixed seeds)."""
    import torch

    torch.manual_seed(0)
    blocks = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(hidden, 4 * hidden), torch.nn.LayerNorm(4 * hidden),
                   torch.nn.Linear(4 * hidden, hidden), torch.nn.LayerNorm(hidden)]
    model = torch.nn.Sequential(*blocks)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    batch = torch.randn(8, hidden, generator=torch.Generator().manual_seed(1))
    return model, opt, batch


def train_step(model, opt, batch) -> None:
    model(batch).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from tierfs import TieredStore
    from tierfs.policies import LatestN
    from tierfs.tiers import MemoryTier, ObjectTier, PeerTier

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    say = log if rank == 0 else (lambda *a: None)  # noqa: E731
    tierfs_log = logging.getLogger("tierfs")
    tierfs_log.setLevel(logging.INFO)
    handler = Sent()  # saves run one at a time (each waits until finished), so one handler serves both stores
    tierfs_log.addHandler(handler)

    model, opt, batch = build(args.hidden, args.layers)
    train_step(model, opt, batch)  # Adam's exp_avg / exp_avg_sq exist from here on
    mine = torch.randn(1024, generator=torch.Generator().manual_seed(1000 + rank))

    def state() -> dict:
        return {"model": model.state_dict(), "optim": opt.state_dict(), "mine": {"rng": mine}}

    st = state()
    shared_bytes, mine_bytes = tree_bytes({"model": st["model"], "optim": st["optim"]}), tree_bytes(st["mine"])
    own_bytes = shared_bytes + mine_bytes
    say(f"world {world}: {own_bytes / MiB:.1f} MiB per rank ({sum(1 for _ in tensors(st))} tensors, "
        f"{mine_bytes} B of its own)")
    ram_dirs = {v: os.path.join(args.ram_root, v, f"node{os.environ['TIERFS_NODE_RANK']}") for v in VARIANTS}
    obj_dirs = {v: os.path.join(args.obj_root, v) for v in VARIANTS}
    stores = {}
    rows: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    try:
        for v in VARIANTS:
            tiers = [MemoryTier(ram_dirs[v], keep=LatestN(1))]
            if world > 1:
                tiers.append(PeerTier(replicas=1))
            tiers.append(ObjectTier(f"file://{obj_dirs[v]}", keep=LatestN(1)))
            stores[v] = TieredStore(tiers, background_bandwidth=None)
        for step in range(1 + args.saves):  # step 0: warm-up (the layout is worked out, buffers mapped)
            order = VARIANTS if step % 2 == 0 else VARIANTS[::-1]
            for v in order:
                store = stores[v]
                kw = {"replicated": DECLARED} if v == "replicated" else {}
                handler.nbytes.clear()
                dist.barrier()
                t0 = time.perf_counter()
                store.save(step, state(), **kw)
                t1 = time.perf_counter()
                store.wait_until_finished()
                t2 = time.perf_counter()
                dist.barrier()  # every rank done: the object tier's step is complete
                sdir = f"step_{step:012d}"
                row = {"step": step, "stall": t1 - t0, "durable": t2 - t0,
                       "ram": bin_bytes(os.path.join(ram_dirs[v], sdir), sdir),
                       "replicas": bin_bytes(os.path.join(ram_dirs[v], "peers"), sdir),
                       "sent": handler.nbytes.get(step, 0 if world == 1 else -1),
                       "objects": bin_bytes(os.path.join(obj_dirs[v], sdir), sdir) if rank == 0 else 0}
                if step:
                    rows[v].append(row)
            train_step(model, opt, batch)  # the same on every rank: the replicas stay identical
            say(f"world {world}: save {step} done" + (" (warm-up)" if step == 0 else ""))
    finally:
        for store in stores.values():
            store.close()
        tierfs_log.removeHandler(handler)
    gathered: list = [None] * world
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        out = {"world": world, "own_bytes": own_bytes, "shared_bytes": shared_bytes, "mine_bytes": mine_bytes,
               "distinct": shared_bytes + world * mine_bytes, "ranks": gathered, "machine": machine_note()}
        with open(args.result, "w") as f:
            json.dump(out, f)
    dist.destroy_process_group()


# -- the launcher -----------------------------------------------------------------------------------
def spread(values: list[float], fmt: str) -> str:
    """One value, or ``min-max`` when the ranks differ in the shown precision."""
    lo, hi = format(min(values), fmt), format(max(values), fmt)
    return lo if lo == hi else f"{lo}-{hi}"


def size(nbytes: float) -> str:
    for unit, scale in (("MiB", MiB), ("KiB", 1024)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes:.0f} B"


def report(args: argparse.Namespace, jobs: list[dict]) -> None:
    j0 = jobs[0]
    print("## Data-parallel checkpointing: replicas stored once (`replicated=`) vs every rank storing all\n")
    print(f"- machine: {j0['machine']}")
    print(f"- command: `.venv/bin/python benchmarks/bench_dp.py --worlds {args.worlds} --hidden {args.hidden} "
          f"--layers {args.layers} --saves {args.saves}`")
    print(f"- state per rank: {j0['own_bytes'] / MiB:.2f} MiB = model + Adam {j0['shared_bytes'] / MiB:.2f} MiB "
          f"(identical on every rank; `replicated={DECLARED}` in the replicated variant) + its own "
          f"`mine/rng` {j0['mine_bytes']} B; distinct bytes = model + Adam once + world x own")
    print("- tiers: RAM LatestN(1) in /dev/shm per rank (each rank its own node), PeerTier(replicas=1) when world "
          "> 1, file:// object tier LatestN(1) in /tmp (shared), background_bandwidth=None; "
          f"{args.saves} saves per variant after 1 warm-up save, the variants taking turns\n")
    for v in VARIANTS:
        print(f"### {v}: " + ("`save(step, state, replicated=[\"model\", \"optim\"])`" if v == "replicated"
                              else "`save(step, state)` (every rank stores its whole state)") + "\n")
        print("| world | object MiB / step | object / distinct | RAM per rank / state | replicas per rank / state "
              "(most) | peers sent per rank (most) | save -> durable s | stall s | durable s, every save |")
        print("|---|---|---|---|---|---|---|---|---|")
        for job in jobs:
            world, own = job["world"], job["own_bytes"]
            ranks = [r[v] for r in job["ranks"]]
            n = len(ranks[0])
            objects = statistics.median(ranks[0][i]["objects"] for i in range(n))
            ram = [statistics.median(x["ram"] for x in r) / own for r in ranks]
            reps = [statistics.median(x["replicas"] for x in r) / own for r in ranks]
            rep_bytes = [statistics.median(x["replicas"] for x in r) for r in ranks]
            sent = [statistics.median(x["sent"] for x in r) for r in ranks]
            durable = [max(r[i]["durable"] for r in ranks) for i in range(n)]
            stall = [max(r[i]["stall"] for r in ranks) for i in range(n)]
            peers = world > 1
            print(f"| {world} | {objects / MiB:.2f} | {objects / job['distinct']:.3f} | {spread(ram, '.3f')} | "
                  f"{spread(reps, '.3f') + ' (' + size(max(rep_bytes)) + ')' if peers else '-'} | "
                  f"{(size(max(sent)) if min(sent) >= 0 else 'no log line') if peers else '-'} | "
                  f"{statistics.median(durable):.3f} | {statistics.median(stall):.3f} | "
                  f"{' '.join(f'{t:.3f}' for t in durable)} |")
        print()
    print("- medians over saves; object bytes: the step's `*.bin` files on the object tier; RAM and replicas: the "
          "`*.bin` files of the step in the rank's RAM step directory and under its `peers/`, over the rank's "
          "state bytes (min-max over ranks when they differ); peer bytes sent: the store's \"replicated to "
          "peers\" log line; save -> durable: from calling `save` until "
          "`wait_until_finished` returns (object tier and peers done), stall: time inside `save` (returns "
          "once RAM holds the committed step), both the slowest rank's")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", default="1,2,4", help="data-parallel degrees, one job each")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--saves", type=int, default=4, help="timed saves per variant (after 1 warm-up save)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--ram-root", help=argparse.SUPPRESS)
    ap.add_argument("--obj-root", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return 0
    worlds = [int(w) for w in args.worlds.split(",")]
    jobs = []
    for world in worlds:
        scratch = Scratch("bench-dp-")
        obj_root = tempfile.mkdtemp(dir="/tmp", prefix="bench-dp-")
        result = os.path.join(obj_root, "result.json")
        try:
            log(f"world {world}: {world} ranks")
            t0 = time.perf_counter()
            rc = launch_ranks(__file__, ["--hidden", str(args.hidden), "--layers", str(args.layers), "--saves",
                                         str(args.saves), "--ram-root", scratch.root, "--obj-root",
                                         os.path.join(obj_root, "obj"), "--result", result], world)
            if rc:
                log(f"world {world}: a rank failed (exit code {rc})")
                return rc
            with open(result) as f:
                jobs.append(json.load(f))
            log(f"world {world}: done in {time.perf_counter() - t0:.0f} s")
        finally:
            scratch.cleanup()
            shutil.rmtree(obj_root, ignore_errors=True)
    report(args, jobs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
