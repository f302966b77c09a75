"""bench_peer's lost-node phase: a rank's node is replaced (its RAM directory is gone) and the job restores.

Run inside each rank of bench_peer's gloo job. For two states, in turns:

- *own shards*: each rank's tensors are its own; the lost rank's shard comes from the peer keeping its
  replica;
- *data parallel*: every rank holds the same tensors (``replicated=`` every key); the lost rank gets them
  from the ranks holding them in RAM (each sends the part it stores), nothing was replicated;

the store is saved (RAM, ``LatestN(1)``, and ``PeerTier(replicas=1)``, unthrottled), closed, the last rank's
RAM directory removed, the store opened again and ``restore_into`` timed on every rank. Beside it, in the
same round, a plain gloo ``isend``/``irecv`` of as many bytes from rank 0 to the lost rank: the one-way
transfer time the restore is compared with; and before the node is lost, each rank's ``restore_into`` from its
own RAM: what the other ranks' restore is compared with (they return once their own state is in place). The re-seeding of the replicas the lost node kept for others
runs after ``restore_into`` returns; its time until ``wait_until_finished`` is reported apart.
"""

from __future__ import annotations

import shutil
import statistics
import time


def lost_node(dist, scratch, nbytes: int, repeats: int, say) -> dict[str, list[float]]:
    import torch

    from tierfs import TieredStore
    from tierfs.policies import LatestN
    from tierfs.tiers import MemoryTier, PeerTier

    rank, world = dist.get_rank(), dist.get_world_size()
    lost = world - 1
    out: dict[str, list[float]] = {}
    buf = torch.zeros(nbytes // 4)
    for rep in range(repeats):
        for label, seed, replicated in (("own shards", rank, None), ("data parallel", 0, "all")):
            g = torch.Generator().manual_seed(seed)
            state = {f"layer{i}": torch.randn(nbytes // 4 // 8, generator=g) for i in range(8)}
            declared = list(state) if replicated else None
            path = scratch.fresh(f"lost-{rep}-{seed}")

            def open_store() -> TieredStore:
                return TieredStore([MemoryTier(path, keep=LatestN(1)), PeerTier(replicas=1)], background_bandwidth=None)
            with open_store() as store:
                store.save(1, state, replicated=declared)
                store.wait_until_finished()
                target = {k: torch.zeros_like(v) for k, v in state.items()}
                dist.barrier()  # no node lost yet: each rank's restore from its own RAM, the others' baseline
                t0 = time.perf_counter()
                store.restore_into(target)
                intact = time.perf_counter() - t0
            dist.barrier()
            if rank == lost:
                shutil.rmtree(path)
            target = {k: torch.zeros_like(v) for k, v in state.items()}
            with open_store() as store:
                dist.barrier()
                t0 = time.perf_counter()
                info = store.restore_into(target)
                restored = time.perf_counter() - t0
                store.wait_until_finished()
                reseeded = time.perf_counter() - t0
            assert all(torch.equal(target[k], state[k]) for k in state), "restore is not bit-exact"
            assert rank != lost or info.tier == "peer", info
            # the plain one-way transfer of as many bytes, rank 0 -> the lost rank
            dist.barrier()
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(buf, lost)
            elif rank == lost:
                dist.recv(buf, 0)
            one_way = time.perf_counter() - t0
            role = "lost" if rank == lost else "other"
            out.setdefault(f"{label}: restore_into ({role} rank)", []).append(restored)
            out.setdefault(f"{label}: until re-seeded ({role} rank)", []).append(reseeded)
            out.setdefault(f"{label}: no node lost ({role} rank)", []).append(intact)
            if rank == lost:
                out.setdefault(f"{label}: one-way gloo", []).append(one_way)
            scratch.remove(f"lost-{rep}-{seed}")
        say(f"lost node: round {rep + 1} of {repeats}")
    return out


def report(nbytes: int, world: int, every: dict[str, list[float]]) -> None:
    print(f"\n### A lost node back: restore_into on a replaced node, {nbytes / 2**20:.0f} MiB per rank, {world} ranks\n")
    print("| state | restore_into, lost rank (s) | one-way gloo (s) | ratio | restore_into, other ranks (s) | "
          "other ranks, no node lost (s) | until re-seeded, lost rank (s) |")
    print("|---|---|---|---|---|---|---|")
    for label in ("own shards", "data parallel"):
        def med(key: str) -> float:
            return statistics.median(every[f"{label}: {key}"])
        ratios = [r / g for r, g in zip(every[f"{label}: restore_into (lost rank)"], every[f"{label}: one-way gloo"])]
        print(f"| {label} | {med('restore_into (lost rank)'):.3f} | {med('one-way gloo'):.3f} | "
              f"{statistics.median(ratios):.2f}x | {med('restore_into (other rank)'):.3f} | "
              f"{med('no node lost (other rank)'):.3f} | {med('until re-seeded (lost rank)'):.3f} |")
    print("\n- medians over rounds; ratio: each round's restore over the same round's one-way transfer (target "
          "<= 1.5x); other ranks: they return once their own state is in place (their sends to the lost rank "
          "go on after), beside the same restore from their own RAM before the node was lost; the re-seeding "
          "runs after restore_into returns")
