"""One rank of a job with a peer tier (gloo on localhost, each process its own node, RAM in SHM/node<N>).

    peer_child.py SHM OBJ MODE REPLICAS[:CONNECTIONS[:FIRST]] [STEPS]   (FIRST: bytes of a transfer's first message)
MODE: save (steps 1..STEPS, async), tight (save, but rank 1's RAM budget has no room for a replica),
restore, restore-early (restore; a rank receiving its shard from a peer waits, inside the receive, until
every other rank has returned from restore_into; then the store is closed and opened again, and restores
once more), restore-split (restore where a rank may fail to get its
shard after the others returned: the errors each rank sees), localize, die-replicating (rank 1 is SIGKILLed while step 2 is being
replicated), priorities (the CPU priority of the store's threads), mismatch (save, but rank 1 takes
headers of at most 64 bytes, as if its limit differed). Prints one JSON line with what it saw.
"""

import datetime
import logging
import os
import signal
import sys

import numpy as np
import torch.distributed as dist

from tierfs import TieredStore
from tierfs.errors import TierfsError
from tierfs.policies import LatestN
from tierfs.testing import hooks
from tierfs.tiers import MemoryTier, ObjectTier, PeerTier
from tierfs.tiers.peer import Wire

from _child import finish  # tests/children/ is the script's directory, first on sys.path


def state_for(rank: int, step: int, n: int = 300_000) -> dict:
    """The small entry first: its shard file (5 KB) comes before the large entry's own file (1.2 MB)."""
    rng = np.random.default_rng(1000 * rank + step)
    b = rng.integers(0, 255, 5000 + rank, dtype=np.uint8)
    return {"b": b, "w": rng.standard_normal(n + 1000 * rank).astype(np.float32), "step": step}


def target_for(rank: int) -> dict:
    return {"w": np.zeros(300_000 + 1000 * rank, np.float32), "b": np.zeros(5000 + rank, np.uint8), "step": -1}


def threads(before: set[str]) -> list[list]:
    """(name, nice) of the threads started since ``before`` and still running (one that ends while they
    are listed, a worker of a pool winding down, is left out)."""
    out = []
    for t in sorted(set(os.listdir("/proc/self/task")) - before):
        try:
            with open(f"/proc/self/task/{t}/comm") as f:
                out.append([f.read().strip(), os.getpriority(os.PRIO_PROCESS, int(t))])
        except (FileNotFoundError, ProcessLookupError):
            continue
    return out


def loops(before: set[str]) -> list[int]:
    """The nice values of the store's gloo I/O threads (one per group)."""
    return sorted(nice for name, nice in threads(before) if name == "gloo_tcp_loop")


def count_new_groups() -> list[int]:
    """Count the process groups made from now on (``[n]``, updated as they are made)."""
    made, new_group = [0], dist.new_group

    def counted(*args, **kwargs):
        made[0] += 1
        return new_group(*args, **kwargs)
    dist.new_group = counted
    return made


def main() -> None:
    shm, obj, mode = sys.argv[1], sys.argv[2], sys.argv[3]
    replicas, _, rest = sys.argv[4].partition(":")  # replicas[:connections[:first message bytes]]
    connections, _, first = rest.partition(":")
    wire = {"chunk": 300_000}  # several messages per shard file, checksum blocks straddling them
    if first:  # headers longer than this take the two extra rounds (the same on every rank)
        wire["first"] = int(first)
    steps = int(sys.argv[5]) if len(sys.argv) > 5 else 2
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    made = count_new_groups()
    side = None
    reopen = mode == "restore-early"  # then: close the store and open it again, in these processes
    if mode == "restore-early":
        mode, side = "restore", dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=30))
        dist.barrier(group=side)  # its connections (and I/O thread) now, not among the store's

        def wait_for_the_others(stage, step, tier):  # the first receive only (not the restore into new arrays)
            nonlocal side
            if stage == "receive" and side is not None:
                side, g = None, side
                dist.barrier(group=g)
        hooks.add("stage", wait_for_the_others)
    budget = 2_200_000 if mode == "tight" and rank == 1 else None  # step 1 (small) fits twice, step 2 once
    if mode == "mismatch" and rank == 1:
        wire["max_header"] = 64  # headers of rank 0 (and its own) are out of range

    def open_store() -> tuple[TieredStore, PeerTier]:
        ram = MemoryTier(os.path.join(shm, f"node{os.environ['TIERFS_NODE_RANK']}"), keep=LatestN(2), budget=budget)
        node_rank = int(os.environ["TIERFS_NODE_RANK"]) if mode == "half-node-rank" and rank == 0 else None
        peer = PeerTier(replicas=int(replicas), connections=int(connections or 2), wire=Wire(**wire),
                        node_rank=node_rank)
        tiers = [ram, peer] + ([ObjectTier(f"file://{obj}")] if obj != "-" else [])
        return TieredStore(tiers, file_size=1 << 20, block_size=256 << 10), peer

    before = set(os.listdir("/proc/self/task"))
    if mode == "half-node-rank":  # node_rank given on rank 0 alone: every rank hears of it, none hangs
        try:
            open_store()
        except TierfsError as e:
            finish({"rank": rank, "error": f"{type(e).__name__}: {e}"})
            return
    store, peer = open_store()
    out = {"rank": rank, "targets": peer.targets[rank], "warnings": []}
    handler = logging.Handler()
    handler.emit = lambda r: out["warnings"].append(r.getMessage()) if r.levelno >= logging.WARNING else None
    logging.getLogger("tierfs").addHandler(handler)
    if mode == "die-replicating" and rank == 1:  # the kill point: rank 1 sending step 2's bytes to its peer
        hooks.add("transfer", lambda step, tier, nbytes: os.kill(os.getpid(), signal.SIGKILL)
                  if step == 2 and tier == "peer" else None)
    if mode == "mismatch":
        replicate, out["failed"] = peer.replicate, []

        def spy(*args, **kw):  # what replicate() says failed, as every rank agreed
            failed = replicate(*args, **kw)
            out["failed"].extend(failed)
            return failed
        peer.replicate = spy
    if mode == "lagging":  # from step 2 on, rank 0 cannot read its shard to send: no later step replicates
        replicate_as_is = peer.replicate

        def unreadable(step, *args, **kw):
            if step >= 2 and rank == 0:
                kw["error"] = "OSError: injected: the shard could not be read"
            return replicate_as_is(step, *args, **kw)
        peer.replicate = unreadable
    if mode in ("save", "tight", "die-replicating", "mismatch", "lagging"):
        for step in range(1, steps + 1):
            if mode in ("die-replicating", "lagging"):
                store.wait_until_finished()
            small = mode == "tight" and step == 1
            store.save(step, state_for(rank, step, 100_000 if small else 300_000), blocking=False)
        store.wait_until_finished()
        dist.barrier()
        out["steps"] = {str(k): v for k, v in store.steps().items()}
        out["held"] = {str(k): v for k, v in peer.holdings().items()}
    elif mode == "priorities":  # CPU priority of the threads the store started, after a replicated save
        store.save(1, state_for(rank, 1))
        store.wait_until_finished()
        out["threads"] = threads(before)
        out["steps"] = {str(k): v for k, v in store.steps().items()}
    elif mode == "localize":  # bring every shard into RAM, then read RAM alone
        info = store.localize()
        out.update(step=info.step, ranks=info.ranks, ram=store.tiers[0].committed_steps())
        target = target_for(rank)
        info = store.restore_into(target, tiers=["ram"])
        want = state_for(rank, info.step)
        out.update(exact=all(target[k].tobytes() == want[k].tobytes() for k in ("w", "b")))
    elif mode == "restore-split":  # what each rank hears, and when
        target = target_for(rank)
        try:
            info = store.restore_into(target)
            out.update(step=info.step, exact=all(target[k].tobytes() == state_for(rank, info.step)[k].tobytes()
                                                  for k in ("w", "b")))
        except TierfsError as e:
            out["error"] = f"{type(e).__name__}: {e}"
        try:
            store.wait_until_finished()  # a rank that returned hears of the failure at its next call
        except TierfsError as e:
            out["later"] = f"{type(e).__name__}: {e}"
        out["held"] = {str(k): v for k, v in peer.holdings().items()}
    else:
        out["common"] = store.common_steps()  # what every rank can restore (a lost node's shard from a peer)
        target = target_for(rank)
        opened = made[0]
        info = store.restore_into(target)
        want = state_for(rank, info.step)  # compared as it returns: in place then
        out.update(step=info.step, tier=info.tier, peer=info.peer, skipped=[list(x) for x in info.skipped],
                   exact=all(target[k].tobytes() == want[k].tobytes() for k in ("w", "b"))
                   and target["step"] == info.step)
        if side is not None:  # returned while a replaced node still receives: it waits for this
            dist.barrier(group=side)
        # the rest of a restore that returned early, and the replicas a replaced node kept for others, come
        # back in the background
        store.wait_until_finished()
        out["ranks"] = info.ranks
        out["held"] = {str(k): v for k, v in peer.holdings().items()}
        out["loops"] = loops(before)
        # again into new arrays: a replaced node's shard still comes from its peer (restore_into left RAM as is)
        again, info = store.restore()
        out.update(again_tier=info.tier, again_exact=all(again[k].tobytes() == want[k].tobytes() for k in ("w", "b")))
        out["groups_restoring"] = made[0] - opened  # groups made by the restores (every group: at open)
        if reopen:  # the same store again in these processes, while another store of theirs is open (one
            # RAM tier of its own: a store group, and a commit group over the streams): it takes the group the
            # first gave back
            keeper = TieredStore([MemoryTier(os.path.join(shm, f"keeper{rank}"))])
            store.close()
            opened = made[0]
            store, peer = open_store()
            out["groups_reopening"] = made[0] - opened
            again, info = store.restore()  # over the groups taken back, the replaced node's shard still from its peer
            out.update(reopened_tier=info.tier, reopened_exact=all(again[k].tobytes() == want[k].tobytes()
                                                                   for k in ("w", "b")))
            out["loops_reopened"] = loops(before)
            keeper.close()
    store.close()
    finish(out)


if __name__ == "__main__":
    main()
