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

The launcher (what torchrun would be) keeps each rank's stderr to itself. When node 2 dies, the other
ranks' collectives fail (gloo: connection reset by peer): that is the failure the demo injects, so each
rank's part of it is one line of the story. Anything else a rank did not expect (an exception, an exit
code, a rank that hangs) fails the demo, and that rank's stderr is printed in full.

    python examples/demo.py              (what `make demo` runs; about 40 s, cleans up)
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any

import torch

WORLD = 4
TOTAL_STEPS = 60
CRASH_AT = 37
VICTIM = 2
RAM_EVERY, OBJECT_EVERY = 2, 20
BATCH = 256
BUG_AT = 5  # --inject-bug: the step at which a rank raises an error nobody planned

# how a rank that lost a peer in the injected failure exits: the launcher expects it, and finds the one
# line saying why on the rank's stderr, after EXPECTED
PEER_LOST = 17
EXPECTED = "demo-expected: "
JOB_TIMEOUT = 300  # seconds a run of the job may take
GRACE = 30  # seconds the other ranks get to stop on their own once one is gone (then the launcher kills them)

torch.set_num_threads(1)  # small model: one thread is fastest, and results are bitwise reproducible


def size(nbytes: float) -> str:
    """Bytes in binary units: ``912.3 KiB``, ``1.50 MiB``."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}" if unit != "KiB" else f"{nbytes / scale:.1f} {unit}"
    return f"{int(nbytes)} B"


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


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


def state_nbytes(state: Any) -> int:
    if isinstance(state, torch.Tensor):
        return state.nbytes
    if isinstance(state, dict):
        return sum(state_nbytes(v) for v in state.values())
    return 0


class SaveTimes(logging.Handler):
    """How long each save took, per tier: the RAM tier's is the blocking ``save`` call (timed by the
    worker); the peer and object tiers' run in the background, and tierfs logs each one's time (INFO)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.times: dict[str, list[tuple[int, float]]] = {"ram": [], "peer": [], "object": []}

    def emit(self, record: logging.LogRecord) -> None:
        try:
            if "replicated to peers" in str(record.msg):  # (step, MB, seconds)
                self.times["peer"].append((int(record.args[0]), float(record.args[-1])))
            elif " copied " in str(record.msg):  # (step, source tier, tier, MB, seconds)
                tier = str(record.args[2])
                self.times.setdefault(tier, []).append((int(record.args[0]), float(record.args[-1])))
        except (TypeError, ValueError, IndexError):
            pass  # another message of the same words: not a timing


def expected_exit(why: str) -> None:
    """This rank stops because of the injected failure: one line for the launcher, no traceback. It exits
    at once, like a process torn down by its launcher: its peer is gone, so no collective (not even the
    process group's shutdown) could complete, and its RAM tier stays as the crash left it."""
    sys.stdout.flush()
    sys.stderr.write(EXPECTED + why + "\n")
    sys.stderr.flush()
    os._exit(PEER_LOST)


def gloo_error(e: BaseException) -> str:
    """``[.../pair.cc:537] Read error [127.0.0.1]:39836: Connection reset by peer. This is typically...``
    -> ``Read error: Connection reset by peer``."""
    msg = re.sub(r"^\[[^\]]*\]\s*", "", str(e).strip().splitlines()[0] if str(e).strip() else "")
    msg = re.sub(r"\s*\[[^\]]*\]:\d+", "", msg.split(". ")[0]).rstrip(".")
    return msg or type(e).__name__


def print_saves(say, shard: int, views: list[dict[str, list[tuple[int, float]]]], last: int) -> None:
    say(f"  saves in steps 1-{last}; each rank's shard is {size(shard)}; time per save, median [slowest] over "
        f"all {len(views)} ranks:")
    what = {"ram": ("save", "saves", "blocking: the training step waits for the commit"),
            "peer": ("copy", "copies", "background: to the next node, which verifies every block"),
            "object": ("upload", "uploads", "background")}
    for tier, (one, many, how) in what.items():
        mine = views[0].get(tier, [])
        every = [s for v in views for _, s in v.get(tier, [])]
        if not every:
            say(f"    {tier:7s} no timings reported")
            continue
        steps = [st for st, _ in mine]
        which = (f"steps {steps[0]}-{steps[-1]}" if len(steps) > 2 else
                 "step" + ("s " if len(steps) > 1 else " ") + ", ".join(map(str, steps)))
        count = f"{len(mine)} {one if len(mine) == 1 else many} ({which})"
        say(f"    {tier:7s} {count:24s} {ms(statistics.median(every)):>8s} {'[' + ms(max(every)) + ']':10s}  {how}")


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    # tierfs says in its log what it skipped and why; rank 0's is enough here. Its INFO records of background
    # copies carry their timings: SaveTimes collects them on every rank without printing them.
    shown = logging.StreamHandler(sys.stdout)
    shown.setLevel(logging.WARNING if rank == 0 else logging.ERROR)
    shown.setFormatter(logging.Formatter(f"  (tierfs log, rank {rank}) %(message)s"))
    timings = SaveTimes()
    tierfs_log = logging.getLogger("tierfs")
    tierfs_log.setLevel(logging.INFO)
    tierfs_log.addHandler(shown)
    tierfs_log.addHandler(timings)
    tierfs_log.propagate = False
    say = (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)  # noqa: E731

    model, opt = build(rank)
    data = make_data(rank)
    store = open_store(args.ram, args.object)
    first = 1
    if args.resume:
        state = restore_template(model, opt)
        t0 = time.perf_counter()
        info = store.restore_into(state)  # collective: every rank gets the same step
        took = time.perf_counter() - t0
        first = load_restored(model, opt, state) + 1
        redo = f"step {CRASH_AT}" if info.step + 1 == CRASH_AT else f"steps {info.step + 1}-{CRASH_AT}"
        say(f"  every rank restored step {info.step}, so the job redoes {redo} (restore_into: {ms(took)} on rank 0)")
        # a rank whose own state is in place returns while a replaced node still receives; the rest of the
        # restore (its sends, the ranks' agreement) finishes in the background, and with it info.ranks
        store.wait_until_finished()
        say("  where each rank's shard came from, read and verified in:")
        for r in info.ranks:
            if r["peer"] is not None:
                src = f"peer tier, from rank {r['peer']}'s RAM (node {r['peer']})"
            elif r["tier"] == "ram":
                src = f"ram tier, its own RAM (node {r['rank']})"
            else:
                src = f"{r['tier']} tier"
            rate = r["nbytes"] / r["seconds"] / 2**20 if r["seconds"] > 0 else float("inf")
            say(f"    rank {r['rank']}: {src:38s} {size(r['nbytes'])} in {ms(r['seconds']):>8s} "
                f"({rate:,.0f} MiB/s)")
        skipped = dist.get_world_size() * [None]
        dist.all_gather_object(skipped, info.skipped)
        for r, sk in enumerate(skipped):
            for tier, step, why in sk or ():
                say(f"    rank {r} passed over {tier} step {step}: {why}")
        held = dist.get_world_size() * [None]
        dist.all_gather_object(held, store.tier("peer").holdings())
        say("  peer copies after the restore (node: {step: [ranks whose shard it keeps]}): "
            + ", ".join(f"{n}: {h}" for n, h in enumerate(held)))
    for step in range(first, TOTAL_STEPS + 1):
        loss = train_step(model, opt, data, rank, step)
        if rank == args.inject_bug and step == BUG_AT:
            raise RuntimeError(f"a bug nobody planned (--inject-bug {rank}, step {step})")
        state = checkpoint_state(model, opt, step)
        t0 = time.perf_counter()
        if store.save(step, state):  # the tiers' policies pick the steps; every save the RAM tier takes
            timings.times["ram"].append((step, time.perf_counter() - t0))
        if step % 10 == 0:
            say(f"  [rank 0] step {step:3d}  loss {loss:.4f}")
        if step == args.crash_at:
            store.wait_until_finished()  # only so the demo prints the same every run
            views = dist.get_world_size() * [None]
            dist.all_gather_object(views, timings.times)
            print_saves(say, state_nbytes(state), views, step)
            say("  tiers at the crash: " + ", ".join(f"step {s}: {'+'.join(t)}" for s, t in store.steps().items()))
            dist.barrier()
            if rank == VICTIM:  # the injected failure: the launcher reports it
                sys.stdout.flush()
                os.kill(os.getpid(), signal.SIGKILL)
            try:
                dist.barrier()  # rank VICTIM never arrives: gloo sees its connection drop
            except RuntimeError as e:
                expected_exit(f"rank {VICTIM} dropped out of a barrier (gloo: {gloo_error(e)})")
            raise RuntimeError(f"a barrier completed without rank {VICTIM}, which was killed")
    store.wait_until_finished()
    same = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), reference_weights(rank)))
    results = dist.get_world_size() * [None]
    dist.all_gather_object(results, same)
    say(f"  final weights of ranks 0-{WORLD - 1} bitwise equal to an uninterrupted run: {results}")
    store.close()
    dist.destroy_process_group()
    raise SystemExit(0 if all(results) else 1)


# -- the driver (what torchrun would be) -----------------------------------------------------------

def wait_for(procs: list[subprocess.Popen]) -> tuple[list[int], set[int]]:
    """Wait until every rank has exited; returns the ranks in the order they exited, and those the
    launcher had to kill: every rank after JOB_TIMEOUT, the others GRACE seconds after one exits non-zero
    (as torchrun tears a job down)."""
    order: list[int] = []
    killed: set[int] = set()
    deadline = time.monotonic() + JOB_TIMEOUT
    while len(order) < len(procs):
        for r, p in enumerate(procs):
            if r not in order and p.poll() is not None:
                order.append(r)
                if p.returncode != 0:
                    deadline = min(deadline, time.monotonic() + GRACE)
        if len(order) < len(procs) and time.monotonic() > deadline:
            for r, p in enumerate(procs):
                if p.poll() is None:
                    p.kill()
                    killed.add(r)
        time.sleep(0.02)
    return order, killed


def last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1] if lines else "(nothing on stderr)"


def launch(ram: str, url: str, *extra: str, crash: bool = False) -> bool:
    """Run the job; True when every rank did what the scenario expects. With ``crash``: rank VICTIM dies
    by SIGKILL and every other rank stops because of it, each told in one line. Otherwise every rank must
    exit 0. A rank that does anything else fails the run: its stderr is printed."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs: list[subprocess.Popen] = []
    errs: list[IO[bytes]] = []
    try:
        for rank in range(WORLD):
            env = os.environ | {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                                "WORLD_SIZE": str(WORLD), "LOCAL_RANK": "0", "TIERFS_NODE_RANK": str(rank),
                                "TORCH_CPP_LOG_LEVEL": "ERROR"}  # c10d's warnings when a peer goes away
            errs.append(tempfile.TemporaryFile())
            procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), "--phase", "worker",
                                           "--ram", ram, "--object", url, *extra],
                                          env=env, stderr=errs[-1]))
        order, killed = wait_for(procs)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    stderr = []
    for f in errs:
        f.seek(0)
        stderr.append(f.read().decode(errors="replace"))
        f.close()

    told, unexpected = {}, []
    for r in order:
        rc, err = procs[r].returncode, stderr[r]
        expected = [ln[len(EXPECTED):] for ln in err.splitlines() if ln.startswith(EXPECTED)]
        if crash and r == VICTIM and rc == -signal.SIGKILL:
            told[r] = f"lost its node (SIGKILL at step {CRASH_AT}, as planned)"
        elif crash and r != VICTIM and rc == PEER_LOST and expected:
            told[r] = f"stopped, as expected: {expected[-1]}"
        elif crash and r != VICTIM and r in killed and procs[VICTIM].returncode == -signal.SIGKILL:
            told[r] = f"stopped by the launcher, as expected: still waiting for rank {VICTIM} after {GRACE} s"
        elif not crash and rc == 0:
            if err.strip():  # not expected, but not a failure: shown as it is
                print(f"  rank {r} exited 0 and wrote on its stderr:")
                print("\n".join("    | " + ln for ln in err.rstrip().splitlines()))
        else:
            unexpected.append(r)
    if crash and VICTIM in told:
        print()
        print(f"== Injected failure: node {VICTIM} dies at step {CRASH_AT} (SIGKILL) ==")
        for r in sorted(told, key=lambda r: (r != VICTIM, r)):  # the cause first
            print(f"  rank {r}: {told[r]}")
    if not unexpected:
        if crash:
            print("  the launcher tears the job down, as torchrun would; the other nodes' RAM survives the job")
        return True
    print()
    print(f"!! the job failed in a way the demo did not plan: rank(s) {', '.join(map(str, unexpected))}")
    first = unexpected[0]  # the first to exit: the others most likely failed because of it
    for r in unexpected:
        p = procs[r]
        how = ("killed by the launcher: it did not stop on its own" if r in killed else
               f"killed by signal {-p.returncode}" if p.returncode < 0 else f"exit code {p.returncode}")
        if r == first:
            print(f"  rank {r} ({how}, the first to fail); its stderr:")
            print("\n".join("    | " + ln for ln in (stderr[r].rstrip() or "(empty)").splitlines()))
        else:
            print(f"  rank {r} ({how}): {last_line(stderr[r])}")
    return False


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--phase", choices=["demo", "worker"], default="demo")
    ap.add_argument("--ram")
    ap.add_argument("--object")
    ap.add_argument("--crash-at", type=int, default=0)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--inject-bug", type=int, default=-1, metavar="RANK",
                    help=f"for tests: rank RANK raises an error nobody planned at step {BUG_AT} of the first run, "
                         "to show that the demo then prints that rank's stderr and fails")
    args = ap.parse_args()
    if args.phase == "worker":
        worker(args)
        return 1  # not reached

    t0 = time.perf_counter()
    shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    ram = tempfile.mkdtemp(prefix="tierfs-demo-", dir=shm)
    base = tempfile.mkdtemp(prefix="tierfs-demo-")
    url = f"file://{base}/object"
    ok = False
    try:
        print(f"== The job: {WORLD} nodes (one process each, gloo on localhost), each training its own shard "
              f"for {TOTAL_STEPS} steps ==")
        print(f"  ram tier:    {ram}/node<N>, every {RAM_EVERY} steps, keeps 2")
        print("  peer tier:   after each RAM save, 1 replica in the RAM of the next node")
        print(f"  object tier: {url}, every {OBJECT_EVERY} steps, keeps 2")
        bug = ("--inject-bug", str(args.inject_bug)) if args.inject_bug >= 0 else ()
        if not launch(ram, url, "--crash-at", str(CRASH_AT), *bug, crash=True):
            return 1
        shutil.copytree(ram, f"{base}/ram-at-crash")
        shutil.copytree(f"{base}/object", f"{base}/object-at-crash")

        print()
        print(f"== Scenario 1: node {VICTIM} is replaced (empty RAM) and the job restarts ==")
        shutil.rmtree(Path(ram) / f"node{VICTIM}")
        if not launch(ram, url, "--resume"):
            return 1

        print()
        print("== Scenario 2: the same crash, but neighbouring nodes 1 and 2 are both lost ==")
        shutil.rmtree(ram)
        shutil.copytree(f"{base}/ram-at-crash", ram)
        shutil.rmtree(f"{base}/object")
        shutil.copytree(f"{base}/object-at-crash", f"{base}/object")
        for n in (1, 2):
            shutil.rmtree(Path(ram) / f"node{n}")
        ok = launch(ram, url, "--resume")
        return 0 if ok else 1
    finally:
        shutil.rmtree(ram, ignore_errors=True)
        shutil.rmtree(base, ignore_errors=True)
        print()
        print(f"demo {'passed' if ok else 'FAILED'} in {time.perf_counter() - t0:.1f} s; temporary directories removed")


if __name__ == "__main__":
    raise SystemExit(main())
